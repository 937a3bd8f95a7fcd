"""Section 6's screen, built from made-up results."""

from __future__ import annotations

from typing import Any

import pytest

from bench import events
from bench.plan import QUICK

pytestmark = pytest.mark.unit


def cell(first: float, later: float, reuse: dict[str, int]) -> dict[str, Any]:
    return {
        "first": {"p50": first},
        "later": {"p50": later, "p90": later + 2, "n": sum(reuse.values())},
        "reuse": reuse,
        "failed": 0,
    }


def test_the_events_screen_gives_the_added_latency() -> None:
    res = {
        "per_turn": {
            "events-off": cell(7.7, 11.0, {"hit;via=prefill-cache": 18}),
            "events-on": cell(8.6, 11.5, {"hit": 9, "hit;via=prefill-cache": 8, "miss": 1}),
        },
    }
    (screen,) = events.screens(res, QUICK)
    (table,) = screen.tables
    assert table.rows == [
        ["without --kv-events", "7.70", "11.00 / 13.00", "18 of 18", "0"],
        ["with --kv-events", "8.60", "11.50 / 13.50", "17 of 18", "0"],
    ]
    assert screen.answer == [
        "A later turn's p50 is 11.50 ms with events, 11.00 ms without (+0.50 ms)."
    ]
