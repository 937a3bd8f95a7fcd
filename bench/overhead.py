"""1. Router overhead: the same requests straight to P and D, through the floor and through
kvbaton; the router's CPU per turn and per paced chunk; and 4., the Redis work per turn."""

from __future__ import annotations

import statistics
from collections import Counter
from typing import Any

from bench import hitpath, redis_cost
from bench.plan import Plan
from bench.screen import Screen, Table
from bench.stack import LoadGen, RedisStats, Tick, passthrough, start_stack, timed
from bench.stats import fmt, summary_ms
from bench.workload import NONSTREAM_TOKENS, STREAM_TOKENS, SYSTEM_WORDS, USER_WORDS
from harness.router import RouterProc
from harness.stack import Stack, argv_of

# Zero-cost engines. Every request is a new conversation whose handle nobody reads: the
# direct client and the floor release no pins, so D's TTL is short (their pins must not fill
# D's pool during this section's tens of thousands of requests).
P_ARGS = ["--num-blocks", "65536"]
D_ARGS = ["--bidirectional", "--decoder-kv-blocks-ttl", "2", "--sweep-interval", "0.5"]
D_ARGS += ["--num-blocks", "65536"]
# "stock" is vLLM 0.32's stream (no handle in it; the simulator's default, 0.33, has a null
# kv_transfer_params in every content chunk and the handle on the finish chunk).
V032 = ["--vllm-version", "0.32"]
PACED = ["--decode-ms-per-token", "5"]  # as a GPU paces tokens: one SSE chunk per read
STOCK = "stock, paced"  # the per-chunk configuration: stock engines, D paced
# Long streams: CPU per chunk 1,000 and 16,000 tokens into a stream, D at the plan's pace.
LONG_MODEL = ["--max-model-len", "20000"]
LONG_TOKENS = (1000, 16000)


def direct(st: Stack) -> dict[str, Any]:
    return {"mode": "direct", "prefill": [p.url for p in st.ps], "decode": [d.url for d in st.ds]}


def via_url(url: str) -> dict[str, Any]:
    """A target the load generator sends client requests to (a router, or the floor app)."""
    return {"mode": "router", "urls": [url]}


def closed_job(
    target: dict[str, Any], *, stream: bool, concurrency: int, count: int, warmup: int, seed: int
) -> dict[str, Any]:
    job: dict[str, Any] = {"kind": "closed", "target": target, "stream": stream, "seed": seed}
    job.update(warmup=warmup, concurrency=concurrency, count=count, deadline_s=180.0)
    job.update(system_words=SYSTEM_WORDS, user_words=USER_WORDS)
    job["max_tokens"] = STREAM_TOKENS if stream else NONSTREAM_TOKENS
    return job


def run(plan: Plan, lg: LoadGen, tick: Tick, no_reuse: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"cells": [], "chunk_cpu": {}, "monitor": {}, "commands": {}}
    routers = [[], ["--no-reuse"]] if no_reuse else [[]]
    p, d = [[*P_ARGS, *V032]], [[*D_ARGS, *V032]]
    with start_stack(prefill_args=p, decode_args=d, router_args=routers, name="overhead") as st:
        assert st.redis_url is not None
        stats = RedisStats(st.redis_url)
        try:
            with passthrough(st.ps[0].url, st.ds[0].url, "overhead-floor") as floor_app:
                st.commands["floor"] = argv_of(floor_app.proc)
                for stream in (False, True):
                    for conc, count in plan.overhead_counts:
                        cell = _cell(st, lg, plan, stats, floor_app, tick, stream, conc, count)
                        out["cells"].append(cell)
            out["monitor"]["reuse"] = redis_cost.monitor_sample(st, lg, 0)
            if no_reuse:
                out["monitor"]["no-reuse"] = redis_cost.monitor_sample(st, lg, 1)
            tick("redis round trip")
            out["redis_rtt"] = redis_cost.rtt(st.redis_url)
        finally:
            stats.close()
        out["commands"]["stock"] = st.commands
    out["chunk_cpu"][STOCK] = _with_floor(
        [*P_ARGS, *V032], [*D_ARGS, *PACED, *V032], lg, plan, tick
    )
    out["commands"][f"chunks: {STOCK}"] = out["chunk_cpu"][STOCK].pop("commands")
    # Long streams, each length's slope against 8-token streams (a turn's fixed cost left out).
    pace, n = plan.long_ms_per_token, plan.long_streams
    d_long = [*D_ARGS, *V032, *LONG_MODEL, "--decode-ms-per-token", str(pace)]
    slope = {"lengths": (8, *LONG_TOKENS), "count": n, "concurrency": n}
    out["chunk_long"] = _with_floor([*P_ARGS, *V032, *LONG_MODEL], d_long, lg, plan, tick, **slope)
    out["chunk_long"].update(streams=n, ms_per_token=pace)
    out["hit_path"] = hitpath.run(plan, lg, tick)
    return out


