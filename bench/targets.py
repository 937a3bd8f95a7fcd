"""The report's targets: each bound beside the reference it is measured against, same run
(a figure with no bound is on its part's screen, not here).

Two references that do not move with the machine or the cluster: the stack's floor
(bench/passthrough.py: Hypercorn + Starlette + aiohttp passing a turn through P and D with
nothing else) and the cost model's limit for a turn (bench/plan.py `turn_limit_ms`).
"""

from __future__ import annotations

import math
from typing import Any

from bench import hitpath, overhead, peers
from bench.plan import Plan
from bench.stats import fmt

# (target, reference, measured, met: None where the run gives no verdict: a router not
# pinned, D not paced, no ratio to take)
Row = tuple[str, str, str, bool | None]

OWN_FIRST_MS = 0.5
OWN_HIT_MS = 1.0
CPU_FIRST_X = 1.25
CPU_HIT_X = 1.25  # against the work floor (the floor plus a hit's /tokenize and Redis I/O)
CHUNK_ABOVE_FLOOR_US = 10.0
HIT_TURNS_S = 400.0  # hit-path turns/s one pinned router core serves
REFERENCE_X = 0.3  # own added p50 against vLLM's reference multi-turn proxy's, 16 clients
PEER_CPU_X = 1.5  # router CPU per turn on vLLM's multi-turn benchmark, against vllm-router's
LIMIT_SLACK = 1.10  # TTFT p50 within 10 % of the cost model's limit


def rows(results: dict[str, Any], plan: Plan) -> list[Row]:
    ov = results.get("overhead", {})
    out = [*own_rows(ov.get("hit_path")), *reference_rows(ov.get("hit_path"))]
    out += [*cpu_rows(ov, plan), *chunk_rows(ov)]
    out += limit_rows(results.get("reuse"), plan)
    out += hit_rate_rows((results.get("throughput") or {}).get("hits"))
    out += peer_rows(results.get("peers"))
    return out


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.nan


def _ok(value: float, bound: float) -> bool | None:
    return None if value != value else value <= bound


def _json_cell(cells: list[dict[str, Any]], conc: int = 1) -> dict[str, Any] | None:
    return next((c for c in cells if not c["stream"] and c["concurrency"] == conc), None)


def reference_rows(hit: dict[str, Any] | None) -> list[Row]:
    """kvbaton's added p50 against vLLM's reference proxy's, both over the floor."""
    clients = hitpath.REFERENCE_CLIENTS
    c = _json_cell((hit or {}).get("cells", []), clients)
    if c is None or "reference" not in c:
        return []
    proxy = "the reference proxy's"
    ref = "vLLM's disagg_proxy_multiturn.py, same conversations, alternating rounds "
    ref += "(*Router overhead*)"
    out: list[Row] = []
    for key, what in (("first", "first turns"), ("later", "hits")):
        x, theirs = hitpath.added_ratio(c, key), hitpath.own(c, key, arm="reference")
        target = f"own added p50 on {what}, {clients} clients: <= {REFERENCE_X:g}x {proxy}"
        measured = f"{fmt(x, 2)}x ({fmt(hitpath.own(c, key))} vs {fmt(theirs)} ms)"
        measured += _rounds_note(hitpath.round_ratios(c, key))
        out.append((target, ref, measured, _ok(x, REFERENCE_X)))
    return out


def _rounds_note(ratios: list[float]) -> str:
    """'; 8 rounds alone 0.30-0.41x' where there were several rounds."""
    if len(ratios) < 2:
        return ""
    return f"; {len(ratios)} rounds alone {fmt(min(ratios), 2)}-{fmt(max(ratios), 2)}x"


def own_rows(hit: dict[str, Any] | None) -> list[Row]:
    c = _json_cell((hit or {}).get("cells", []))
    if c is None:
        return []
    ref = "floor, same conversations, alternating rounds (*Router overhead*)"
    out: list[Row] = []
    for key, what, bound in (("first", "first turns", OWN_FIRST_MS), ("later", "hits", OWN_HIT_MS)):
        own = hitpath.own(c, key)
        k, f = c["kvbaton"][key]["p50"], c["floor"][key]["p50"]
        target = f"own added p50 on {what}, 1 client: <= {bound:g} ms"
        out.append((target, ref, f"{fmt(own)} ms ({fmt(k)} - {fmt(f)})", _ok(own, bound)))
    return out


def cpu_rows(ov: dict[str, Any], plan: Plan) -> list[Row]:
    out: list[Row] = []
    first = _json_cell(ov.get("cells", []))
    if first is not None:
        k, f = first["router_cpu_ms_per_turn"], first["floor_cpu_ms_per_turn"]
        x = _ratio(k, f)
        target = f"router CPU per first turn: <= {CPU_FIRST_X:g}x the floor's"
        ref = "floor's CPU per turn, same cell (*Router overhead*, JSON, 1 client)"
        out.append((target, ref, f"{fmt(x)}x ({fmt(k, 3)} vs {fmt(f, 3)} ms)", _ok(x, CPU_FIRST_X)))
    hits = _json_cell(ov.get("hit_path", {}).get("cells", []))
    if hits is not None and "work" in hits:
        k, w = hits["kvbaton"]["cpu_ms_per_turn"], hits["work"]["cpu_ms_per_turn"]
        share = f"{plan.hit_turns - 1} of every {plan.hit_turns} turns are hits"
        x = _ratio(k, w)
        target = f"router CPU per turn on hits: <= {CPU_HIT_X:g}x the work floor's"
        ref = "work floor's CPU per turn (the floor plus a hit's /tokenize and two Redis round "
        ref += f"trips), same conversations ({share})"
        out.append((target, ref, f"{fmt(x)}x ({fmt(k, 3)} vs {fmt(w, 3)} ms)", _ok(x, CPU_HIT_X)))
    return out


