"""Percentiles and small summaries (nearest-rank on sorted values; NaN when empty)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any


def pct(values: Sequence[float], q: float) -> float:
    if not values:
        return math.nan
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))
    return float(ordered[k])


def ms(seconds: float) -> float:
    return seconds * 1000.0


def summary_ms(values: Sequence[float]) -> dict[str, float]:
    """p50/p90/p99 and mean of seconds, in milliseconds."""
    mean = ms(sum(values) / len(values)) if values else math.nan
    return {**{f"p{q}": ms(pct(values, q)) for q in (50, 90, 99)}, "mean": mean, "n": len(values)}


def turns_summary(turns: Sequence[dict[str, Any]], key: str = "ttft") -> dict[str, Any]:
    """The load generator's turns: `key` (seconds) of the answered first and later turns, the
    later turns by `X-KV-Reuse` (its plan kept: `hit;via=decode` apart from a pull's `hit`),
    and how many turns failed."""
    ok = [t for t in turns if t["ok"]]
    later = [t for t in ok if t["turn"] > 1]
    return {
        "turns": len(turns),
        "failed": len(turns) - len(ok),
        "first": summary_ms([t[key] for t in ok if t["turn"] == 1]),
        "later": summary_ms([t[key] for t in later]),
        "reuse": dict(Counter(";".join(t["reuse"].split(";")[:2]) for t in later if t["reuse"])),
    }


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}"


def _cell_text(text: str) -> str:
    return text.replace("|", "\\|")  # e.g. Redis' "script|load"


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table; a pipe inside a cell is escaped."""
    out = ["| " + " | ".join(map(_cell_text, header)) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(map(_cell_text, row)) + " |" for row in rows]
    return [*out, ""]
