"""6. KV events: what following the engines' KV events costs the router.

- Ingest: the router's own subscriber and index (router/engines/kv_events.py, kv_index.py) in
  this process, fed over TCP by a ZMQ publisher in another process with vLLM's wire format
  (topic, 8-byte seq, msgpack [ts, [BlockStored...], dp rank]); events and blocks applied per
  second, and this process's CPU per block.
- Per turn: the same multi-turn conversations (1 client, not streamed, so every turn after the
  first is the hit path: claim, /tokenize, verify, token-ids P leg, commit) through two routers
  on one stack, one reading both engines' KV events and one without, taking turns; latency p50
  and p90 of turns 2.. per router. The engines publish either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import zmq
import zmq.asyncio

from bench.plan import Plan
from bench.stack import READY_TIMEOUT, LoadGen, start_stack
from bench.stats import summary_ms
from harness.procs import ROOT, free_port
from harness.router import RouterProc, router
from router.engines.kv_events import Source, Subscriber
from router.engines.kv_index import EngineIndex

Tick = Callable[[str], None]

BLOCK = 16
EVENTS_PER_BATCH = 64
# The publisher: pre-encoded batches of BlockStored events (map-shaped, vLLM's newer form),
# each block chained to the one before, sent as fast as ZMQ takes them after "go".
PUBLISHER = """
import sys, time, msgspec, zmq
port, batches, per = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
enc = msgspec.msgpack.Encoder()
payloads, h = [], 0
for b in range(batches):
    events = []
    for _ in range(per):
        h += 1
        events.append({"type": "BlockStored", "block_hashes": [h],
            "parent_block_hash": h - 1 if h > 1 else None,
            "token_ids": [(h * 31 + i) % 50000 for i in range(16)], "block_size": 16,
            "lora_id": None, "medium": "GPU"})
    payloads.append(enc.encode([time.time(), events, None]))
ctx = zmq.Context()
pub = ctx.socket(zmq.PUB)
pub.setsockopt(zmq.SNDHWM, 0)
pub.bind(f"tcp://127.0.0.1:{port}")
print("ready", flush=True)
sys.stdin.readline()
for seq, p in enumerate(payloads):
    pub.send_multipart((b"kv-events", seq.to_bytes(8, "big"), p))
sys.stdin.readline()
"""


def ingest(batches: int) -> dict[str, Any]:
    """Blocks per second the router's subscriber applies, and its CPU per block."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, str(port), str(batches), str(EVENTS_PER_BATCH)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None and proc.stdin is not None
        proc.stdout.readline()  # "ready": encoded and bound
        return asyncio.run(_subscribe(port, batches, proc.stdin))
    finally:
        with contextlib.suppress(OSError, ValueError):
            assert proc.stdin is not None
            proc.stdin.close()
        proc.wait(10)


async def _subscribe(port: int, batches: int, go: Any) -> dict[str, Any]:
    ctx = zmq.asyncio.Context()
    index = EngineIndex(max_blocks=batches * EVENTS_PER_BATCH + 1)
    sub = Subscriber(Source("bench", f"tcp://127.0.0.1:{port}", topic="kv-events"), index, ctx)
    task = asyncio.create_task(sub.run())
    try:
        # Polled: the subscriber's state has no event to wait on (bench code only).
        while index.stale:  # noqa: ASYNC110 (connected; no replay endpoint: in sync at once)
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # the subscription reaches the publisher
        wall0, cpu0 = time.perf_counter(), time.process_time()
        go.write(b"go\n")
        go.flush()
        deadline = wall0 + 120.0
        while sub.counts.batches < batches and time.perf_counter() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.005)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        ctx.term()
    blocks = sub.counts.events
    return {
        "batches": sub.counts.batches,
        "sent_batches": batches,
        "blocks": blocks,
        "indexed": index.blocks,
        "gaps": sub.counts.gaps,
        "wall_s": wall,
        "blocks_s": blocks / wall if wall else 0.0,
        "events_s": sub.counts.batches / wall if wall else 0.0,
        "cpu_us_per_block": cpu * 1e6 / blocks if blocks else 0.0,
    }


def _events_args(urls: list[str], ports: list[int]) -> list[str]:
    return [
        a
        for u, p in zip(urls, ports, strict=True)
        for a in ("--kv-events", f"{u}=tcp://127.0.0.1:{p}")
    ]


