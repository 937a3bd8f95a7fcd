"""7. D's memory: what D's pinned handles do to its KV and to TTFT over time, releases on and off.

With `bidirectional_kv_xfer`, D pins every finished turn's KV for the engine's
`decoder_kv_blocks_ttl` (480 s, the default the simulators run here) unless a P reads it. The
workload is an open arrival process: conversations arrive at a rate (Poisson), a share of them
have one turn, the others several, with a client's think time between turns, and then they end
without saying so (as most clients do). The same seeded arrivals go through two stacks, each with
a fresh P and a small D under the H100/8B cost model: kvbaton as shipped (it releases at once
what nobody will read: superseded, unsaved, ended; and, once D passes its high-water mark,
those least likely to be read; a handle on a D with room is kept until --handle-ttl) and
kvbaton with `--no-release-pins`. The arms cannot take turns on one D (its pins
are the state measured), so they run one after the other; load and noise differ between them.
A thread samples D's `/sim/state` twice a second: the share of its blocks pinned for P and its
usage. Every turn is stamped with its start, and TTFT is summarized per window of time.
The section's mixed workload and its faults build on this module: bench/pins_mixed.py and
bench/pins_faults.py.
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.error
from collections import Counter
from collections.abc import Callable
from typing import Any

from bench.plan import Plan
from bench.stack import LoadGen, start_stack
from bench.stats import fmt, pct, summary_ms
from harness.chat import get_json
from harness.metrics import parse, scrape
from harness.stack import Stack

Tick = Callable[[str], None]

P_ARGS = ["--bidirectional", "--kv-recompute-threshold", "0", "--num-blocks", "65536"]
# D keeps the engine's own pin TTL (480 s): the run is shorter than it, so only releases free
# what nobody reads. Long conversations fit: 4096 tokens.
D_ARGS = ["--bidirectional", "--stream-kv-params", "--max-model-len", "4096"]
ROUTER_ARGS = ["--stream-kv-params"]
ARMS = {"releases on": [], "releases off": ["--no-release-pins"]}
WORKLOAD: dict[str, Any] = {
    "one_turn_share": 0.4,
    "turns": (2, 6),
    "think_s": 4.0,
    "system_words": (200, 600),
    "user_words": (20, 60),
    "output_tokens": (20, 60),
    "stream": True,
}
SAMPLE_S = 0.5
# The answer of a later turn whose handle the router released before the turn came.
RELEASED = "miss;reason=released"


def steps(_: Plan) -> int:
    return len(ARMS)


def job(plan: Plan, url: str) -> dict[str, Any]:
    return {
        "kind": "arrivals",
        "target": {"mode": "router", "urls": [url]},
        "rate": plan.pins_rate,
        "duration_s": plan.pins_s,
        "drain_s": plan.pins_timeout_s * 2,
        "request_timeout_s": plan.pins_timeout_s,
        "seed": 700,
        **WORKLOAD,
    }


class Sampler:
    """The D's pinned share and usage (all of them together), twice a second, on a thread,
    while a job runs."""

    def __init__(self, *d_urls: str) -> None:
        self.urls = [url + "/sim/state" for url in d_urls]
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            try:
                states = [get_json(url, timeout=2) for url in self.urls]
            except (TimeoutError, urllib.error.URLError):
                continue  # a D stalled on pins may not answer in time either
            total = sum(s["blocks"]["total"] for s in states)
            pins = [p for s in states for p in decoder_pins(s)]
            used = sum(s["blocks"]["usage"] * s["blocks"]["total"] for s in states)
            self.samples.append(
                {
                    "t": time.perf_counter() - self._t0,
                    "pinned": sum(len(p["block_ids"]) for p in pins) / total,
                    "usage": used / total,
                    "pins": float(len(pins)),
                }
            )


def decoder_pins(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The pins a D's /sim/state lists for P's reads (not P's leases)."""
    return [p for p in state["pins"] if p["kind"] == "decoder"]


