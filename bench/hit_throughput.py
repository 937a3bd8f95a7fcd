"""2, hits: how many hit-path turns one router core serves: section 1's hit path (bench/
hitpath.py) closed loop at a few concurrencies, the router pinned as in section 2's sweeps.
Per level: turns/s, latency, the router's share of its core, its CPU per turn and the
ceiling of a fully busy core at that CPU per turn."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench import hitpath
from bench.plan import Plan
from bench.stack import LoadGen, reset_caches, tree_cpu_seconds
from bench.stats import pct
from bench.throughput import pinned

Tick = Callable[[str], None]


def steps(plan: Plan) -> int:
    return len(plan.hit_tput_clients)


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    out: dict[str, Any] = {"pinned": False, "levels": [], "turns": plan.hit_turns}
    with hitpath.hit_stack("hit-throughput") as st:
        router = st.routers[0].proc.pid
        with pinned(router, st, lg) as ok:
            out["pinned"] = ok
            for rnd, clients in enumerate(plan.hit_tput_clients):
                tick(f"throughput hits c={clients}")
                reset_caches(st)
                spec = hitpath.job(plan, st.url, stream=False, clients=clients, rnd=rnd, ids=True)
                spec.update(n=max(plan.hit_tput_convs, 2 * clients), deadline_s=600.0)
                cpu0 = tree_cpu_seconds(router)
                res = lg.run(spec, timeout=660.0)
                out["levels"].append(level(clients, res, tree_cpu_seconds(router) - cpu0))
    best = max(out["levels"], key=lambda x: x["turns_s"], default=None)
    out["best"] = best
    return out


def level(clients: int, res: dict[str, Any], cpu_s: float) -> dict[str, Any]:
    turns = res["turns"]
    ok = [t for t in turns if t["ok"]]
    wall = res["wall_s"] or 1e-9
    cpu_ms = cpu_s / max(1, len(turns)) * 1000.0
    return {
        "clients": clients,
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
