"""Section 7: the load generator's think times and arrivals, and the screen made from
made-up results."""

from __future__ import annotations

import asyncio
import random
import statistics
from typing import Any

import aiohttp
import pytest

from bench import loadgen, pins
from bench.plan import QUICK

pytestmark = pytest.mark.unit


def test_think_times_are_exponential_cut_at_four_means() -> None:
    rng = random.Random(1)
    draws = [loadgen.think_time({"think_s": 2.0}, rng) for _ in range(2000)]
    assert all(0 <= x <= 8.0 for x in draws) and 1.6 < statistics.mean(draws) < 2.2
    assert loadgen.think_time({}, rng) == 0.0


class FakeTarget(loadgen.Target):
    """Answers every request at once: a hit after the first turn, except those listed."""

    def __init__(self, released: frozenset[int]) -> None:
        self.released = released

    async def send(
        self, s: aiohttp.ClientSession, body: dict[str, Any], conv: str, parse: bool
    ) -> loadgen.Sample:
        turn = sum(m["role"] == "user" for m in body["messages"])
        await asyncio.sleep(0)
        reuse = "miss" if turn == 1 else "hit"
        if turn in self.released:
            reuse = pins.RELEASED
        return loadgen.Sample(ok=True, text=[f"answer {turn}"], reuse=reuse)


def test_arrivals_run_whole_conversations_and_count_releases(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target = FakeTarget(released=frozenset({3}))
    monkeypatch.setattr(loadgen, "make_target", lambda spec: target)
    spec = pins.job(QUICK, "http://unused")
    spec.update(duration_s=0.5, drain_s=5.0, rate=20.0, think_s=0.0, one_turn_share=0.0)
    res = asyncio.run(loadgen.KINDS["arrivals"](spec))
    firsts = [t for t in res["turns"] if t["turn"] == 1]
    assert len(firsts) == res["conversations"] > 0
    assert all(t["ok"] and t["start"] >= 0 for t in res["turns"])
    res["samples"] = [{"t": 0.1, "pinned": 0.25}]
    s = pins.summarize(res)
    assert s["later_hits"] + s["released"] == s["later_turns"] > 0
    thirds = sum(t["turn"] == 3 for t in res["turns"])
    assert s["released"] == thirds > 0 and s["pinned_max"] == 0.25


def _summary(turns: int, p99: float, released: int, pinned_max: float) -> dict[str, Any]:
    return {
        "turns": turns,
        "failed": 1,
        "ttft": {"p50": 20.0, "p99": p99},
        "later_turns": 40,
        "later_hits": 40 - released,
        "released": released,
        "pinned_p50": 0.5,
        "pinned_max": pinned_max,
    }


def test_the_screen_shows_the_arms() -> None:
    res: dict[str, Any] = {
        "arms": {
            "releases on": {
                "summary": _summary(73, 62.0, 5, 0.89),
                "releases": {"pressure": 17, "ended": 3},
            },
            "releases off": {"summary": _summary(67, 2522.0, 0, 1.0), "releases": {}},
        },
    }
    (memory,) = pins.screens(res, QUICK)
    for table in memory.tables:
        assert all(len(row) == len(table.header) for row in table.rows), table
    rows = memory.tables[0].rows
    assert [r[0] for r in rows] == ["releases on", "releases off"]
    assert rows[0][1:] == ["73 (1)", "20 / 62", "35 of 40", "5", "50% / 89%"]
    assert memory.plot == "bench-pins.png" and "1,024 blocks" in memory.question
    assert memory.answer == [
        "Releases (20 handles; off: 0) hold D's pinned share to 89% at most (off: 100%) and "
        "TTFT p99 to 62 ms (off: 2522 ms).",
        "Later turns lost to a release: 5 of 40.",
    ]