def windows(res: dict[str, Any], step: float) -> list[dict[str, Any]]:
    """Per window of `step` seconds: the turns started in it (TTFT of those that answered,
    how many failed; of the later ones, the hits and those lost to a release) and D's pinned
    share and usage sampled in it."""
    turns, samples = res["turns"], res["samples"]
    end = max([t["start"] for t in turns] + [s["t"] for s in samples] + [0.0])
    out = []
    for i in range(int(end // step) + 1):
        lo, hi = i * step, (i + 1) * step
        ts = [t for t in turns if lo <= t["start"] < hi]
        ss = [s for s in samples if lo <= s["t"] < hi]
        out.append(
            {
                "t": lo,
                "turns": len(ts),
                "failed": sum(not t["ok"] for t in ts),
                "hits": sum(t["turn"] > 1 and t["reuse"].startswith("hit") for t in ts),
                "released": sum(t["turn"] > 1 and t["reuse"] == RELEASED for t in ts),
                "ttft": summary_ms([t["ttft"] for t in ts if t["ok"]]),
                "pinned_max": max((s["pinned"] for s in ss), default=float("nan")),
                "usage_max": max((s["usage"] for s in ss), default=float("nan")),
            }
        )
    return out


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    turns, samples = res["turns"], res["samples"]
    later = [t for t in turns if t["turn"] > 1 and t["ok"]]
    pinned = [s["pinned"] for s in samples]
    return {
        "conversations": res["conversations"],
        "turns": len(turns),
        "ok": sum(t["ok"] for t in turns),
        "failed": sum(not t["ok"] for t in turns),
        "errors": sorted({t["error"] for t in turns if t["error"]})[:3],
        "ttft": summary_ms([t["ttft"] for t in turns if t["ok"]]),
        "later_turns": len(later),
        "later_hits": sum(t["reuse"].startswith("hit") for t in later),
        "later_misses": dict(
            Counter(t["reuse"] for t in later if not t["reuse"].startswith("hit"))
        ),
        "pinned_p50": pct(pinned, 50),
        "pinned_max": max(pinned, default=float("nan")),
        "usage_max": max((s["usage"] for s in samples), default=float("nan")),
    }


def stack(plan: Plan, *router_flags: list[str]) -> contextlib.AbstractContextManager[Stack]:
    """A fresh P and a D of plan.pins_blocks blocks, a private Redis, and one router per
    flags list (ROUTER_ARGS and those flags), sharing that Redis."""
    d_args = [*D_ARGS, "--num-blocks", str(plan.pins_blocks), *plan.gpu.sim_args()]
    return start_stack(
        prefill_args=[[*P_ARGS, *plan.gpu.sim_args()]],
        decode_args=[d_args],
        router_args=[[*ROUTER_ARGS, *flags] for flags in router_flags],
        name="pins",
    )


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    out: dict[str, Any] = {"arms": {}, "commands": {}, "window_s": plan.pins_window_s}
    for name, flags in ARMS.items():
        tick(f"pins: {name}")
        with stack(plan, flags) as st:
            out["arms"][name] = one_arm(plan, lg, st)
            out["commands"][name] = commands(st)
    return out


def one_arm(plan: Plan, lg: LoadGen, st: Stack) -> dict[str, Any]:
    spec = job(plan, st.url)
    with Sampler(st.ds[0].url) as sampler:
        res = lg.run(spec, timeout=plan.pins_s + spec["drain_s"] + 60.0)
    res["samples"] = sampler.samples
    arm = {"summary": summarize(res), "windows": windows(res, plan.pins_window_s)}
    arm["releases"] = releases(st.url)
    arm["series"] = sampler.samples
    return arm


def releases(url: str) -> dict[str, int]:
    """The router's releases by reason (kvbaton_pin_releases_total), the failed and dropped
    ones by outcome."""
    out: dict[str, int] = {}
    for s in parse(scrape(url)):
        if s.name == "kvbaton_pin_releases_total" and s.value:
            outcome = s.labels["outcome"]
            key = s.labels["reason"] if outcome == "released" else outcome
            out[key] = out.get(key, 0) + int(s.value)
    return out


def commands(st: Stack) -> dict[str, list[str]]:
    return dict(st.commands)


def section(res: dict[str, Any], plan: Plan, png: str | None) -> list[str]:
    arms = res["arms"]
    lines = [
        "## 7. D's memory: pinned handles over time",
        "",
        f"{plan.pins_rate:g} conversations/s arrive for {plan.pins_s:g} s (Poisson; "
        f"{WORKLOAD['one_turn_share']:.0%} of one turn, the others "
        f"{WORKLOAD['turns'][0]}-{WORKLOAD['turns'][1]} turns, {WORKLOAD['think_s']:g} s mean "
        "think time between turns, system prompts of "
        f"{WORKLOAD['system_words'][0]}-{WORKLOAD['system_words'][1]} tokens, streamed answers "
        f"of {WORKLOAD['output_tokens'][0]}-{WORKLOAD['output_tokens'][1]} tokens), through "
        f"one P and one D of {plan.pins_blocks:,} blocks with the engine's own 480 s pin TTL "
        f"and the H100/8B cost model. A client gives up on a turn after {plan.pins_timeout_s:g} s. "
        "The arms run one after the other on fresh engines (D's pins are the state measured, "
        "so they cannot take turns on one D).",
        "",
    ]
    if png:
        lines += [f"![D's pinned share and TTFT p99 over time]({png})", ""]
    lines += [
        "| arm | turns | failed | TTFT p50 / p99 ms | later turns hit | D pinned p50 / max "
        "| D usage max | releases (by reason) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, arm in arms.items():
        s, rel = arm["summary"], arm["releases"]
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(rel.items()))
        lines.append(
            f"| {name} | {s['turns']} | {s['failed']} | {fmt(s['ttft']['p50'], 0)} / "
            f"{fmt(s['ttft']['p99'], 0)} | {s['later_hits']} of {s['later_turns']} | "
            f"{fmt(s['pinned_p50'])} / {fmt(s['pinned_max'])} | {fmt(s['usage_max'])} | "
            f"{reasons or 'none'} |"
        )
    lines += ["", f"Per {res['window_s']:g} s window (turns started in it):", ""]
    names = list(arms)
    header = ["from s"]
    for name in names:
        header += [f"{name}: turns (failed)", "TTFT p50 / p99 ms", "D pinned max"]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    rows = max(len(arms[n]["windows"]) for n in names)
    for i in range(rows):
        cells = [f"{i * res['window_s']:g}"]
        for name in names:
            ws = arms[name]["windows"]
            if i >= len(ws):
                cells += ["", "", ""]
                continue
            w = ws[i]
            cells += [
                f"{w['turns']} ({w['failed']})",
                f"{fmt(w['ttft']['p50'], 0)} / {fmt(w['ttft']['p99'], 0)}",
                fmt(w["pinned_max"]),
            ]
        lines.append("| " + " | ".join(cells) + " |")
    for name in names:
        s = arms[name]["summary"]
        if s["later_misses"]:
            misses = ", ".join(f"`{k}` {v}" for k, v in sorted(s["later_misses"].items()))
            lines += ["", f"{name}, later turns that missed (X-KV-Reuse): {misses}"]
        if s["errors"]:
            lines += ["", f"{name}, failures seen: " + "; ".join(f"`{e}`" for e in s["errors"])]
    lines.append("")
    return lines
