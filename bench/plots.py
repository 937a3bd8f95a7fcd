"""The report's PNG plots (matplotlib, Agg backend)."""

from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import matplotlib.ticker

from bench.peers import arm_names

ARM_STYLE = {"a": ("tab:green", "reuse + affinity"), "b": ("tab:orange", "affinity only")}


def _log_y(ax: Any) -> None:
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())


def _save(fig: Any, title: str, path: Path) -> None:
    fig.suptitle(title)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def overhead(results: dict[str, Any], path: Path) -> None:
    """kvbaton minus the floor vs clients, p50 and p90: first and later turns, JSON and stream."""
    cells = results["cells"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    for ax, q in zip(axes, ("p50", "p90"), strict=True):
        for stream, style in ((False, "-"), (True, "--")):
            rows = [c for c in cells if c["stream"] == stream]
            for key, marker, turns in (("first", "o", "turn 1"), ("later", "s", "turns 2..")):
                ys = [c["kvbaton"][key][q] - c["floor"][key][q] for c in rows]
                label = f"{'stream' if stream else 'JSON'}, {turns}"
                ax.plot([c["concurrency"] for c in rows], ys, marker + style, label=label)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({c["concurrency"] for c in cells}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("concurrent clients")
        ax.set_ylabel(f"kvbaton minus the floor, {q} (ms)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, "What kvbaton adds to a turn over the floor (zero-cost engines)", path)


def ttft(results: dict[str, Any], path: Path) -> None:
    """TTFT per turn index, p50 (solid) and p90 (dashed), per arm, per prefill cache size."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), constrained_layout=True, sharey=True)
    turns = max(len(r.get("ttft_by_turn", ())) for r in results["runs"].values())
    xs = list(range(1, turns + 1))
    for ax, cache in zip(axes, ("ample", "small"), strict=True):
        for arm, (color, label) in ARM_STYLE.items():
            by_turn = results["runs"].get(f"{cache}/{arm}", {}).get("ttft_by_turn")
            if not by_turn:
                continue
            p50 = [by_turn[str(t)]["p50"] for t in xs]
            p90 = [by_turn[str(t)]["p90"] for t in xs]
            if any(not math.isnan(v) for v in p50):
                ax.plot(xs, p50, "o-", color=color, label=f"{label} p50")
                ax.plot(xs, p90, ":", color=color, label=f"{label} p90")
        _log_y(ax)
        ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.set_xticks(xs)
        ax.set_xlabel("turn")
        ax.set_title(f"{cache} prefill cache")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("time to first token (ms, log)")
    axes[0].legend(fontsize=7)
    _save(fig, "TTFT per turn, Llama-3-8B/H100 cost model, 2 P + 2 D simulators", path)


def throughput(results: dict[str, Any], path: Path) -> None:
    """p99 latency and achieved rate vs offered rate, per sweep."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    lines = [(f"{name}, 1 worker on 1 core", "o-", sw) for name, sw in results["sweeps"].items()]
    for name, style, sweep in lines:
        steps = sweep["steps"]
        offered = [s["offered"] for s in steps]
        axes[0].plot(offered, [s["achieved"] for s in steps], style, label=name)
        axes[1].plot(offered, [s["p99_ms"] for s in steps], style, label=name)
    lim = max((s["offered"] for _, _, sw in lines for s in sw["steps"]), default=1)
    axes[0].plot([0, lim], [0, lim], color="grey", lw=0.8, label="achieved = offered")
    axes[0].set_xlabel("offered turns/s")
    axes[0].set_ylabel("completed turns/s")
    axes[1].set_xlabel("offered turns/s")
    axes[1].set_ylabel("p99 latency (ms, log)")
    _log_y(axes[1])
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, "router throughput, pinned to one core", path)


def pins(results: dict[str, Any], path: Path) -> None:
    """D's pinned share (every sample) and TTFT p99 per window, over time, per arm."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 4), constrained_layout=True)
    colours = {"releases on": "tab:green", "releases off": "tab:red"}
    step = results["window_s"]
    for name, arm in results["arms"].items():
        colour, series = colours.get(name), arm["series"]
        t, pinned = [s["t"] for s in series], [s["pinned"] for s in series]
        axes[0].plot(t, pinned, color=colour, label=name)
        ws = [w for w in arm["windows"] if w["ttft"]["n"]]
        xs = [w["t"] + step / 2 for w in ws]
        axes[1].plot(xs, [w["ttft"]["p99"] for w in ws], "o-", color=colour, label=f"{name}, p99")
        axes[1].plot(xs, [w["ttft"]["p50"] for w in ws], "s--", color=colour, label=f"{name}, p50")
    axes[0].set_ylabel("share of D's blocks pinned for P")
    axes[0].set_ylim(0, 1.02)
    axes[1].set_ylabel("TTFT of the turns started (ms, log)")
    _log_y(axes[1])
    for ax in axes:
        ax.set_xlabel("seconds from the first arrival")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    _save(fig, "D's memory under an arrival process, releases on and off", path)


# kvbaton's arms green, the peers' in other colours (each in section 8's order).
KVBATON_COLOURS = ("tab:green", "yellowgreen")
PEER_COLOURS = ("tab:red", "tab:purple", "tab:brown", "tab:pink", "tab:blue", "tab:orange")


def _colours(arms: list[str]) -> dict[str, str]:
    ours = [a for a in arms if a.startswith("kvbaton")]
    theirs = [a for a in arms if a not in ours]
    out = {a: KVBATON_COLOURS[i % len(KVBATON_COLOURS)] for i, a in enumerate(ours)}
    out.update({a: PEER_COLOURS[i % len(PEER_COLOURS)] for i, a in enumerate(theirs)})
    return out


def peers(results: dict[str, Any], path: Path) -> None:
    """Section 8: TTFT after turn 1 per arm and scenario (bar: p50, line up to p90), and the
    share of turns that failed."""
    scenarios = results["scenarios"]
    arms = arm_names(scenarios)
    fig, axes = plt.subplots(
        1, 2, figsize=(13, 4.8), constrained_layout=True, gridspec_kw={"width_ratios": [3, 1]}
    )
    width = 0.8 / max(1, len(arms))
    colours = _colours(arms)
    for i, arm in enumerate(arms):
        colour = colours[arm]
        xs, p50, p90, failed = [], [], [], []
        for x, sc in enumerate(scenarios.values()):
            s = sc["arms"].get(arm, {}).get("summary")
            if not s:
                continue
            xs.append(x - 0.4 + width * (i + 0.5))
            p50.append(s["ttft_later"]["p50"])
            p90.append(s["ttft_later"]["p90"])
            failed.append(100.0 * s["failed"] / max(1, s["turns"]))
        axes[0].bar(xs, p50, width, color=colour, label=arm)
        axes[0].vlines(xs, p50, p90, color="black", lw=1)
        axes[0].plot(xs, p90, "_", color="black", ms=max(3, 60 * width))
        axes[1].bar(xs, failed, width, color=colour)
    for ax, wrap in zip(axes, (16, 8), strict=True):
        ax.set_xticks(range(len(scenarios)))
        labels = [textwrap.fill(n, wrap, break_long_words=False) for n in scenarios]
        ax.set_xticklabels(labels, fontsize=8)
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("TTFT after turn 1 (ms): bar p50, line up to p90")
    axes[0].legend(fontsize=7, ncol=2)
    axes[1].set_ylabel("turns failed (%)")
    axes[1].set_ylim(0, max(1.0, axes[1].get_ylim()[1]))
    _save(fig, "Side by side with other routers, 2 P + 2 D simulators, H100/8B cost model", path)
