"""1. Router overhead: the same requests straight to P and D, and through kvbaton.

Also the router's CPU per turn and per streamed chunk, and the Redis work per turn (4.).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Callable
from typing import Any

from bench import floor, hitpath, redis_cost
from bench.plan import Plan
from bench.stack import (
    LoadGen,
    RedisStats,
    cpu_seconds,
    passthrough,
    reset_caches,
    router_cpu,
    start_stack,
)
from bench.stats import per_chunk, summary_ms
from bench.workload import NONSTREAM_TOKENS, STREAM_TOKENS, SYSTEM_WORDS, USER_WORDS
from harness.router import RouterProc
from harness.stack import Stack, argv_of

Tick = Callable[[str], None]

# Zero-cost engines. Every request is a new conversation whose handle nobody reads. kvbaton
# releases those (section 7 measures it at the engine's own 480 s TTL), but the direct client
# and the floor are bare proxies that release nothing, as vLLM's example proxies: for them D's
# TTL is short, so that their pins do not fill D's pool during the tens of thousands of
# requests of this section.
P_ARGS = ["--num-blocks", "65536"]
D_ARGS = ["--bidirectional", "--decoder-kv-blocks-ttl", "2", "--sweep-interval", "0.5"]
D_ARGS += ["--num-blocks", "65536"]
# The "stock" figures are vLLM 0.32's shapes (no handle in a stream); "vllm 0.33" is the
# simulator's default: a null kv_transfer_params in every content chunk, the handle on the
# finish chunk, token ids asked for and cut from every chunk (the router learns the version).
V032 = ["--vllm-version", "0.32"]
# D paces its tokens like a GPU would (one SSE chunk per read at the router).
PACED = ["--decode-ms-per-token", "5"]
# Long streams (a model long enough for them): the router's CPU per chunk at 1,000 and at
# 16,000 tokens, side by side; D's pace is the plan's.
LONG_MODEL = ["--max-model-len", "20000"]
LONG_TOKENS = (1000, 16000)


def direct(st: Stack) -> dict[str, Any]:
    return {
        "mode": "direct",
        "prefill": [p.url for p in st.ps],
        "decode": [d.url for d in st.ds],
    }


def via_url(url: str) -> dict[str, Any]:
    """A target the load generator sends client requests to (a router, or the floor app)."""
    return {"mode": "router", "urls": [url]}


def via_router(st: Stack, index: int = 0) -> dict[str, Any]:
    return via_url(st.routers[index].url)


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


def digest(r: dict[str, Any]) -> dict[str, Any]:
    return {
        "latency": summary_ms(r["latency"]),
        "ttft": summary_ms(r["ttft"]),
        "per_chunk": summary_ms(per_chunk(r["span"], r["events"])),
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
    cpu0 = router_cpu(st)
    r = lg.run(spec, timeout=spec.get("deadline_s", 120.0) + 60.0)
    cpu = router_cpu(st) - cpu0
    return r, cpu, stats.read() if stats is not None else {}


def run(plan: Plan, lg: LoadGen, tick: Tick, no_reuse: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"cells": [], "chunk_cpu": {}, "monitor": {}, "commands": {}}
    routers = [[], ["--no-reuse"]] if no_reuse else [[]]
    with start_stack(
        prefill_args=[[*P_ARGS, *V032]],
        decode_args=[[*D_ARGS, *V032]],
        router_args=routers,
        name="overhead",
    ) as st:
        assert st.redis_url is not None
        stats = RedisStats(st.redis_url)
        try:
            with passthrough(st.ps[0].url, st.ds[0].url, "overhead-floor") as floor_app:
                st.commands["floor"] = argv_of(floor_app.proc)
                for stream in (False, True):
                    for conc, count in plan.overhead_counts:
                        out["cells"].append(
                            _cell(st, lg, plan, stats, stream, conc, count, tick, floor_app)
                        )
            out["chunk_cpu"]["stock"] = chunk_slope(st, lg, plan, tick)
            out["monitor"]["reuse"] = redis_cost.monitor_sample(st, lg, 0)
            if no_reuse:
                out["monitor"]["no-reuse"] = redis_cost.monitor_sample(st, lg, 1)
            tick("redis round trip")
            out["redis_rtt"] = redis_cost.rtt(st.redis_url)
            out["history_cost"] = redis_cost.history_cost(st.redis_url)
            out["pin_note_cost"] = redis_cost.pin_note_cost(st.redis_url)
        finally:
            stats.close()
        out["commands"]["stock"] = st.commands
    variants: tuple[tuple[str, list[str], list[str]], ...] = (
        ("stream-kv-params", [*V032, "--stream-kv-params"], ["--stream-kv-params"]),
        ("stock, paced", [*V032, *PACED], []),
        ("stream-kv-params, paced", [*V032, *PACED, "--stream-kv-params"], ["--stream-kv-params"]),
        ("vllm 0.33, paced", PACED, []),
    )
    for name, d_extra, r_args in variants:
        version = V032 if V032[0] in d_extra else []  # P speaks D's connector version
        with start_stack(
            prefill_args=[[*P_ARGS, *version]],
            decode_args=[[*D_ARGS, *d_extra]],
            router_args=[r_args],
            name="overhead-chunks",
        ) as st:
            if PACED[0] not in d_extra:
                out["chunk_cpu"][name] = chunk_slope(st, lg, plan, tick)
            else:
                # The same paced chunks through the stack's floor (bench/passthrough.py) on
                # these engines, in rounds alternating with the router's.
                with passthrough(st.ps[0].url, st.ds[0].url, "chunks-floor") as app:
                    paired = paired_slope(st, lg, plan, tick, app, paced=True)
                out["chunk_cpu"][name] = paired
                if name == "stock, paced":
                    out["chunk_passthrough"] = paired["floor"]
            out["commands"][f"chunks: {name}"] = st.commands
    tick("chunk cost of a bare relay (floor)")
    out["chunk_floor"] = floor.measure(connections=plan.chunk_runs)
    out["chunk_long"] = long_streams(plan, lg, tick)
    out["hit_path"] = hitpath.run(plan, lg, tick)
    return out


def long_streams(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    """Router CPU per chunk of 1,000- and 16,000-token streams (stock engines): each
    length's CPU-per-turn slope against an 8-token stream, so the turn's fixed cost is left
    out and what remains is the cost of a chunk that far into a stream."""
    pace = plan.long_ms_per_token
    with start_stack(
        prefill_args=[[*P_ARGS, *V032, *LONG_MODEL]],
        decode_args=[[*D_ARGS, *V032, *LONG_MODEL, "--decode-ms-per-token", str(pace)]],
        router_args=[[]],
        name="overhead-long",
    ) as st:
        n = plan.long_streams
        with passthrough(st.ps[0].url, st.ds[0].url, "long-floor") as app:
            out = paired_slope(
                st,
                lg,
                plan,
                tick,
                app,
                paced=pace > 0,
                lengths=(8, *LONG_TOKENS),
                count=n,
                concurrency=n,
                what="long streams",
            )
        out["streams"] = n
        out["ms_per_token"] = pace
        out["commands"] = st.commands
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
    floor_app: RouterProc,
) -> dict[str, Any]:
    """The three arms (direct, kvbaton, the stack's floor), in `plan.overhead_rounds` rounds
    in alternating order so that drift in the machine's load hits all alike; each arm's
    rounds are pooled."""
    cell: dict[str, Any] = {"stream": stream, "concurrency": conc, "count": count}
    warmup = max(plan.overhead_warmup, conc)
    per_round = max(1, count // plan.overhead_rounds)
    arms = [
        ("direct", direct(st)),
        ("kvbaton", via_router(st)),
        ("floor", via_url(floor_app.url)),
    ]
    pooled: dict[str, dict[str, Any]] = {}
    cpu = floor_cpu = 0.0
    redis_delta: dict[str, dict[str, float]] = {}
    tick(f"overhead {'stream' if stream else 'json'} c={conc}")
    for rnd in range(plan.overhead_rounds):
        for arm, target in arms if rnd % 2 == 0 else arms[::-1]:
            spec = closed_job(
                target, stream=stream, concurrency=conc, count=per_round, warmup=warmup, seed=rnd
            )
            floor0 = cpu_seconds(floor_app.proc.pid)
            r, used, delta = timed(st, lg, spec, stats if arm == "kvbaton" else None)
            pooled[arm] = merge(pooled.get(arm), r)
            if arm == "kvbaton":
                cpu += used
                redis_delta = add_delta(redis_delta, delta)
            elif arm == "floor":
                floor_cpu += cpu_seconds(floor_app.proc.pid) - floor0
    for arm, r in pooled.items():
        cell[arm] = digest(r)
    sent = pooled["kvbaton"]["sent"]
    cell["router_cpu_ms_per_turn"] = cpu / max(1, sent) * 1000.0
    cell["floor_cpu_ms_per_turn"] = floor_cpu / max(1, pooled["floor"]["sent"]) * 1000.0
    cell["redis_delta"] = redis_delta
    cell["turns"] = sent
    return cell


def merge(acc: dict[str, Any] | None, r: dict[str, Any]) -> dict[str, Any]:
    """Pool two load-generator results of the same arm."""
    if acc is None:
        return dict(r)
    out = dict(acc)
    for key in ("latency", "ttft", "span", "events", "error_examples"):
        out[key] = acc[key] + r[key]
    for key in ("ok", "failed", "sent", "wall_s"):
        out[key] = acc[key] + r[key]
    out["reuse"] = dict(Counter(acc.get("reuse", {})) + Counter(r.get("reuse", {})))
    return out


def add_delta(
    a: dict[str, dict[str, float]], b: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    out = {k: dict(v) for k, v in a.items()}
    for cmd, v in b.items():
        slot = out.setdefault(cmd, {"calls": 0.0, "usec": 0.0})
        slot["calls"] += v["calls"]
        slot["usec"] += v["usec"]
    return out


def paired_slope(
    st: Stack, lg: LoadGen, plan: Plan, tick: Tick, floor_app: RouterProc, **slope: Any
) -> dict[str, Any]:
    """The router's per-chunk slope (`chunk_slope`) and the floor's on the same engines, in
    `plan.chunk_rounds` rounds of both in alternating order. CPU time here drifts by 10-30%
    between runs, which moves both arms of a round alike: the router's work per chunk above
    the floor's is the median of the rounds' differences (`above_floor_us_at`), each arm's
    figures the medians of its rounds."""
    rounds: list[dict[str, dict[str, Any]]] = []
    for rnd in range(plan.chunk_rounds):
        arms = ((ROUTER, None), (FLOOR, floor_app))
        got = {
            arm: chunk_slope(st, lg, plan, tick, floor_app=app, **slope)
            for arm, app in (arms if rnd % 2 == 0 else arms[::-1])
        }
        rounds.append(got)
    out = _median_slope([r[ROUTER] for r in rounds])
    out["floor"] = _median_slope([r[FLOOR] for r in rounds])
    out["above_floor_us_at"] = {
        n: _median(
            [r[ROUTER]["us_per_chunk_at"][n] - r[FLOOR]["us_per_chunk_at"][n] for r in rounds]
        )
        for n in out["us_per_chunk_at"]
    }
    out["above_floor_us"] = list(out["above_floor_us_at"].values())[-1]
    out["rounds"] = [{arm: r[arm]["us_per_chunk_at"] for arm in (ROUTER, FLOOR)} for r in rounds]
    return out


ROUTER, FLOOR = "router", "floor"


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _median_slope(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per stream length the median of several `chunk_slope` results (CPU per turn, events,
    slope)."""
    first = runs[0]
    out: dict[str, Any] = {
        "runs": {
            n: {key: _median([r["runs"][n][key] for r in runs]) for key in first["runs"][n]}
            for n in first["runs"]
        },
        "us_per_chunk_at": {
            n: _median([r["us_per_chunk_at"][n] for r in runs]) for n in first["us_per_chunk_at"]
        },
    }
    out["us_per_chunk"] = list(out["us_per_chunk_at"].values())[-1]
    return out


def chunk_slope(
    st: Stack,
    lg: LoadGen,
    plan: Plan,
    tick: Tick,
    paced: bool = False,
    floor_app: RouterProc | None = None,
    lengths: tuple[int, ...] = (8, 128),
    count: int | None = None,
    concurrency: int = 32,
    what: str = "chunk cost",
) -> dict[str, Any]:
    """Router CPU per streamed chunk: the CPU-per-turn slope between the first of `lengths`
    (tokens per stream) and each other one; `us_per_chunk` is the one to the last.

    Back to back (zero-cost D) several chunks arrive per read; paced (D sleeps between
    tokens, as a GPU does) every chunk is its own read, wake-up and write. With
    `floor_app`, the passthrough's slope instead of the router's. `count` streams per
    length (default from the plan; at least 16 of the shortest, whose CPU per turn is the
    smallest reading), `concurrency` at a time, no warmup when `count` is given.
    """
    runs: dict[str, dict[str, float]] = {}
    if count is None:
        count, warmup = (plan.chunk_runs // 3 if paced else plan.chunk_runs), 32
    else:
        warmup = 0
    target = via_router(st) if floor_app is None else via_url(floor_app.url)
    who = "" if floor_app is None else " (floor)"
    for tokens in lengths:
        tick(f"{what} {tokens} tokens{' paced' if paced else ''}{who}")
        n = count if warmup or tokens != lengths[0] else max(count, 16)
        spec = closed_job(
            target, stream=True, concurrency=concurrency, count=n, warmup=warmup, seed=7
        )
        spec["max_tokens"] = tokens
        spec["request_timeout_s"] = 60.0 + tokens / 100.0  # a paced 16,000 tokens: 16 s+
        if floor_app is None:
            r, cpu, _ = timed(st, lg, spec, None)
        else:
            cpu0 = cpu_seconds(floor_app.proc.pid)
            r, _, _ = timed(st, lg, spec, None)
            cpu = cpu_seconds(floor_app.proc.pid) - cpu0
        events = sum(r["events"]) / max(1, len(r["events"]))
        runs[str(tokens)] = {"cpu_ms_per_turn": cpu / max(1, r["sent"]) * 1000.0, "events": events}
    base = runs[str(lengths[0])]
    slopes: dict[str, float | None] = {}
    for tokens in lengths[1:]:
        d_cpu = runs[str(tokens)]["cpu_ms_per_turn"] - base["cpu_ms_per_turn"]
        d_events = runs[str(tokens)]["events"] - base["events"]
        slopes[str(tokens)] = d_cpu * 1000.0 / d_events if d_events else None
    return {"runs": runs, "us_per_chunk": slopes[str(lengths[-1])], "us_per_chunk_at": slopes}
