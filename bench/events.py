"""6. KV events: what following the engines' KV events costs the router.

Ingest: the router's own subscriber and index in this process, fed over TCP by a ZMQ publisher
in another with vLLM's wire format. Per turn: the same conversations through two routers on one
stack, with and without --kv-events, taking turns (the engines publish either way).
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
import time
from typing import Any

import zmq
import zmq.asyncio

from bench.plan import Plan
from bench.screen import Screen, Table
from bench.stack import LoadGen, Tick, alternate, another_router, round_turns, start_stack
from bench.stats import fmt, turns_summary
from harness.procs import ROOT, free_port
from router.engines.kv_events import Source, Subscriber
from router.engines.kv_index import EngineIndex

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
    argv = [sys.executable, "-c", PUBLISHER, str(port), str(batches), str(EVENTS_PER_BATCH)]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT)
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
        "gaps": sub.counts.gaps,
        "blocks_s": blocks / wall if wall else 0.0,
        "cpu_us_per_block": cpu * 1e6 / blocks if blocks else 0.0,
    }


def job(plan: Plan, url: str, rnd: int) -> dict[str, Any]:
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
    """1 P and 1 D (zero cost, publishing KV events), a router without and one with
    --kv-events on one Redis, taking turns."""
    ports = [free_port(), free_port()]
    base = ["--bidirectional", "--max-model-len", str(plan.max_model_len)]
    with contextlib.ExitStack() as up:
        st = up.enter_context(
            start_stack(
                prefill_args=[[*base, "--kv-events-port", str(ports[0])]],
                decode_args=[[*base, "--kv-events-port", str(ports[1])]],
                router_args=[[]],
                name="events",
            )
        )
        sims = [st.ps[0].url, st.ds[0].url]
        args = [f"{u}=tcp://127.0.0.1:{p}" for u, p in zip(sims, ports, strict=True)]
        on = up.enter_context(
            another_router(st, "--kv-events", args[0], "--kv-events", args[1], name="events-on")
        )
        urls = {"events-off": st.url, "events-on": on.url}
        one = lambda name, rnd: lg.run(job(plan, urls[name], rnd), timeout=200.0)  # noqa: E731
        done = alternate(list(urls), plan.events_rounds, tick, "kv events: per turn", one)
    return {name: turns_summary(round_turns(rs), "latency") for name, rs in done.items()}


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    tick("kv events: ingest")
    return {"ingest": ingest(plan.events_batches), "per_turn": per_turn(plan, lg, tick)}


def steps(plan: Plan) -> int:
    return 1 + 2 * plan.events_rounds


def screens(res: dict[str, Any], plan: Plan) -> list[Screen]:
    ing, cells = res["ingest"], res["per_turn"]
    rows = []
    for name, c in cells.items():
        hits = sum(n for k, n in c["reuse"].items() if k.startswith("hit"))
        later = f"{fmt(c['later']['p50'])} / {fmt(c['later']['p90'])}"
        label = f"with{'' if name == 'events-on' else 'out'} --kv-events"
        hit = f"{hits} of {c['later']['n']}"
        rows.append([label, fmt(c["first"]["p50"]), later, hit, str(c["failed"])])
    on, off = (cells[k]["later"]["p50"] for k in ("events-on", "events-off"))
    header = ["router", "turn 1 p50 ms", "turns 2.. p50 / p90 ms", "turns 2.. hit", "failed"]
    question = (
        "What does following the engines' KV events cost: latency of the same conversations "
        "(1 client, JSON) through two routers on one P and one D, taking turns, and one "
        f"subscriber fed {ing['sent_batches']:,} batches of {EVENTS_PER_BATCH} blocks?"
    )
    answer = (
        f"A hit turn's p50 is {fmt(on)} ms with events, {fmt(off)} ms without ({on - off:+.2f}"
        f" ms); the subscriber applies {ing['blocks_s']:,.0f} blocks/s at "
        f"{fmt(ing['cpu_us_per_block'], 1)} us CPU each ({ing['batches']:,} batches, "
        f"{ing['gaps']} gaps)."
    )
    return [Screen("KV events", question, [Table(header, rows)], [answer])]
