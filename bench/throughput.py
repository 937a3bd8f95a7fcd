"""2. Throughput of one router core (the router pinned to CPU 1, the rest on CPU 0): open-loop
sweeps of first turns, and section 1's conversations closed loop at a few concurrencies.
A step holds when >= 95% of the offered turns complete and p99 stays under
min(HOLD_P99_FACTOR x, HOLD_P99_FLOOR_MS ms +) the first step's; a step that does not is run
once more, and the sweep stops at the first step that fails twice."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from bench import overhead
from bench.plan import Plan
from bench.screen import Screen, Table
from bench.stack import LoadGen, Tick, pin, start_stack, timed
from bench.stats import fmt, pct
from harness.stack import Stack

HOLD_P99_FACTOR = 3.0
HOLD_P99_FLOOR_MS = 25.0
ROUTER_CPU = 1
OTHERS_CPU = 0
# Zero-cost engines for floods of first turns: a conversation each, whose handle nobody reads,
# so D's pins live 2 s (they must not fill D's pool).
FIRST_TURNS: dict[str, Any] = {"prefill": [["--num-blocks", "65536"]]}
D_ARGS = ["--bidirectional", "--decoder-kv-blocks-ttl", "2", "--sweep-interval", "0.5"]
FIRST_TURNS["decode"] = [[*D_ARGS, "--num-blocks", "65536"]]


def can_pin() -> bool:
    return (os.cpu_count() or 1) >= 2 and hasattr(os, "sched_setaffinity")


@contextlib.contextmanager
def pinned(router: int, st: Stack, lg: LoadGen) -> Iterator[bool]:
    """The router on ROUTER_CPU, the engines, redis-server and the load generator on
    OTHERS_CPU, for the block (unpinned after it; the router is not, it is the block's own);
    whether every pin took (False, and nothing pinned, where pinning is impossible)."""
    others = [s.proc.pid for s in st.engines] + [lg.proc.pid]
    if st.redis_proc is not None:
        others.append(st.redis_proc.pid)
    try:
        if not can_pin():
            yield False
            return
        ok = [pin(router, {ROUTER_CPU}), *(pin(pid, {OTHERS_CPU}) for pid in others)]
        yield all(ok)
    finally:
        for pid in others:
            pin(pid, None)


def steps(plan: Plan) -> int:
    return 2 * plan.sweep_steps + len(plan.hit_tput_clients)


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    out: dict[str, Any] = {"pinned": False, "sweeps": {}}
    with (
        start_stack(**FIRST_TURNS, routers=[[]], name="throughput") as st,
        pinned(st.routers[0].proc.pid, st, lg) as ok,
    ):
        out["pinned"] = ok
        for kind, stream in (("json", False), ("stream", True)):
            out["sweeps"][kind] = sweep(st, lg, plan, stream, tick)
    out["hits"] = hit_levels(plan, lg, tick)
    return out


def sweep(st: Stack, lg: LoadGen, plan: Plan, stream: bool, tick: Tick) -> dict[str, Any]:
    steps: list[dict[str, Any]] = []
    rate = plan.sweep_start
    base_p99 = None
    for _ in range(plan.sweep_steps):
        tick(f"throughput {'stream' if stream else 'json'} {rate:.0f}/s")
        step = _step(st, lg, plan, stream, rate)
        base_p99 = step["p99_ms"] if base_p99 is None else base_p99
        limit = max(min(base_p99 * HOLD_P99_FACTOR, base_p99 + HOLD_P99_FLOOR_MS), 1.0)
        step["holds"] = _holds(step, limit)
        if not step["holds"]:
            # One tail spike (the engines' core is shared) must not end the sweep: retry once.
            step = _step(st, lg, plan, stream, rate)
            step["holds"] = _holds(step, limit)
            step["retried"] = True
        steps.append(step)
        if not step["holds"]:
            break
        rate *= plan.sweep_factor
    held = [s for s in steps if s["holds"]]
    best = max(held, key=lambda s: s["achieved"]) if held else None
    # What one fully used core would allow at the median CPU per turn measured under load.
    cpu = sorted(s["cpu_ms_per_turn"] for s in (held or steps))
    per_turn = cpu[len(cpu) // 2] if cpu else 0.0
    return {
        "steps": steps,
        "best": best,
        "cpu_ms_per_turn": per_turn,
        "ceiling_turns_s": 1000.0 / per_turn if per_turn else None,
        "sustained_turns_s": best["achieved"] if best else None,
    }


def _holds(step: dict[str, Any], limit_ms: float) -> bool:
    return bool(step["completed_ratio"] >= 0.95 and step["p99_ms"] <= limit_ms)


def _step(st: Stack, lg: LoadGen, plan: Plan, stream: bool, rate: float) -> dict[str, Any]:
    """First turns arriving at `rate` a second (one-turn conversations, a Poisson process)
    for plan.sweep_step_s seconds."""
    spec = overhead.job(plan, st.url, stream=stream, clients=1, rnd=int(rate), turns=1)
    spec.update(kind="arrivals", rate=rate, duration_s=plan.sweep_step_s, one_turn_share=1.0)
    spec["drain_s"] = 15.0
    r, cpu = timed(st, lg, spec, st.router.proc.pid, timeout=plan.sweep_step_s + 60.0)
    x = level(r, cpu)
    done = (x["turns"] - x["failed"]) / max(1, r["conversations"])
    return {"offered": rate, "achieved": x["turns_s"], "completed_ratio": done, **x}


def hit_levels(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    """Per level of plan.hit_tput_clients, section 1's conversations against the pinned
    router: turns/s, latency, the router's share of its core and its CPU per turn."""
    out: dict[str, Any] = {"pinned": False, "levels": [], "turns": plan.hit_turns}
    with overhead.stack("hit-throughput") as st:
        router = st.routers[0].proc.pid
        with pinned(router, st, lg) as ok:
            out["pinned"] = ok
            for rnd, clients in enumerate(plan.hit_tput_clients):
                tick(f"throughput hits c={clients}")
                spec = overhead.job(plan, st.url, stream=False, clients=clients, rnd=rnd)
                spec.update(n=max(plan.hit_tput_convs, 2 * clients), deadline_s=600.0)
                res, cpu_s = timed(st, lg, spec, router)
                out["levels"].append({"clients": clients, **level(res, cpu_s)})
    out["best"] = max(out["levels"], key=lambda x: x["turns_s"], default=None)
    return out


def level(res: dict[str, Any], cpu_s: float) -> dict[str, Any]:
    """A job's figures, with the ceiling of a fully busy core at its CPU per turn."""
    turns = res["turns"]
    ok = [t for t in turns if t["ok"]]
    wall = res["wall_s"] or 1e-9
    cpu_ms = cpu_s / max(1, len(turns)) * 1000.0
    return {
        "turns": len(turns),
        "failed": len(turns) - len(ok),
        "hits": sum(1 for t in ok if t["turn"] > 1 and t.get("reuse") == "hit"),
        "later": sum(1 for t in ok if t["turn"] > 1),
        "turns_s": len(ok) / wall,
        "p50_ms": pct([t["latency"] for t in ok], 50) * 1000.0,
        "p99_ms": pct([t["latency"] for t in ok], 99) * 1000.0,
        "router_cpu_util": cpu_s / wall,
        "cpu_ms_per_turn": cpu_ms,
        "ceiling_turns_s": 1000.0 / cpu_ms if cpu_ms else None,
    }


def screens(res: dict[str, Any], plan: Plan) -> list[Screen]:
    """Section 2: per load, the rate held, its latency there and the router's CPU."""
    core = "1 core" if res["pinned"] else "1 process, not pinned"
    rows = []
    for kind, sw in res["sweeps"].items():
        load = f"first turns, {'stream' if kind == 'stream' else 'JSON'}, {core}"
        figures = (sw["sustained_turns_s"], sw["cpu_ms_per_turn"], sw["ceiling_turns_s"])
        rows.append(_row(load, sw["best"] or {}, *figures))
    hits = res.get("hits") or {}
    where = core if hits.get("pinned") else "not pinned"
    for x in hits.get("levels", []):
        figures = (x["turns_s"], x["cpu_ms_per_turn"], x["ceiling_turns_s"])
        rows.append(_row(f"hits, JSON, {x['clients']} clients, {where}", x, *figures))
    head = ["load", "turns/s held", "p50 / p99 ms", "router CPU", "CPU ms/turn", "ceiling/s"]
    first = res["sweeps"]["json"]
    best_hits = f" and {fmt(hits['best']['turns_s'], 0)} hit turns/s" if hits.get("best") else ""
    answer = [
        f"On {core} the router sustains {fmt(first['sustained_turns_s'], 0)} JSON first "
        f"turns/s (a busy core's ceiling at its CPU per turn: "
        f"{fmt(first['ceiling_turns_s'], 0)}){best_hits}."
    ]
    question = (
        "How many turns/s does one router process sustain? Open-loop sweeps of first turns (a "
        f"step holds at >= 95% completed and p99 <= min({HOLD_P99_FACTOR:g}x, "
        f"+{HOLD_P99_FLOOR_MS:g} ms) of the first step's), closed-loop hit conversations; "
        "ceiling = 1000 / CPU ms per turn."
    )
    return [Screen("Throughput", question, [Table(head, rows)], answer, "bench-throughput.png")]


def _row(load: str, at: dict[str, Any], turns_s: Any, cpu: float, ceiling: Any) -> list[str]:
    """A load's row; `at`: the step (or hit level) that held the most, {} where none did."""
    latency = f"{fmt(at['p50_ms'])} / {fmt(at['p99_ms'])}" if at else "-"
    busy = f"{at['router_cpu_util'] * 100:.0f}%" if at else "-"
    return [load, fmt(turns_s, 0), latency, busy, fmt(cpu, 3), fmt(ceiling, 0)]
