"""Section 7: the load generator's think times, copies and mixed jobs, the fault injection,
and the screens made from made-up results."""

from __future__ import annotations

import asyncio
import random
import statistics
import subprocess
import threading
import time
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from bench import loadgen, pins, pins_faults, pins_mixed
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

    def __init__(self, released: frozenset[int] = frozenset()) -> None:
        self.sent: list[tuple[str | None, int]] = []
        self.released = released

    async def send(
        self, s: aiohttp.ClientSession, body: dict[str, Any], conv: str | None, parse: bool
    ) -> loadgen.Sample:
        turn = sum(m["role"] == "user" for m in body["messages"])
        self.sent.append((conv, turn))
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


def test_copies_send_every_turn_at_once_and_the_first_answer_goes_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    target = FakeTarget()
    monkeypatch.setattr(loadgen, "make_target", lambda spec: target)
    spec = pins_faults.job(QUICK, ["http://unused"], copies=4, pause=False)
    res = asyncio.run(loadgen.KINDS["conversations"](spec))
    n = QUICK.pins_fault_convs
    assert len(res["turns"]) == len(target.sent) == n * pins_faults.TURNS * 4
    assert sorted({t["copy"] for t in res["turns"]}) == [0, 1, 2, 3]
    # Each conversation's copies share its id; every turn went 4 times.
    by_conv: dict[str | None, list[int]] = {}
    for conv, turn in target.sent:
        by_conv.setdefault(conv, []).append(turn)
    assert len(by_conv) == n
    assert all(sorted(turns) == [1] * 4 + [2] * 4 + [3] * 4 for turns in by_conv.values())


def status(*counts: int) -> dict[str, Any]:
    return {"instances": {"decode": [{"pinned_handles": c} for c in counts]}}


def d_state(*decoder: str, leases: int = 0) -> dict[str, Any]:
    pin = {"block_ids": [1, 2], "expiry": 0.0}
    pins = [{**pin, "request_id": rid, "kind": "decoder"} for rid in decoder]
    return {"pins": pins + [{**pin, "request_id": "p", "kind": "lease"}] * leases}


def test_orphans_are_ds_decoder_pins_less_the_routers_count() -> None:
    states = [d_state("a", "b", "c", "d", "e", "f", "g", leases=3), d_state("h", "i")]
    # The index: 3 handles D pins, one it no longer pins, one entry whose handle a turn took.
    index = ["a", "b", "h", "gone", None]
    assert pins_faults.orphans(states, status(4, 1), index) == {
        "d_pins": 9,
        "router_pins": 5,
        "orphans": 4,
        "unknown": 6,  # c d e f g i: no entry names them
        "stale": 2,
    }
    # An entry that names no pin hides an orphan from the count, not from the ids.
    hidden = pins_faults.orphans([d_state("x")], status(1), [None])
    assert (hidden["orphans"], hidden["unknown"], hidden["stale"]) == (0, 1, 1)
    # A router that has not swept a D yet (-1) gives no count, not a wrong one.
    assert pins_faults.orphans([d_state("a")], status(-1), ["a"])["orphans"] is None
    assert pins_faults.router_count(status(0, 0)) == 0


def test_a_fault_strikes_while_the_job_runs_and_its_failure_is_reported() -> None:
    class SlowLoadGen:
        def run(self, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
            time.sleep(0.3)
            return {"turns": []}

    struck: list[float] = []
    t0 = time.monotonic()

    def fault(st: Any) -> dict[str, Any]:
        struck.append(time.monotonic() - t0)
        return {"what": 1}

    spec = {"deadline_s": 1.0}
    lg: Any = SlowLoadGen()
    _, said = pins_faults.under(lg, spec, SimpleNamespace(), 0.1, fault)  # type: ignore[arg-type]
    assert said == {"what": 1, "fired": True} and 0.1 <= struck[0] < 0.3

    def broken(st: Any) -> dict[str, Any]:
        raise OSError("no such process")

    _, said = pins_faults.under(lg, spec, SimpleNamespace(), 0.0, broken)  # type: ignore[arg-type]
    assert said == {"error": "OSError: no such process"}
    assert pins_faults.under(lg, spec, SimpleNamespace(), 0.0, None)[1] == {}  # type: ignore[arg-type]


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().rsplit(")", 1)[1].split()[0]


def test_redis_is_paused_then_resumed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pins_faults, "REDIS_PAUSE_S", 0.5)
    proc = subprocess.Popen(["sleep", "30"])
    try:
        st: Any = SimpleNamespace(redis_proc=proc)
        pause = threading.Thread(target=pins_faults.pause_redis, args=(st,))
        pause.start()
        time.sleep(0.2)
        assert _state(proc.pid) == "T"  # stopped
        pause.join()
        assert _state(proc.pid) in ("S", "R")
    finally:
        proc.kill()
        proc.wait()


def _fault_arm(after: int | None, later: int | None, **fault: Any) -> dict[str, Any]:
    def count(n: int | None) -> dict[str, Any]:
        counted = None if n is None else 130 - n
        return {"d_pins": 130, "router_pins": counted, "orphans": n, "unknown": 125, "stale": 0}

    fired = {"fired": True, **fault}
    return {
        "turns": 24,
        "failed": 2,
        "fault": fired,
        "after": count(after),
        "after_settle": count(later),
    }


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


def test_the_screens_show_the_arms_the_kinds_and_the_faults() -> None:
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
        "faults": {
            "settle_s": 5.0,
            "arms": {
                "Redis paused 3 s": _fault_arm(125, 125, paused_s=3.0),
                "router killed mid-turn": _fault_arm(None, 0, d_running_at_kill=6),
            },
        },
    }
    memory, faults = pins.screens(res, QUICK)
    for screen in (memory, faults):
        for table in screen.tables:
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
    assert faults.tables[0].rows[0][2:] == ["125 (130 - 5)", "125 (130 - 5)", "125 / 0"]
    assert faults.tables[0].rows[1][2].startswith("n/a")
    res["faults"]["arms"]["Redis paused 3 s"]["fault"] = {"error": "OSError: gone"}
    row = pins.screens(res, QUICK)[1].tables[0].rows[0]
    assert row[0] == "Redis paused 3 s (did not strike: OSError: gone)"
    assert faults.answer == [
        "0 of 2 faults end with no orphan 5 s later; Redis paused 3 s: 125 (130 - 5), 125 "
        "pins no entry names; router killed mid-turn: 0 (130 - 130), 125 pins no entry names."
    ]
    # Without the mixed workload and the faults: one screen, the arms alone.
    (alone,) = pins.screens({"arms": res["arms"]}, QUICK)
    assert (
        len(alone.tables[0].rows) == 2
        and alone.answer[1] == "Later turns lost to a release: 5 of 40."
    )