@contextlib.contextmanager
def _stack(plan: Plan) -> Iterator[tuple[list[RouterProc], str]]:
    """1 P and 1 D (zero cost, bidirectional, publishing KV events), two routers."""
    ports = [free_port(), free_port()]
    base = ["--bidirectional", "--max-model-len", str(plan.max_model_len)]
    with start_stack(
        prefill_args=[[*base, "--kv-events-port", str(ports[0])]],
        decode_args=[[*base, "--kv-events-port", str(ports[1])]],
        router_args=[],
        name="events",
    ) as st:
        assert st.redis_url is not None
        p, d = [st.ps[0].url], [st.ds[0].url]
        with contextlib.ExitStack() as up:
            routers = [
                up.enter_context(
                    router(
                        p, d, *args, redis_url=st.redis_url, name=name, ready_timeout=READY_TIMEOUT
                    )
                )
                for name, args in (
                    ("events-off", []),
                    ("events-on", _events_args([*p, *d], ports)),
                )
            ]
            yield routers, st.redis_url


def conversation_job(plan: Plan, url: str, rnd: int) -> dict[str, Any]:
    return {
        "kind": "conversations",
        "target": {"mode": "router", "urls": [url]},
        "n": plan.events_convs,
        "turns": plan.events_turns,
        "concurrency": 1,
        "stream": False,
        "system_words": (300, 400),
        "user_words": (20, 40),
        "output_tokens": (16, 16),
        "jitter_s": 0.0,
        "seed": 77 + rnd,
        "deadline_s": 120.0,
        "request_timeout_s": 60.0,
    }


def per_turn(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    turns: dict[str, list[dict[str, Any]]] = {"events-off": [], "events-on": []}
    with _stack(plan) as (routers, _):
        for rnd in range(plan.events_rounds):
            order = routers if rnd % 2 == 0 else routers[::-1]
            for r in order:
                name = "events-on" if r is routers[1] else "events-off"
                tick(f"kv events: per turn, round {rnd + 1}, {name}")
                out = lg.run(conversation_job(plan, r.url, rnd), timeout=200.0)
                turns[name] += out["turns"]
    result: dict[str, Any] = {}
    for name, rows in turns.items():
        later = [t for t in rows if t["turn"] > 1 and t["ok"]]
        result[name] = {
            "first": summary_ms([t["latency"] for t in rows if t["turn"] == 1 and t["ok"]]),
            "later": summary_ms([t["latency"] for t in later]),
            "reuse": dict(Counter(t["reuse"] for t in later)),
            "failed": sum(1 for t in rows if not t["ok"]),
        }
    return result


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    tick("kv events: ingest")
    return {"ingest": ingest(plan.events_batches), "per_turn": per_turn(plan, lg, tick)}


def steps(plan: Plan) -> int:
    return 1 + 2 * plan.events_rounds


def section(r: dict[str, Any]) -> list[str]:
    ing, pt = r["ingest"], r["per_turn"]
    off, on = pt["events-off"], pt["events-on"]
    added = on["later"]["p50"] - off["later"]["p50"]
    lines = [
        "## 6. KV events: what following them costs",
        "",
        "Ingest: one subscriber (the router's own code, in one process) fed"
        f" {ing['sent_batches']:,} batches of {EVENTS_PER_BATCH} `BlockStored` events over TCP:"
        f" applied {ing['batches']:,}"
        f" ({ing['gaps']} gaps), **{ing['blocks_s']:,.0f} blocks/s** ({ing['events_s']:,.0f}"
        f" batches/s), {ing['cpu_us_per_block']:.1f} us of CPU per block, {ing['indexed']:,}"
        " blocks indexed.",
        "",
        "Per turn: the same conversations (1 client, not streamed, 16 output tokens) through two",
        "routers on one stack (1 P, 1 D, zero-cost simulators publishing events), taking turns.",
        "Turns 2.. are the hit path.",
        "",
        "| router | turn 1 p50 ms | turns 2.. p50 ms | turns 2.. p90 ms | turns 2.. outcomes "
        "| failed |",
        "|---|---|---|---|---|---|",
    ]
    for name, cell in (("without --kv-events", off), ("with --kv-events", on)):
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(cell["reuse"].items()))
        lines.append(
            f"| {name} | {cell['first']['p50']:.2f} | {cell['later']['p50']:.2f} |"
            f" {cell['later']['p90']:.2f} | {outcomes} | {cell['failed']} |"
        )
    lines += ["", f"Added by reading events, turns 2.. p50: **{added:+.2f} ms**.", ""]
    return lines
