"""The simulator's settings: one frozen struct, built once from the command line (and env)."""

from __future__ import annotations

import argparse
import os
import uuid
from collections.abc import Sequence

import msgspec

from vllm_sim.resp import parse_url
from vllm_sim.versions import NEWEST, VERSIONS, VllmVersion


class SimSettings(msgspec.Struct, frozen=True, kw_only=True):
    role: str = "prefill"
    vllm_version: str = NEWEST  # the vLLM release whose wire shapes it reproduces (versions.py)
    host: str = "127.0.0.1"
    port: int = 8000
    kv_port: int = 0  # 0: a free port, chosen when the side channel starts
    side_channel_host: str = "127.0.0.1"  # echoed as remote_host (VLLM_NIXL_SIDE_CHANNEL_HOST)
    engine_id: str = ""
    model: str = "sim-model"
    block_size: int = 16
    num_blocks: int = 4096
    max_model_len: int = 8192
    default_max_tokens: int = 64
    bidirectional: bool = False
    decoder_kv_blocks_ttl: float = 480.0
    kv_lease_duration: float = 30.0
    kv_recompute_threshold: int = 0
    # Set explicitly, the threshold also gates P->D pulls (newer base_scheduler).
    threshold_gates_prefill_pulls: bool = False
    kv_load_failure_policy: str = "fail"
    stream_kv_params: bool = False
    enable_scale_out: bool = False  # serve the render routes (else 403, as vLLM)
    reasoning_tokens: int = 0
    prefill_ms_per_token: float = 0.0
    transfer_ms_per_block: float = 0.0
    transfer_ms_per_pull: float = 0.0
    pull_step_ms: float = 0.0
    decode_ms_per_token: float = 0.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    kv_events_topic: str = "kv-events"
    api_key: str | None = None
    enable_request_id_headers: bool = False
    log_requests: bool = False
    sweep_interval: float = 1.0
    handshake_timeout: float = 5.0
    # nixl: NixlConnector pull; nixl-push: NixlPushConnector (vllm_sim/push.py); store: KV
    # through a shared store (MooncakeStoreConnector, vllm_sim/kvstore.py)
    kv_connector: str = "nixl"
    push_registration_timeout: float = 10.0
    # moriio: the proxy announced to (HOST:PORT, "": none), READ or WRITE, seconds between pings
    moriio_proxy: str = ""
    moriio_mode: str = "READ"
    moriio_ping_interval: float = 3.0
    data_parallel_size: int = 1  # vllm_sim/dp.py
    kv_store: str = ""  # the store's redis:// URL
    kv_store_save_decode: bool = False
    # vllm#51919 (open upstream; vllm_sim/handover.py): P ships token 1 in first_token_ids and
    # D emits it when its load completes; /v1/pd_kv_ready releases a parked D request.
    seed_first_token: bool = False
    pd_kv_ready: bool = False
    pd_park_timeout: float = 10.0
    num_speculative_tokens: int = 0  # only rules seeding out (speculative decoding)
    admission_ms: float = 0.0  # parse, tokenize and admit each request
    first_token_forward_ms: float = 0.0  # the fixed cost of the forward computing token 1

    @property
    def version(self) -> VllmVersion:
        return VERSIONS[self.vllm_version]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvbaton sim", description="A vLLM-compatible P/D engine simulator (NixlConnector)."
    )
    a = p.add_argument
    a("--role", choices=["prefill", "decode"], default="prefill")
    a(
        "--vllm-version",
        choices=sorted(VERSIONS),
        default=NEWEST,
        help="the vLLM release whose wire shapes to reproduce (default: the newest): 0.33 "
        "streams the handle (null in every content chunk), adds remote_registration_generation, "
        "NIXL connector version 15 (0.32: 14; they refuse to handshake), /pause and /sleep",
    )
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=8000, help="HTTP port (0: a free one)")
    a("--kv-port", type=int, default=0, help="side-channel port (default: a free one)")
    a("--side-channel-host", default=None, help="remote_host to advertise (default: --host)")
    a("--engine-id", default=None, help="default: a random uuid4")
    a("--model", default="sim-model", help="served model name")
    a("--block-size", type=int, default=16)
    a("--num-blocks", type=int, default=4096, help="KV capacity in blocks")
    a("--max-model-len", type=int, default=8192)
    a("--default-max-tokens", type=int, default=64, help="cap on chat max_tokens when absent")
    a("--bidirectional", action="store_true", help="vLLM's bidirectional_kv_xfer")
    a("--decoder-kv-blocks-ttl", type=float, default=480.0)
    a("--kv-lease-duration", type=float, default=30.0)
    a("--kv-recompute-threshold", type=int, default=None, help="default: 64 if bidir else 0")
    a("--kv-load-failure-policy", choices=["fail", "recompute"], default="fail")
    a(
        "--kv-connector",
        choices=["nixl", "nixl-push", "store", "moriio"],
        default="nixl",
        help="nixl: NixlConnector pull; nixl-push: NixlPushConnector (D registers, P writes); "
        "store: a shared store (--kv-store); moriio: MoRIIOConnector (vllm_sim/moriio.py)",
    )
    a("--moriio-proxy", default="", help="moriio: the router's registration HOST:PORT")
    a("--moriio-mode", choices=["READ", "WRITE"], default="READ", help="moriio: transfer mode")
    a("--moriio-ping-interval", type=float, default=3.0, help="moriio: seconds between pings")
    a(
        "--data-parallel-size",
        type=int,
        default=1,
        help="N engines (ranks) behind one API server, each with its own prefix cache, engine id "
        "<id>_dp<rank> and side channel --kv-port + rank; X-data-parallel-rank picks one",
    )
    a(
        "--push-registration-timeout",
        type=float,
        default=10.0,
        help="push mode: seconds D waits for P to write the blocks it registered",
    )
    a(
        "--stream-kv-params",
        action="store_true",
        help="vLLM PR #40186 on 0.32: params in the final chunk (0.33 always streams them)",
    )
    a(
        "--enable-scale-out",
        action="store_true",
        help="serve the render routes (/v1/chat/completions/render, /v1/completions/render, "
        "/v1/responses/render); without it they answer 403, as vLLM's do",
    )
    a("--reasoning-tokens", type=int, default=0, help="first N output tokens are reasoning")
    a("--prefill-ms-per-token", type=float, default=0.0)
    a("--transfer-ms-per-block", type=float, default=0.0)
    a(
        "--transfer-ms-per-pull",
        type=float,
        default=0.0,
        help="a pull's fixed cost beside its blocks: one NIXL read, from the step that starts "
        "it to its completion (docs/simulator.md, Cost model)",
    )
    a(
        "--pull-step-ms",
        type=float,
        default=0.0,
        help="an idle engine's empty step: the wait of a finished pull for the step that "
        "reports it (vLLM's WAITING_FOR_REMOTE_KVS)",
    )
    a("--decode-ms-per-token", type=float, default=0.0)
    a("--max-num-seqs", type=int, default=256, help="concurrent requests; the rest queue")
    a("--max-num-batched-tokens", type=int, default=8192, help="prompt tokens per step")
    a("--kv-events-port", type=int, default=None, help="ZMQ PUB port for KV events")
    a("--kv-events-replay-port", type=int, default=None, help="ZMQ ROUTER replay port")
    a("--kv-events-topic", default="kv-events")
    a("--api-key", default=None, help="require Authorization: Bearer KEY on /v1 (env VLLM_API_KEY)")
    a("--enable-request-id-headers", action="store_true", help="echo X-Request-Id")
    a("--log-requests", action="store_true", help="log each request's X-Request-Id (INFO)")
    a("--sweep-interval", type=float, default=1.0, help="seconds between expired-pin sweeps")
    a("--kv-store", default="", help="the shared KV store (store connector): redis://host:port/db")
    a(
        "--kv-store-save-decode",
        action="store_true",
        help="store: also write decode output blocks (on D: the prompt's too, vLLM's kv_both)",
    )
    a(
        "--seed-first-token",
        action="store_true",
        help="vllm#51919: P returns its token 1 in first_token_ids; D emits a seeded token "
        "when its KV load completes, without the forward (fallbacks: docs/simulator.md)",
    )
    a(
        "--pd-kv-ready",
        action="store_true",
        help="vllm#51919: serve POST /v1/pd_kv_ready and park a D request whose params say "
        "remote_ready: false until P's params arrive there",
    )
    a(
        "--pd-park-timeout",
        type=float,
        default=10.0,
        help="seconds a parked request waits for /v1/pd_kv_ready before it prefills locally",
    )
    a(
        "--num-speculative-tokens",
        type=int,
        default=0,
        help="speculative decoding (not simulated; it only rules out first-token seeding)",
    )
    a("--admission-ms", type=float, default=0.0, help="parse, tokenize and admit a request")
    a(
        "--first-token-forward-ms",
        type=float,
        default=0.0,
        help="the fixed cost of the forward that computes a request's token 1 (seeding spares "
        "D this one)",
    )
    return p


