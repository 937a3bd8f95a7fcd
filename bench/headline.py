"""README's headline table: section 8's later-turn TTFT per arm and scenario, from one run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.stats import table

START = "<!-- bench:peers:start (written by a full `make bench`: bench/headline.py) -->"
END = "<!-- bench:peers:end -->"
KVBATON = "kvbaton"


def _arms(scenarios: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for sc in scenarios.values():
        names += [a for a in sc["arms"] if a not in names]
    return names


def _cell(s: dict[str, Any] | None) -> str:
    if s is None:
        return "n/a"
    later = s["ttft_later"]
    text = f"{later['p50']:.0f} / {later['p90']:.0f}"
    return text + (f" ({s['failed']} of {s['turns']} failed)" if s["failed"] else "")


def lines(peers: dict[str, Any], source: str) -> list[str]:
    """The table (later-turn TTFT p50 / p90 per arm and scenario, failed turns where any,
    router CPU per turn on the first scenario) and, per scenario, which arm is lowest at p50
    and by how much kvbaton is not, where it is not."""
    scenarios = peers["scenarios"]
    arms = _arms(scenarios)
    first = next(iter(scenarios), "")
    header = ["arm", *scenarios, f"router CPU ms/turn ({first})"]
    rows = []
    for arm in arms:
        cells = [_cell(sc["arms"].get(arm, {}).get("summary")) for sc in scenarios.values()]
        cpu = scenarios[first]["arms"].get(arm, {}).get("summary")
        rows.append([arm, *cells, f"{cpu['cpu_ms_per_turn']:.1f}" if cpu else "n/a"])
    out = [
        START,
        "",
        f"TTFT after turn 1, p50 / p90 in ms, from {source}; details in "
        "[docs/benchmarks.md](docs/benchmarks.md#8-side-by-side-with-other-routers).",
        "",
        *table(header, rows),
    ]
    for name, sc in scenarios.items():
        summaries = {a: r["summary"] for a, r in sc["arms"].items()}
        best = min(summaries, key=lambda a: summaries[a]["ttft_later"]["p50"])
        mine = summaries.get(KVBATON)
        b = summaries[best]["ttft_later"]
        if mine is None:
            continue
        if best == KVBATON:
            line = f"- {name}: kvbaton has the lowest p50 ({b['p50']:.0f} ms)."
        else:
            m = mine["ttft_later"]
            line = (
                f"- {name}: kvbaton is **not** ahead at p50: {best} is lower, "
                f"{b['p50']:.0f} / {b['p90']:.0f} ms against kvbaton's "
                f"{m['p50']:.0f} / {m['p90']:.0f}."
            )
        out.append(line + _failures(summaries))
    return [*out, "", END]


def _failures(summaries: dict[str, dict[str, Any]]) -> str:
    """Who failed the fewest turns, where any arm failed some."""
    failed = {a: s["failed"] for a, s in summaries.items()}
    if not any(failed.values()):
        return ""
    fewest = min(failed.values())
    who = " and ".join(a for a, n in failed.items() if n == fewest)
    others = sorted(n for n in failed.values() if n != fewest)
    if not others:
        return f" Failed turns: {fewest} in every arm."
    spread = f"{others[0]}-{others[-1]}" if others[0] != others[-1] else f"{others[0]}"
    return f" Fewest failed turns: {who} ({fewest}; the others {spread})."


def update(readme: Path, block: list[str]) -> bool:
    """Replace the block between the markers in readme; False where it has none."""
    text = readme.read_text()
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        return False
    readme.write_text(text[:start] + "\n".join(block) + text[end + len(END) :])
    return True
