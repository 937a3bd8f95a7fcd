"""Section 7: the load generator's think times and mixed jobs, and the screen made from
made-up results."""

from __future__ import annotations

import asyncio
import random
import statistics
from typing import Any

import aiohttp
import pytest

from bench import loadgen, pins, pins_mixed
from bench.plan import FULL, QUICK

pytestmark = pytest.mark.unit


def test_think_times_follow_their_distribution() -> None:
    rng = random.Random(1)
    uniform = {"think": {"dist": "uniform", "lo": 1.0, "hi": 3.0}}
    assert all(1.0 <= loadgen.think_time(uniform, rng) <= 3.0 for _ in range(200))
    human = {"think": {"dist": "lognormal", "median_s": 20.0, "p95_s": 120.0}}
    draws = sorted(loadgen.think_time(human, rng) for _ in range(20_000))
    assert statistics.median(draws) == pytest.approx(20.0, rel=0.05)
    assert draws[int(0.95 * len(draws))] == pytest.approx(120.0, rel=0.1)
    # Without `think`: the exponential of mean think_s as before (cut at 4 means), or none.
    assert all(loadgen.think_time({"think_s": 2.0}, rng) <= 8.0 for _ in range(200))
    assert loadgen.think_time({}, rng) == 0.0


def test_the_quick_plan_scales_only_peoples_think_times() -> None:
    assert pins_mixed.think(FULL, "human") == {
        "dist": "lognormal",
        "median_s": 20.0,
        "p95_s": 120.0,
    }
    quick = pins_mixed.think(QUICK, "human")
    assert (quick["median_s"], quick["p95_s"]) == (20.0 * QUICK.pins_think_scale, 30.0)
    assert pins_mixed.think(QUICK, "scripted") == pins_mixed.KINDS["scripted"]["think"]


class FakeTarget(loadgen.Target):
    """Answers every request at once: a hit after the first turn, except those listed."""

    def __init__(self, released: frozenset[int]) -> None:
        self.released = released

    async def send(
        self, s: aiohttp.ClientSession, body: dict[str, Any], conv: str | None, parse: bool
    ) -> loadgen.Sample:
        turn = sum(m["role"] == "user" for m in body["messages"])
        await asyncio.sleep(0)
        reuse = "miss" if turn == 1 else "hit"
        if turn in self.released:
            reuse = pins.RELEASED
        return loadgen.Sample(ok=True, text=[f"answer {turn}"], reuse=reuse)


def test_a_mixed_job_runs_every_kind_and_tags_its_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    target = FakeTarget(released=frozenset({3}))
    monkeypatch.setattr(loadgen, "make_target", lambda spec: target)
    spec = pins_mixed.job(QUICK, "http://unused")
    spec.update(duration_s=0.5, drain_s=5.0, rate=10.0)
    for group in spec["groups"].values():  # no waiting between turns here
        group["think"] = {"dist": "uniform", "lo": 0.0, "hi": 0.0}
    res = asyncio.run(loadgen.KINDS["mixed"](spec))
    assert set(res["conversations"]) == {"scripted", "human"}
    assert {t["group"] for t in res["turns"]} == {"scripted", "human"}
    for kind, count in res["conversations"].items():
        firsts = [t for t in res["turns"] if t["group"] == kind and t["turn"] == 1]
        assert len(firsts) == count > 0
    res["samples"] = [{"t": 0.1, "pinned": 0.25}]
    kinds = pins_mixed.by_kind(res)
    for arm in kinds.values():
        s = arm["summary"]
        assert s["later_hits"] + s["released"] == s["later_turns"]
        assert s["pinned_max"] == 0.25
    thirds = sum(t["turn"] == 3 for t in res["turns"])
    assert sum(k["summary"]["released"] for k in kinds.values()) == thirds > 0


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


def test_the_screen_shows_the_arms_and_the_kinds() -> None:
    res: dict[str, Any] = {
        "arms": {
            "releases on": {
                "summary": _summary(73, 62.0, 5, 0.89),
                "releases": {"pressure": 17, "ended": 3},
            },
            "releases off": {"summary": _summary(67, 2522.0, 0, 1.0), "releases": {}},
        },
        "mixed": {
            "kinds": {k: {"summary": _summary(30, 47.0, 3, 0.9)} for k in pins_mixed.KINDS},
            "think": {k: pins_mixed.think(QUICK, k) for k in pins_mixed.KINDS},
        },
    }
    (memory,) = pins.screens(res, QUICK)
    for table in memory.tables:
        assert all(len(row) == len(table.header) for row in table.rows), table
    rows = memory.tables[0].rows
    assert [r[0] for r in rows] == [
        "arrivals, releases on",
        "arrivals, releases off",
        "scripted, releases on",
        "human, releases on",
    ]
    assert rows[0][1:] == ["73 (1)", "20 / 62", "35 of 40", "5", "50% / 89%"]
    assert memory.plot == "bench-pins.png" and "median 5 s" in memory.question
    assert memory.answer == [
        "Releases (20 handles; off: 0) hold D's pinned share to 89% at most (off: 100%) and "
        "TTFT p99 to 62 ms (off: 2522 ms).",
        "Later turns lost to a release: 5 of 40; mixed workload: scripted 3, human 3.",
    ]
    # Without the mixed workload: the arms alone.
    (alone,) = pins.screens({"arms": res["arms"]}, QUICK)
    assert (
        len(alone.tables[0].rows) == 2
        and alone.answer[1] == "Later turns lost to a release: 5 of 40."
    )
