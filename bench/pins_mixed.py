"""7, mixed: bots and people on one D, and the hits the release policy costs each of them.

Scripted conversations (a bot's, 1-3 s between turns) and human-paced ones (lognormal think
time: median 20 s, p95 2 min; the quick plan scales these down) arrive together through one
router with releases on, on one D under no pressure (issue 48: a release delay learned from
the bots' gaps throws away the people's reuse).
"""

from __future__ import annotations

from typing import Any

from bench.pins import WORKLOAD, Sampler, stack, summarize
from bench.plan import Plan
from bench.stack import LoadGen, Tick

# Each kind's turns and the pause before every turn after the first (bench/loadgen.py,
# think_time); seeds of their own, so the two kinds do not say the same words.
KINDS: dict[str, dict[str, Any]] = {
    "scripted": {"turns": (3, 6), "think": {"dist": "uniform", "lo": 1.0, "hi": 3.0}, "seed": 710},
    "human": {
        "turns": (2, 3),
        "think": {"dist": "lognormal", "median_s": 20.0, "p95_s": 120.0},
        "seed": 720,
    },
}
SHARED = ("system_words", "user_words", "output_tokens", "stream")


def steps(_: Plan) -> int:
    return 1


def think(plan: Plan, kind: str) -> dict[str, Any]:
    """The kind's think time; a person's scaled by the plan (a quick run is short)."""
    spec = dict(KINDS[kind]["think"])
    if spec["dist"] == "lognormal":
        spec["median_s"] *= plan.pins_think_scale
        spec["p95_s"] *= plan.pins_think_scale
    return spec


def job(plan: Plan, url: str) -> dict[str, Any]:
    groups = {k: {**v, "one_turn_share": 0.0, "think": think(plan, k)} for k, v in KINDS.items()}
    return {
        "kind": "mixed",
        "target": {"mode": "router", "urls": [url]},
        "rate": plan.pins_mixed_rate,
        "duration_s": plan.pins_mixed_s,
        "drain_s": plan.pins_mixed_drain_s,
        "request_timeout_s": plan.pins_timeout_s,
        **{k: WORKLOAD[k] for k in SHARED},
        "groups": groups,
    }


def by_kind(res: dict[str, Any]) -> dict[str, Any]:
    """summarize() per kind of conversation (D's pinned share is the whole D's)."""
    out = {}
    for kind in res["conversations"]:
        turns = [t for t in res["turns"] if t["group"] == kind]
        out[kind] = {"summary": summarize({"turns": turns, "samples": res["samples"]})}
    return out


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    tick("pins: mixed workload")
    with stack(plan, []) as st:
        spec = job(plan, st.url)
        with Sampler(st.d.url) as sampler:
            res = lg.run(spec, timeout=plan.pins_mixed_s + plan.pins_mixed_drain_s + 60.0)
        res["samples"] = sampler.samples
        return {
            "kinds": by_kind(res),
            "think": {k: think(plan, k) for k in KINDS},
            "commands": dict(st.commands),
        }
