"""The report's targets: each bound beside the reference it is measured against, same run
(a figure with no bound is on its part's screen, not here).

Two references that do not move with the machine or the cluster: the stack's floor
(bench/passthrough.py: Hypercorn + Starlette + aiohttp passing a turn through P and D with
nothing else) and the cost model's limit for a turn (bench/plan.py `turn_limit_ms`).
"""

from __future__ import annotations

import math
from typing import Any

from bench import overhead, peers
from bench.plan import Plan
from bench.stats import fmt

# (target, reference, measured, met: None where the run gives no verdict: a router not
# pinned, no ratio to take)
Row = tuple[str, str, str, bool | None]

OWN_FIRST_MS = 0.5
OWN_HIT_MS = 1.0
CPU_X = 1.25  # against the work floor (the floor plus a hit's /tokenize and Redis I/O)
HIT_TURNS_S = 400.0  # turns/s of section 1's conversations one pinned router core serves
PEER_CPU_X = 1.5  # router CPU per turn on vLLM's multi-turn benchmark, against vllm-router's
LIMIT_SLACK = 1.10  # TTFT p50 within 10 % of the cost model's limit


def rows(results: dict[str, Any], plan: Plan) -> list[Row]:
    c = overhead.first_json(results.get("overhead", {}))
    out = [*own_rows(c), *cpu_rows(c, plan)] if c is not None else []
    out += limit_rows(results.get("reuse"), plan)
    out += hit_rate_rows((results.get("throughput") or {}).get("hits"))
    out += peer_rows(results.get("peers"))
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def _ok(value: float, bound: float) -> bool | None:
    return None if value != value else value <= bound


def own_rows(c: dict[str, Any]) -> list[Row]:
    n = c["concurrency"]
    ref = "floor, same conversations, alternating rounds (*Router overhead*)"
    out: list[Row] = []
    for key, what, bound in (("first", "first turns", OWN_FIRST_MS), ("later", "hits", OWN_HIT_MS)):
        own = overhead.own(c, key)
        k, f = c["kvbaton"][key]["p50"], c["floor"][key]["p50"]
        target = f"own added p50 on {what}, {n} client{'s' * (n != 1)}: <= {bound:g} ms"
        out.append((target, ref, f"{fmt(own)} ms ({fmt(k)} - {fmt(f)})", _ok(own, bound)))
    return out


def cpu_rows(c: dict[str, Any], plan: Plan) -> list[Row]:
    k, w = c["kvbaton"]["cpu_ms_per_turn"], c["work"]["cpu_ms_per_turn"]
    share = f"{plan.hit_turns - 1} of every {plan.hit_turns} turns are hits"
    x = _ratio(k, w)
    target = f"router CPU per turn: <= {CPU_X:g}x the work floor's"
    ref = "work floor's CPU per turn (the floor plus a hit's /tokenize and two Redis round "
    ref += f"trips), same conversations ({share}; *Router overhead*, JSON)"
    return [(target, ref, f"{fmt(x)}x ({fmt(k, 3)} vs {fmt(w, 3)} ms)", _ok(x, CPU_X))]


def limit_rows(res: dict[str, Any] | None, plan: Plan) -> list[Row]:
    if not res:
        return []
    run = res["runs"].get("ample/a", {})
    worst = worst_limit_ratio(run, plan)
    if worst is None:
        return []
    turn, ratio = worst
    measured = run["ttft_by_turn"][str(turn)]["p50"]
    limit = run["limit_by_turn"][str(turn)]["p50"]
    target = "TTFT p50 with reuse, every turn after the first: within "
    target += f"{(LIMIT_SLACK - 1) * 100:.0f}% of the limit"
    ref = "cost model's limit per turn (*What reuse buys*)"
    figures = f"worst turn {turn}: {fmt(measured, 1)} vs {fmt(limit, 1)} ms, {fmt(ratio)}x"
    return [(target, ref, figures, _ok(ratio, LIMIT_SLACK))]


def worst_limit_ratio(run: dict[str, Any], plan: Plan) -> tuple[int, float] | None:
    """(turn, measured p50 / limit p50) of the turn after the first furthest from its limit."""
    if "limit_by_turn" not in run:
        return None
    ratios = [
        (t, _ratio(run["ttft_by_turn"][str(t)]["p50"], run["limit_by_turn"][str(t)]["p50"]))
        for t in range(2, plan.conv_turns + 1)
    ]
    ratios = [(t, r) for t, r in ratios if r == r]
    return max(ratios, key=lambda tr: tr[1]) if ratios else None


def peer_rows(res: dict[str, Any] | None) -> list[Row]:
    """kvbaton's router CPU per turn on vLLM's multi-turn benchmark against vllm-router's
    default policy."""
    arms = (res or {}).get("scenarios", {}).get(peers.MULTITURN.name, {}).get("arms", {})
    kv, peer = peers.router_cpu(arms)
    if kv is None or peer is None:
        return []
    x = _ratio(kv, peer)
    measured = f"{fmt(x, 2)}x ({kv:.2f} vs {peer:.2f} ms)"
    target = f"router CPU per turn on vLLM's multi-turn benchmark: <= {PEER_CPU_X:g}x vllm-router's"
    ref = f"{peers.ARMS[2].name}, same scenario and rounds (*Side by side*)"
    return [(target, ref, measured, _ok(x, PEER_CPU_X))]


def hit_rate_rows(res: dict[str, Any] | None) -> list[Row]:
    best = (res or {}).get("best")
    if not best:
        return []
    pinned = bool(res and res.get("pinned"))
    where = "one core (router pinned)" if pinned else "one router process, not pinned"
    ref = "*Router overhead*'s conversations, closed loop (*Throughput*)"
    measured = (
        f"{fmt(best['turns_s'], 0)} turns/s at {best['router_cpu_util'] * 100:.0f}% of the "
        f"router's core; a fully busy core at {fmt(best['cpu_ms_per_turn'], 3)} ms CPU/turn: "
        f"{fmt(best['ceiling_turns_s'], 0)}"
    )
    # the target is a pinned core's: turns/s of an unpinned router are only a figure
    met = best["turns_s"] >= HIT_TURNS_S if pinned else None
    return [(f"hit turns/s, {where}: >= {HIT_TURNS_S:g}", ref, measured, met)]