def _with_floor(
    p: list[str], d: list[str], lg: LoadGen, plan: Plan, tick: Tick, **slope: Any
) -> dict[str, Any]:
    """`paired_slope` on a stack of its own (P's and D's arguments, a stock router), with the
    floor on the same engines."""
    with start_stack(prefill_args=[p], decode_args=[d], router_args=[[]], name="chunks") as st:
        with passthrough(st.ps[0].url, st.ds[0].url, "chunks-floor") as app:
            out = paired_slope(st, lg, plan, tick, app, **slope)
        out["commands"] = st.commands
    return out


def _cell(
    st: Stack,
    lg: LoadGen,
    plan: Plan,
    stats: RedisStats,
    floor_app: RouterProc,
    tick: Tick,
    stream: bool,
    conc: int,
    count: int,
) -> dict[str, Any]:
    """Direct, kvbaton and the floor in `plan.overhead_rounds` rounds in alternating order
    (the machine's drift hits all alike); each arm's rounds pooled."""
    cell: dict[str, Any] = {"stream": stream, "concurrency": conc, "count": count}
    warmup = max(plan.overhead_warmup, conc)
    per_round = max(1, count // plan.overhead_rounds)
    arms = [("direct", direct(st), None), ("kvbaton", via_url(st.url), st.router.proc.pid)]
    arms.append(("floor", via_url(floor_app.url), floor_app.proc.pid))
    pooled: dict[str, dict[str, Any]] = {}
    cpu = dict.fromkeys(("direct", "kvbaton", "floor"), 0.0)
    redis_delta: dict[str, dict[str, float]] = {}
    tick(f"overhead {'stream' if stream else 'json'} c={conc}")
    for rnd in range(plan.overhead_rounds):
        for arm, target, pid in arms if rnd % 2 == 0 else arms[::-1]:
            job = dict(concurrency=conc, count=per_round, warmup=warmup, seed=rnd)
            spec = closed_job(target, stream=stream, **job)
            r, used, delta = timed(st, lg, spec, pid, stats if arm == "kvbaton" else None)
            pooled[arm] = merge(pooled.get(arm), r)
            cpu[arm] += used
            for cmd, v in delta.items():
                slot = redis_delta.setdefault(cmd, {"calls": 0.0, "usec": 0.0})
                slot["calls"] += v["calls"]
                slot["usec"] += v["usec"]
    for arm, r in pooled.items():
        cell[arm] = {
            "latency": summary_ms(r["latency"]),
            "events": sum(r["events"]) / max(1, len(r["events"])),
            **{k: r[k] for k in ("ok", "failed", "sent", "wall_s")},
            "errors": r["error_examples"],
            "reuse": r.get("reuse", {}),
        }
    cell["turns"] = sent = pooled["kvbaton"]["sent"]
    cell["router_cpu_ms_per_turn"] = cpu["kvbaton"] / max(1, sent) * 1000.0
    cell["floor_cpu_ms_per_turn"] = cpu["floor"] / max(1, pooled["floor"]["sent"]) * 1000.0
    cell["redis_delta"] = redis_delta
    return cell


def merge(acc: dict[str, Any] | None, r: dict[str, Any]) -> dict[str, Any]:
    """Pool two load-generator results of the same arm."""
    if acc is None:
        return dict(r)
    out = {k: acc[k] + r[k] for k in ("latency", "events", "ok", "failed", "sent", "wall_s")}
    out["error_examples"] = acc["error_examples"] + r["error_examples"]
    out["reuse"] = dict(Counter(acc.get("reuse", {})) + Counter(r.get("reuse", {})))
    return out


ROUTER, FLOOR = "router", "floor"


def paired_slope(
    st: Stack, lg: LoadGen, plan: Plan, tick: Tick, floor_app: RouterProc, **slope: Any
) -> dict[str, Any]:
    """The router's per-chunk slope and the floor's on the same engines, `plan.chunk_rounds`
    rounds of both in alternating order. CPU time drifts 10-30% between runs and moves both
    arms of a round alike, so *above the floor* is the median of the rounds' differences."""
    rounds: list[dict[str, dict[str, Any]]] = []
    for rnd in range(plan.chunk_rounds):
        arms = ((ROUTER, None), (FLOOR, floor_app))
        order = arms if rnd % 2 == 0 else arms[::-1]
        rounds.append({arm: chunk_slope(st, lg, plan, tick, app, **slope) for arm, app in order})
    out: dict[str, Any] = median_tree([r[ROUTER] for r in rounds])
    out["floor"] = median_tree([r[FLOOR] for r in rounds])
    at = [(r[ROUTER]["us_per_chunk_at"], r[FLOOR]["us_per_chunk_at"]) for r in rounds]
    out["above_floor_us_at"] = median_tree([{n: k[n] - f[n] for n in k} for k, f in at])
    out["above_floor_us"] = list(out["above_floor_us_at"].values())[-1]
    out["rounds"] = [{arm: r[arm]["us_per_chunk_at"] for arm in (ROUTER, FLOOR)} for r in rounds]
    return out


def median_tree(trees: list[Any]) -> Any:
    """Each leaf's median over dicts of the same shape (a None leaf left out; all None: None)."""
    if isinstance(trees[0], dict):
        return {k: median_tree([t[k] for t in trees]) for k in trees[0]}
    known = [v for v in trees if v is not None]
    return statistics.median(known) if known else None


def chunk_slope(
    st: Stack,
    lg: LoadGen,
    plan: Plan,
    tick: Tick,
    floor_app: RouterProc | None = None,
    lengths: tuple[int, ...] = (8, 128),
    count: int | None = None,
    concurrency: int = 32,
) -> dict[str, Any]:
    """CPU per streamed chunk of the router (or with `floor_app`, of the floor): the slope of
    CPU per turn against events per turn between the first of `lengths` and each other.
    `count` streams per length (default a third of the plan's chunk runs, with a warmup; at
    least 16 of the shortest, whose CPU per turn is the smallest reading)."""
    runs: dict[str, dict[str, float]] = {}
    count, warmup = (plan.chunk_runs // 3, 32) if count is None else (count, 0)
    app = st.routers[0] if floor_app is None else floor_app
    for tokens in lengths:
        tick(f"chunk cost {tokens} tokens{'' if floor_app is None else ' (floor)'}")
        n = count if warmup or tokens != lengths[0] else max(count, 16)
        spec = closed_job(
            via_url(app.url), stream=True, concurrency=concurrency, count=n, warmup=warmup, seed=7
        )
        spec["max_tokens"] = tokens
        spec["request_timeout_s"] = 60.0 + tokens / 100.0  # a paced 16,000 tokens: 16 s+
        r, cpu, _ = timed(st, lg, spec, app.proc.pid)
        events = sum(r["events"]) / max(1, len(r["events"]))
        runs[str(tokens)] = {"cpu_ms_per_turn": cpu / max(1, r["sent"]) * 1000.0, "events": events}
    base = runs[str(lengths[0])]
    slopes: dict[str, float | None] = {}
    for tokens in lengths[1:]:
        d_cpu = runs[str(tokens)]["cpu_ms_per_turn"] - base["cpu_ms_per_turn"]
        d_events = runs[str(tokens)]["events"] - base["events"]
        slopes[str(tokens)] = d_cpu * 1000.0 / d_events if d_events else None
    return {"runs": runs, "us_per_chunk": slopes[str(lengths[-1])], "us_per_chunk_at": slopes}


def screens(res: dict[str, Any], plan: Plan) -> list[Screen]:
    """Section 1 (added latency and CPU per turn and per chunk) and section 4 (Redis)."""
    rows = []
    for c in res["cells"]:
        d, f, k = (c[a]["latency"] for a in ("direct", "floor", "kvbaton"))
        cpu = (c["router_cpu_ms_per_turn"], c["floor_cpu_ms_per_turn"])
        rows.append(
            [
                f"first, {'stream' if c['stream'] else 'JSON'}",
                str(c["concurrency"]),
                f"{fmt(d['p50'])} / {fmt(f['p50'])} / {fmt(k['p50'])}",
                f"{fmt(k['p50'] - f['p50'])} / {fmt(k['p99'] - f['p99'])}",
                " / ".join(fmt(x, 3) for x in cpu),
            ]
        )
    head = ["turns", "clients", "p50 ms: direct / floor / kvbaton", "kvbaton - floor ms: p50 / p99"]
    turns = Table([*head, "CPU ms/turn: kvbaton / floor"], rows + hitpath.rows(res.get("hit_path")))
    stock = res["chunk_cpu"][STOCK]
    figures = (stock["us_per_chunk"], stock["floor"]["us_per_chunk"], stock["above_floor_us"])
    rows = [[STOCK, *(_us(x) for x in figures)]]
    long = res.get("chunk_long")
    if long:
        how = f"D {long['ms_per_token']:g} ms/token" if long["ms_per_token"] else "unpaced"
        at = (long["us_per_chunk_at"], long["floor"]["us_per_chunk_at"], long["above_floor_us_at"])
        for n in LONG_TOKENS:
            rows.append([f"{n:,} tokens into a stream ({how})", *(_us(x.get(str(n))) for x in at)])
    chunks = Table(["CPU per SSE chunk, us", "kvbaton", "floor", "kvbaton above floor"], rows)
    c = res["cells"][0]
    k, f = c["kvbaton"]["latency"], c["floor"]["latency"]
    n = c["concurrency"]
    answer = [
        f"On a first JSON turn at {n} client{'s' * (n != 1)} kvbaton is "
        f"{fmt(k['p50'] - f['p50'])} ms p50 above the floor ({fmt(c['router_cpu_ms_per_turn'], 3)}"
        f" vs {fmt(c['floor_cpu_ms_per_turn'], 3)} ms CPU){hitpath.answer(res.get('hit_path'))}.",
        f"Per paced chunk (stock) kvbaton spends {_us(stock['us_per_chunk'])} us of CPU, the "
        f"floor {_us(stock['floor']['us_per_chunk'])}: {_us(stock['above_floor_us'])} us "
        "above it (the median of alternating rounds' differences).",
    ]
    question = (
        "What does kvbaton add to a turn and to a streamed chunk? The same seeded requests on "
        "zero-cost engines go straight to P and D (direct), through the floor (bench/"
        "passthrough.py: Hypercorn + Starlette + aiohttp doing the two legs, nothing else) and "
        "through kvbaton, in alternating rounds; CPU from /proc."
    )
    overhead = Screen("Router overhead", question, [turns, chunks], answer, "bench-overhead.png")
    return [overhead, redis_cost.screen(res)]


def _us(x: float | None) -> str:
    return fmt(x, 1) if x is not None else "-"
