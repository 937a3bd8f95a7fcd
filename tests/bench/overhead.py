"""1. Router overhead: the same requests straight to P and D, and through kvbaton.

Also the router's CPU per turn and per streamed chunk, and the Redis work per turn (4.).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.bench import redis_cost
from tests.bench.plan import Plan
from tests.bench.stack import LoadGen, RedisStats, Stack, post, start_stack
from tests.bench.stats import per_chunk, summary_ms

Tick = Callable[[str], None]

# Zero-cost engines. D pins its blocks for a short TTL: every request is a new conversation,
# whose handle is never read, and pins must not fill D's pool during a long run.
P_ARGS = ["--num-blocks", "65536"]
D_ARGS = ["--bidirectional", "--decoder-kv-blocks-ttl", "2", "--sweep-interval", "0.5"]
D_ARGS += ["--num-blocks", "65536"]
NONSTREAM_TOKENS = 16
STREAM_TOKENS = 32
SYSTEM_WORDS = 120
USER_WORDS = 40


def direct(st: Stack) -> dict[str, Any]:
    return {
        "mode": "direct",
        "prefill": [p.url for p in st.prefill],
        "decode": [d.url for d in st.decode],
    }


def via_router(st: Stack, index: int = 0) -> dict[str, Any]:
    return {"mode": "router", "urls": [st.routers[index].url]}


def closed_job(
    target: dict[str, Any], *, stream: bool, concurrency: int, count: int, warmup: int, seed: int
) -> dict[str, Any]:
    return {
        "kind": "closed",
        "target": target,
        "stream": stream,
        "max_tokens": STREAM_TOKENS if stream else NONSTREAM_TOKENS,
        "concurrency": concurrency,
        "count": count,
        "warmup": warmup,
        "seed": seed,
        "system_words": SYSTEM_WORDS,
        "user_words": USER_WORDS,
        "deadline_s": 180.0,
    }


def reset_caches(st: Stack) -> None:
    """Both arms start from empty prefix caches, so the engines do the same work."""
    for s in st.sims():
        post(s.url + "/reset_prefix_cache", {})


def digest(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "latency": summary_ms(r["latency"]),
        "ttft": summary_ms(r["ttft"]),
        "per_chunk": summary_ms(per_chunk(r["span"], r["events"])),
        "gap_p50_ms": r["gap_p50"] * 1000.0,
        "gap_p99_ms": r["gap_p99"] * 1000.0,
        "events": sum(r["events"]) / max(1, len(r["events"])),
        "ok": r["ok"],
        "failed": r["failed"],
        "errors": r["error_examples"],
        "sent": r["sent"],
        "wall_s": r["wall_s"],
        "per_s": r["ok"] / r["wall_s"] if r["wall_s"] else 0.0,
        "reuse": r.get("reuse", {}),
    }


def timed(
    st: Stack, lg: LoadGen, spec: dict[str, Any], stats: RedisStats | None
) -> tuple[dict[str, Any], float, dict[str, Any]]:
    """Run a job; also the router CPU seconds it cost and the Redis commandstats delta."""
    reset_caches(st)
    if stats is not None:
        stats.reset()
    cpu0 = st.router_cpu()
    r = lg.run(spec, timeout=spec.get("deadline_s", 120.0) + 60.0)
    cpu = st.router_cpu() - cpu0
    return r, cpu, stats.read() if stats is not None else {}


def run(plan: Plan, lg: LoadGen, tick: Tick, no_reuse: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"cells": [], "chunk_cpu": {}, "monitor": {}, "commands": {}}
    routers = [[], ["--no-reuse"]] if no_reuse else [[]]
    with start_stack(
        prefill_args=[P_ARGS], decode_args=[D_ARGS], router_args=routers, name="overhead"
    ) as st:
        assert st.redis_url is not None
        stats = RedisStats(st.redis_url)
        try:
            for stream in (False, True):
                for conc, count in plan.overhead_counts:
                    out["cells"].append(_cell(st, lg, plan, stats, stream, conc, count, tick))
            out["chunk_cpu"]["stock"] = chunk_slope(st, lg, plan, tick)
            out["monitor"]["reuse"] = redis_cost.monitor_sample(st, lg, 0)
            if no_reuse:
                out["monitor"]["no-reuse"] = redis_cost.monitor_sample(st, lg, 1)
            tick("redis round trip")
            out["redis_rtt"] = redis_cost.rtt(st.redis_url)
        finally:
            stats.close()
        out["commands"]["stock"] = st.commands
    with start_stack(
        prefill_args=[P_ARGS],
        decode_args=[[*D_ARGS, "--stream-kv-params"]],
        router_args=[["--stream-kv-params"]],
        name="overhead-40186",
    ) as st:
        out["chunk_cpu"]["stream-kv-params"] = chunk_slope(st, lg, plan, tick)
        out["commands"]["stream-kv-params"] = st.commands
    return out


def _cell(
    st: Stack,
    lg: LoadGen,
    plan: Plan,
    stats: RedisStats,
    stream: bool,
    conc: int,
    count: int,
    tick: Tick,
) -> dict[str, Any]:
    cell: dict[str, Any] = {"stream": stream, "concurrency": conc, "count": count}
    warmup = max(plan.overhead_warmup, conc)
    for arm, target in (("direct", direct(st)), ("kvbaton", via_router(st))):
        tick(f"overhead {'stream' if stream else 'json'} c={conc} {arm}")
        spec = closed_job(
            target, stream=stream, concurrency=conc, count=count, warmup=warmup, seed=conc
        )
        r, cpu, redis_delta = timed(st, lg, spec, stats if arm == "kvbaton" else None)
        cell[arm] = digest(r)
        if arm == "kvbaton":
            cell["router_cpu_ms_per_turn"] = cpu / max(1, r["sent"]) * 1000.0
            cell["redis_delta"] = redis_delta
            cell["turns"] = r["sent"]
    return cell


def chunk_slope(st: Stack, lg: LoadGen, plan: Plan, tick: Tick) -> dict[str, Any]:
    """Router CPU per streamed chunk: the CPU-per-turn slope between 8 and 128 tokens."""
    runs: dict[str, dict[str, float]] = {}
    for tokens in (8, 128):
        tick(f"chunk cost {tokens} tokens")
        spec = closed_job(
            via_router(st), stream=True, concurrency=16, count=plan.chunk_runs, warmup=16, seed=7
        )
        spec["max_tokens"] = tokens
        r, cpu, _ = timed(st, lg, spec, None)
        events = sum(r["events"]) / max(1, len(r["events"]))
        runs[str(tokens)] = {"cpu_ms_per_turn": cpu / max(1, r["sent"]) * 1000.0, "events": events}
    d_cpu = runs["128"]["cpu_ms_per_turn"] - runs["8"]["cpu_ms_per_turn"]
    d_events = runs["128"]["events"] - runs["8"]["events"]
    return {"runs": runs, "us_per_chunk": d_cpu * 1000.0 / d_events if d_events else None}