def parse_settings(argv: Sequence[str] | None) -> SimSettings:
    ns = build_parser().parse_args(argv)
    host = ns.host
    side_host = ns.side_channel_host or (host if host not in ("", "0.0.0.0", "::") else "127.0.0.1")
    threshold = ns.kv_recompute_threshold
    if threshold is None:
        threshold = 64 if ns.bidirectional else 0
    settings = SimSettings(
        role=ns.role,
        vllm_version=ns.vllm_version,
        host=host,
        port=ns.port,
        kv_port=ns.kv_port,
        side_channel_host=side_host,
        engine_id=ns.engine_id or str(uuid.uuid4()),
        model=ns.model,
        block_size=ns.block_size,
        num_blocks=ns.num_blocks,
        max_model_len=ns.max_model_len,
        default_max_tokens=ns.default_max_tokens,
        bidirectional=ns.bidirectional,
        decoder_kv_blocks_ttl=ns.decoder_kv_blocks_ttl,
        kv_lease_duration=ns.kv_lease_duration,
        kv_recompute_threshold=threshold,
        threshold_gates_prefill_pulls=ns.kv_recompute_threshold is not None,
        kv_load_failure_policy=ns.kv_load_failure_policy,
        kv_connector=ns.kv_connector,
        push_registration_timeout=ns.push_registration_timeout,
        moriio_proxy=ns.moriio_proxy,
        moriio_mode=ns.moriio_mode if ns.kv_connector == "moriio" else "",
        moriio_ping_interval=ns.moriio_ping_interval,
        data_parallel_size=ns.data_parallel_size,
        stream_kv_params=ns.stream_kv_params,
        enable_scale_out=ns.enable_scale_out,
        reasoning_tokens=ns.reasoning_tokens,
        prefill_ms_per_token=ns.prefill_ms_per_token,
        transfer_ms_per_block=ns.transfer_ms_per_block,
        transfer_ms_per_pull=ns.transfer_ms_per_pull,
        pull_step_ms=ns.pull_step_ms,
        decode_ms_per_token=ns.decode_ms_per_token,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        kv_events_port=ns.kv_events_port,
        kv_events_replay_port=ns.kv_events_replay_port,
        kv_events_topic=ns.kv_events_topic,
        api_key=ns.api_key or os.environ.get("VLLM_API_KEY") or None,
        enable_request_id_headers=ns.enable_request_id_headers,
        log_requests=ns.log_requests,
        sweep_interval=ns.sweep_interval,
        kv_store=ns.kv_store,
        kv_store_save_decode=ns.kv_store_save_decode,
        seed_first_token=ns.seed_first_token,
        pd_kv_ready=ns.pd_kv_ready,
        pd_park_timeout=ns.pd_park_timeout,
        num_speculative_tokens=ns.num_speculative_tokens,
        admission_ms=ns.admission_ms,
        first_token_forward_ms=ns.first_token_forward_ms,
    )
    check(settings)
    return settings


