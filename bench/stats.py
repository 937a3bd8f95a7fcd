"""Percentiles and small summaries (nearest-rank on sorted values; NaN when empty)."""

from __future__ import annotations

import math
from collections.abc import Sequence


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
    if not values:
        return {"p50": math.nan, "p90": math.nan, "p99": math.nan, "mean": math.nan, "n": 0}
    return {
        "p50": ms(pct(values, 50)),
        "p90": ms(pct(values, 90)),
        "p99": ms(pct(values, 99)),
        "mean": ms(sum(values) / len(values)),
        "n": len(values),
    }


def per_chunk(spans: Sequence[float], events: Sequence[int]) -> list[float]:
    """Per request: the time between its first and last SSE event, per event after the first."""
    return [s / (n - 1) for s, n in zip(spans, events, strict=True) if n > 1]


def fmt(value: float, digits: int = 2) -> str:
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
