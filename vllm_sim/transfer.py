"""NixlConnector (pull mode) rules, pure: which leg a request is, what to pull, what to return.

Follows vLLM's nixl scheduler: get_num_new_matched_tokens, the worker's suffix trim of the
remote block list, and request_finished's returned dict.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

LegKind = Literal[
    "none", "plain", "pull_prompt", "pull_bidir", "push_producer", "push_consumer", "push_broken"
]

# vllm#47021: P declines a turn-2 read this close to D's deadline.
EXPIRY_SAFETY_MARGIN = 5.0


@dataclass(frozen=True)
class RemoteSource:
    """Where the KV to pull lives (the producer's side of kv_transfer_params)."""

    engine_id: str
    request_id: str
    host: str
    port: int
    block_ids: list[int]  # group 0
    num_tokens: int | None
    expiry: float | None
    cached_tokens: int | None  # P's remote_prefill_cached_tokens, echoed by D (vLLM 0.32)
    generation: int = 0  # remote_registration_generation (vLLM 0.33; the reader's default 0)


@dataclass(frozen=True)
class PushPeer:
    """Push mode (vllm_sim/push.py): P's coordinates as D was told them, and the transfer id."""

    engine_id: str
    host: str
    port: int
    tp_size: int
    pp_size: int
    request_id: str
    transfer_id: str


@dataclass(frozen=True)
class Leg:
    kind: LegKind
    is_producer: bool  # do_remote_decode: pin and return P-style params at the end
    source: RemoteSource | None = None
    push: PushPeer | None = None


def _group0(block_ids: Any) -> list[int] | None:
    if not isinstance(block_ids, list) or not block_ids:
        return None
    first = block_ids[0]
    if isinstance(first, list):
        ids = first
    elif isinstance(first, int):
        ids = block_ids  # a flat list: one group
    else:
        return None
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return None
    return list(ids)


def _source(params: Mapping[str, Any]) -> RemoteSource | None:
    """The remote source if every key vLLM requires is present and well-typed."""
    engine_id = params.get("remote_engine_id")
    request_id = params.get("remote_request_id")
    host = params.get("remote_host")
    port = params.get("remote_port")
    ids = _group0(params.get("remote_block_ids"))
    if not (isinstance(engine_id, str) and isinstance(request_id, str) and isinstance(host, str)):
        return None
    if not isinstance(port, int) or isinstance(port, bool) or ids is None:
        return None
    num_tokens = params.get("remote_num_tokens")
    expiry = params.get("remote_blocks_expiry_time")
    cached = params.get("remote_prefill_cached_tokens")
    generation = params.get("remote_registration_generation")
    return RemoteSource(
        engine_id=engine_id,
        request_id=request_id,
        host=host,
        port=port,
        block_ids=ids,
        num_tokens=num_tokens if isinstance(num_tokens, int) else None,
        expiry=float(expiry) if isinstance(expiry, int | float) else None,
        cached_tokens=cached if isinstance(cached, int) else None,
        generation=generation if isinstance(generation, int) else 0,
    )


def classify(params: Mapping[str, Any] | None, bidirectional: bool) -> Leg:
    if not params:
        return Leg("none", False)
    is_producer = bool(params.get("do_remote_decode"))
    source = _source(params)
    if params.get("do_remote_prefill") and source is not None:
        return Leg("pull_prompt", is_producer, source)
    # The D->P read branch needs bidirectional_kv_xfer (vLLM gates update_state_after_alloc
    # on it; without the flag real vLLM may wait forever, the simulator just ignores it).
    if is_producer and bidirectional and source is not None:
        return Leg("pull_bidir", is_producer, source)
    return Leg("plain", is_producer)


def tokens_to_pull(
    leg: Leg, prompt_len: int, local_hit: int, threshold: int, gate_prompt_pulls: bool = False
) -> int:
    """Tokens to read from the remote; 0 means read nothing (but still notify the producer).

    Under kv_recompute_threshold the request recomputes locally: always for D->P reads,
    for P->D pulls only when the threshold was set explicitly (gate_prompt_pulls).
    """
    if leg.source is None:
        return 0
    if leg.kind == "pull_prompt":
        count = max(0, prompt_len - local_hit)
        return 0 if gate_prompt_pulls and count < threshold else count
    if leg.kind != "pull_bidir":
        return 0
    # vLLM 0.32-0.33 read `remote_num_tokens or 0`: without it, or at 0, nothing is read and
    # D is only notified (the router's release of a pinned handle).
    remote = leg.source.num_tokens or 0
    count = min(remote, prompt_len) - local_hit
    if count <= 0 or count < threshold:
        return 0
    return count


def remote_blocks(remote_ids: Sequence[int], start: int, count: int, block_size: int) -> list[int]:
    """The remote blocks read for local positions [start, start+count) (start block-aligned).

    vLLM trims the remote list to its last num_local_blocks entries (vllm#43094 quotes
    `remote_block_ids[i] = remote_group[-num_local_blocks:]`), so a handle longer than the
    prompt is read with an offset: no content check, by design.
    """
    first = start // block_size
    last = (start + count - 1) // block_size
    needed = last - first + 1
    if needed > len(remote_ids):
        raise ValueError(f"need {needed} remote blocks, handle lists {len(remote_ids)}")
    return list(remote_ids[len(remote_ids) - needed :])


def is_expired(expiry: float | None, remote_now: float) -> bool:
    """vllm#47021: decline when the producer's estimated now + margin reaches its deadline."""
    return expiry is not None and remote_now + EXPIRY_SAFETY_MARGIN >= expiry


def finished_params(
    *,
    is_producer: bool,
    block_ids: list[int],
    engine_id: str,
    request_id: str,
    host: str,
    port: int,
    num_tokens: int,
    expiry: float | None,
    cached_tokens: int,
) -> dict[str, Any]:
    """request_finished's dict: P-style on a producer leg, D-style (bidirectional) otherwise."""
    params: dict[str, Any] = {
        "do_remote_prefill": is_producer,
        "do_remote_decode": not is_producer,
        "remote_block_ids": [block_ids],
        "remote_engine_id": engine_id,
        "remote_request_id": request_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "dcp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": num_tokens,
        "remote_blocks_expiry_time": expiry,
        "transfer_mode": "pull",
    }
    if is_producer:
        params["remote_prefill_cached_tokens"] = cached_tokens
    return params
