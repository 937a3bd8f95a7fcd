"""7. D's memory: what D's pinned handles do to its KV and to TTFT over time, releases on and off.

D pins every finished turn's KV for the engine's 480 s TTL unless a P reads it. The same seeded
arrivals go through kvbaton as shipped (it releases what nobody will read) and with
`--no-release-pins`, one after the other on fresh engines (D's pins are the state measured).
"""

from __future__ import annotations

import contextlib
import threading
import time
import urllib.error
from typing import Any

from bench.plan import Plan
from bench.screen import Screen, Table
from bench.stack import LoadGen, Tick, start_stack
from bench.stats import fmt, pct, summary_ms
from harness.chat import get_json
from harness.metrics import parse, scrape
from harness.stack import Stack

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
TITLE = "D's memory: pinned handles over time"
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
    """The share of the D's blocks pinned for P (all D together), twice a second, on a thread."""

    def __init__(self, *d_urls: str) -> None:
        self.urls = [url + "/sim/state" for url in d_urls]
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
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
            # the pins a D lists for P's reads (not P's leases)
            pins = (p for s in states for p in s["pins"] if p["kind"] == "decoder")
            pinned = sum(len(p["block_ids"]) for p in pins)
            self.samples.append({"t": time.perf_counter() - self._t0, "pinned": pinned / total})


def windows(res: dict[str, Any], step: float) -> list[dict[str, Any]]:
    """TTFT of the turns started in each window of `step` seconds (bench/plots.py draws it)."""
    turns = res["turns"]
    end = max([t["start"] for t in turns] + [0.0])
    return [
        {
            "t": i * step,
            "ttft": summary_ms(
                [t["ttft"] for t in turns if t["ok"] and i * step <= t["start"] < (i + 1) * step]
            ),
        }
        for i in range(int(end // step) + 1)
    ]


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    turns, pinned = res["turns"], [s["pinned"] for s in res["samples"]]
    later = [t for t in turns if t["turn"] > 1 and t["ok"]]
    return {
        "turns": len(turns),
        "ok": sum(t["ok"] for t in turns),
        "failed": sum(not t["ok"] for t in turns),
        "errors": sorted({t["error"] for t in turns if t["error"]})[:3],
        "ttft": summary_ms([t["ttft"] for t in turns if t["ok"]]),
        "later_turns": len(later),
        "later_hits": sum(t["reuse"].startswith("hit") for t in later),
        "released": sum(t["reuse"] == RELEASED for t in later),
        "pinned_p50": pct(pinned, 50),
        "pinned_max": max(pinned, default=float("nan")),
    }


def stack(plan: Plan, flags: list[str]) -> contextlib.AbstractContextManager[Stack]:
    """A fresh P and a D of plan.pins_blocks blocks, a private Redis, and a router with
    ROUTER_ARGS and flags."""
    d_args = [*D_ARGS, "--num-blocks", str(plan.pins_blocks), *plan.gpu.sim_args()]
    return start_stack(
        prefill=[[*P_ARGS, *plan.gpu.sim_args()]],
        decode=[d_args],
        routers=[[*ROUTER_ARGS, *flags]],
        name="pins",
    )


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    out: dict[str, Any] = {"arms": {}, "commands": {}, "window_s": plan.pins_window_s}
    for name, flags in ARMS.items():
        tick(f"pins: {name}")
        with stack(plan, flags) as st:
            spec = job(plan, st.url)
            with Sampler(st.d.url) as sampler:
                res = lg.run(spec, timeout=plan.pins_s + spec["drain_s"] + 60.0)
            res["samples"] = sampler.samples
            out["arms"][name] = {
                "summary": summarize(res),
                "windows": windows(res, plan.pins_window_s),
                "series": sampler.samples,
                "releases": releases(st.url),
            }
            out["commands"][name] = dict(st.commands)
    return out


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


def screens(res: dict[str, Any], plan: Plan) -> list[Screen]:
    header = ["arm", "turns (failed)", "TTFT p50 / p99 ms", "later turns hit"]
    header += ["lost to a release", "D pinned p50 / max"]
    on, off = res["arms"]["releases on"]["summary"], res["arms"]["releases off"]["summary"]
    freed = {name: sum(arm["releases"].values()) for name, arm in res["arms"].items()}
    answer = [
        f"Releases ({freed['releases on']} handles; off: {freed['releases off']}) hold D's "
        f"pinned share to {percent(on['pinned_max'])} at most (off: {percent(off['pinned_max'])})"
        f" and TTFT p99 to {fmt(on['ttft']['p99'], 0)} ms (off: {fmt(off['ttft']['p99'], 0)} ms).",
        f"Later turns lost to a release: {on['released']} of {on['later_turns']}.",
    ]
    question = (
        f"What do D's pinned handles do to its memory and to TTFT, with kvbaton's releases on "
        f"and off: {plan.pins_rate:g} conversations/s for {plan.pins_s:g} s "
        f"({WORKLOAD['one_turn_share']:.0%} of one turn, the others {WORKLOAD['turns'][0]}-"
        f"{WORKLOAD['turns'][1]}) on a P and a D of {plan.pins_blocks:,} blocks, the arms one "
        "after the other?"
    )
    table = Table(header, [_row(name, arm["summary"]) for name, arm in res["arms"].items()])
    return [Screen(TITLE, question, [table], answer, "bench-pins.png")]


def percent(x: float) -> str:
    return fmt(100 * x, 0) + "%"


def _row(name: str, s: dict[str, Any]) -> list[str]:
    ttft = f"{fmt(s['ttft']['p50'], 0)} / {fmt(s['ttft']['p99'], 0)}"
    hits, pinned = f"{s['later_hits']} of {s['later_turns']}", [s["pinned_p50"], s["pinned_max"]]
    pinned_text = " / ".join(map(percent, pinned))
    return [name, f"{s['turns']} ({s['failed']})", ttft, hits, str(s["released"]), pinned_text]
