"""7, mixed: bots and people on one D, and the hits the release policy costs each of them.

Scripted conversations (a bot's, 1-3 s between turns) and human-paced ones (a person's think
time, lognormal: median 20 s, p95 2 min; the quick plan scales these down) arrive together,
through one router with releases on, on one D under no pressure. Per kind: the later turns
that hit and those that missed because the router had released their handle
(`miss;reason=released`), and D's pinned share over time (issue 48: a release delay learned
from the bots' gaps throws away the people's reuse).
"""

from __future__ import annotations

from typing import Any

from bench.pins import RELEASED, WORKLOAD, Sampler, Tick, releases, stack, summarize, windows
from bench.plan import Plan
from bench.stack import LoadGen
from bench.stats import fmt, pct, table
from harness.chat import get_json

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


def by_kind(res: dict[str, Any], step: float) -> dict[str, Any]:
    """Per kind of conversation: summarize()'s figures (D's pinned share is the whole D's),
    the later turns lost to a release, and the windows of its turns."""
    out: dict[str, Any] = {}
    for kind, count in res["conversations"].items():
        part = {
            "conversations": count,
            "turns": [t for t in res["turns"] if t["group"] == kind],
            "samples": res["samples"],
        }
        summary = summarize(part)
        summary["released"] = summary["later_misses"].get(RELEASED, 0)
        out[kind] = {"summary": summary, "windows": windows(part, step)}
    return out


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    tick("pins: mixed workload")
    with stack(plan, []) as st:
        spec = job(plan, st.url)
        with Sampler(st.d.url) as sampler:
            res = lg.run(spec, timeout=plan.pins_mixed_s + plan.pins_mixed_drain_s + 60.0)
        res["samples"] = sampler.samples
        pins_status = get_json(st.url + "/status")["pins"]
        return {
            "kinds": by_kind(res, plan.pins_mixed_window_s),
            "think": {k: think(plan, k) for k in KINDS},
            "think_scale": plan.pins_think_scale,
            "window_s": plan.pins_mixed_window_s,
            "series": sampler.samples,
            "releases": releases(st.url),
            "release_after_s": pins_status.get("release_after_s"),
            "commands": dict(st.commands),
        }


def _think_text(spec: dict[str, Any]) -> str:
    if spec["dist"] == "uniform":
        return f"uniform {spec['lo']:g}-{spec['hi']:g} s"
    return f"lognormal, median {spec['median_s']:g} s, p95 {spec['p95_s']:g} s"


def section(res: dict[str, Any] | None, plan: Plan) -> list[str]:
    if not res:
        return []
    kinds = res["kinds"]
    scaled = (
        ""
        if res["think_scale"] == 1
        else f" (this {plan.name} run scales people's think times by {res['think_scale']:g} "
        "so that it ends within a minute: read its losses as a smoke test, not a figure)"
    )
    pinned = [s["pinned"] for s in res["series"]]
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(res["releases"].items())) or "none"
    lines = [
        "### Bots and people on one D: hits lost to releases",
        "",
        f"Scripted and human-paced conversations arrive at {plan.pins_mixed_rate:g}/s each for "
        f"{plan.pins_mixed_s:g} s (their later turns until {plan.pins_mixed_drain_s:g} s after "
        "that; a turn whose think time runs past it is not sent) through one router with "
        f"releases on, on a D of {plan.pins_blocks:,} blocks under no pressure{scaled}. The "
        f"router's release delay at the end: {fmt(res['release_after_s'])} s; releases by "
        f"reason: {reasons}. D pinned p50 / max: {fmt(pct(pinned, 50))} / "
        f"{fmt(max(pinned, default=float('nan')))}.",
        "",
    ]
    rows = []
    for kind, arm in kinds.items():
        s = arm["summary"]
        others = sum(s["later_misses"].values()) - s["released"]
        rows.append(
            [
                kind,
                _think_text(res["think"][kind]),
                str(s["conversations"]),
                f"{s['turns']} ({s['failed']})",
                str(s["later_turns"]),
                str(s["later_hits"]),
                f"**{s['released']}**" if s["released"] else "0",
                str(others),
            ]
        )
    header = ["conversations", "think time", "n", "turns (failed)", "later turns", "hit"]
    lines += table([*header, f"lost to releases (`{RELEASED}`)", "other misses"], rows)
    lines += [
        f"Per {res['window_s']:g} s window (turns started in it, hits and losses of later turns):",
        "",
    ]
    names = list(kinds)
    longest = max(len(kinds[n]["windows"]) for n in names)
    wrows = []
    for i in range(longest):
        ws = [kinds[n]["windows"][i] if i < len(kinds[n]["windows"]) else None for n in names]
        pinned_max = max((w["pinned_max"] for w in ws if w is not None), default=float("nan"))
        cells = [f"{i * res['window_s']:g}", fmt(pinned_max)]
        cells += ["" if w is None else f"{w['turns']} / {w['hits']} / {w['released']}" for w in ws]
        wrows.append(cells)
    lines += table(["from s", "D pinned max", *(f"{n}: turns / hit / lost" for n in names)], wrows)
    return lines