def chunk_rows(ov: dict[str, Any]) -> list[Row]:
    """The router's CPU per paced chunk above the floor's on the same engines: the median of
    alternating rounds' differences (bench/overhead.paired_slope)."""
    bound = f"<= {CHUNK_ABOVE_FLOOR_US:g} us above the floor's"
    stock = ov.get("chunk_cpu", {}).get(overhead.STOCK)
    rows = [_chunk_row(f"router CPU per paced SSE chunk ({overhead.STOCK}): {bound}", stock, "128")]
    long = ov.get("chunk_long") or {}
    pace = long.get("ms_per_token", 0.0)
    how = f" (D paced {pace:g} ms/token)" if pace else " (D back to back, `--quick`)"
    for n in overhead.LONG_TOKENS:
        target = f"the same per chunk of a {n:,}-token stream"
        # unpaced chunks share reads: no match for the floor's paced ones
        rows.append(_chunk_row(target, long, str(n), how, bounded=pace > 0))
    return [row for row in rows if row is not None]


def _chunk_row(
    target: str, c: dict[str, Any] | None, key: str, how: str = "", bounded: bool = True
) -> Row | None:
    """One per-chunk row of a paired slope at `key` tokens (None where it was not taken)."""
    above = (c or {}).get("above_floor_us_at", {}).get(key)
    if c is None or above is None:
        return None
    rounds = len(c["rounds"])
    ref = f"floor, the same chunks: {fmt(c['floor']['us_per_chunk_at'][key], 1)} us"
    ref += f" (medians of {rounds} alternating rounds)" if rounds > 1 else ""
    measured = f"{fmt(c['us_per_chunk_at'][key], 1)} us: {fmt(above, 1)} above"
    return (target, ref + how, measured, _ok(above, CHUNK_ABOVE_FLOOR_US) if bounded else None)


def limit_rows(res: dict[str, Any] | None, plan: Plan) -> list[Row]:
    if not res:
        return []
    out: list[Row] = []
    for arm, engines in (("a", "engines that stream their handle"), ("p", "stock engines")):
        run = res["runs"].get(f"ample/{arm}", {})
        worst = worst_limit_ratio(run, plan)
        if worst is None:
            continue
        turn, ratio = worst
        measured = run["ttft_by_turn"][str(turn)]["p50"]
        limit = run["limit_by_turn"][str(turn)]["p50"]
        target = f"TTFT p50 with reuse, every turn after the first, {engines}: within "
        target += f"{(LIMIT_SLACK - 1) * 100:.0f}% of the limit"
        ref = "cost model's limit per turn (*What reuse buys*)"
        figures = f"worst turn {turn}: {fmt(measured, 1)} vs {fmt(limit, 1)} ms, {fmt(ratio)}x"
        out.append((target, ref, figures, _ok(ratio, LIMIT_SLACK)))
    return out


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
    default policy, with the floor's (the stack doing no router work) where it ran."""
    arms = (res or {}).get("scenarios", {}).get(peers.MULTITURN.name, {}).get("arms", {})
    kv, peer, floor = peers.router_cpu(arms)
    if kv is None or peer is None:
        return []
    x = _ratio(kv, peer)
    measured = f"{fmt(x, 2)}x ({kv:.2f} vs {peer:.2f} ms)"
    if floor is not None:
        measured += f"; the floor alone {fmt(_ratio(floor, peer), 2)}x ({floor:.2f} ms)"
    target = f"router CPU per turn on vLLM's multi-turn benchmark: <= {PEER_CPU_X:g}x vllm-router's"
    ref = f"{peers.ARMS[2].name}, same scenario and rounds (*Side by side*)"
    return [(target, ref, measured, _ok(x, PEER_CPU_X))]


def hit_rate_rows(res: dict[str, Any] | None) -> list[Row]:
    best = (res or {}).get("best")
    if not best:
        return []
    pinned = bool(res and res.get("pinned"))
    where = "one core (router pinned)" if pinned else "one router process, not pinned"
    ref = "the hit path's conversations, closed loop (*Throughput*)"
    measured = (
        f"{fmt(best['turns_s'], 0)} turns/s at {best['router_cpu_util'] * 100:.0f}% of the "
        f"router's core; a fully busy core at {fmt(best['cpu_ms_per_turn'], 3)} ms CPU/turn: "
        f"{fmt(best['ceiling_turns_s'], 0)}"
    )
    # the target is a pinned core's: turns/s of an unpinned router are only a figure
    met = best["turns_s"] >= HIT_TURNS_S if pinned else None
    return [(f"hit turns/s, {where}: >= {HIT_TURNS_S:g}", ref, measured, met)]