def check(s: SimSettings) -> None:
    """Reject settings the engine cannot honour (vLLM refuses to start on these too)."""
    if s.kv_connector == "nixl-push" and s.bidirectional:
        # vllm#46473: the push connector raises NotImplementedError for bidirectional_kv_xfer.
        raise SystemExit("--bidirectional is not supported with --kv-connector nixl-push")
    if s.kv_connector == "moriio" and s.bidirectional:
        raise SystemExit("--bidirectional is not supported with --kv-connector moriio")
    if s.kv_connector == "moriio" and s.data_parallel_size > 1 and not s.kv_port:
        # rank r's side channel must be at the announced port + r
        raise SystemExit("--kv-connector moriio with --data-parallel-size needs --kv-port")
    if s.data_parallel_size < 1:
        raise SystemExit("--data-parallel-size must be at least 1")
    if (
        s.block_size < 1
        or s.max_model_len < 2
        or s.max_num_seqs < 1
        or s.max_num_batched_tokens < 1
    ):
        raise SystemExit("block-size, max-model-len and max-num-seqs must be positive")
    needed = -(-s.max_model_len // s.block_size) + 1
    if s.num_blocks < needed:
        raise SystemExit(
            f"--num-blocks {s.num_blocks} cannot hold one max-model-len sequence "
            f"({needed} blocks including the reserved null block)"
        )
    if (s.kv_connector == "store") != bool(s.kv_store):
        raise SystemExit("--kv-store URL goes with --kv-connector store, and only with it")
    if s.kv_store:
        try:
            parse_url(s.kv_store)
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
