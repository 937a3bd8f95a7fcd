"""Section 2's hit turns: a level's figures from the load generator's turns and the router's
CPU, and the target row read from them."""

from __future__ import annotations

import os
import subprocess
from types import SimpleNamespace
from typing import Any

import pytest

from bench import targets, throughput
from bench.plan import QUICK

pytestmark = pytest.mark.unit


def turn(n: int, ok: bool = True, reuse: str | None = "hit") -> dict[str, Any]:
    return {"turn": n, "ok": ok, "reuse": reuse if n > 1 else "miss", "latency": 0.001 * n}


def test_a_level_counts_turns_hits_and_the_cores_ceiling() -> None:
    turns = [turn(1), turn(2), turn(3, reuse="miss"), turn(1), turn(2, ok=False)]
    x = throughput.level({"turns": turns, "wall_s": 0.5}, cpu_s=0.01)
    assert (x["turns"], x["failed"], x["hits"], x["later"]) == (5, 1, 1, 2)
    assert x["turns_s"] == pytest.approx(8.0)  # 4 answered in 0.5 s
    assert x["router_cpu_util"] == pytest.approx(0.02)
    assert x["cpu_ms_per_turn"] == pytest.approx(2.0)  # 10 ms over 5 turns
    assert x["ceiling_turns_s"] == pytest.approx(500.0)
    assert (x["p50_ms"], x["p99_ms"]) == pytest.approx((1.0, 3.0))  # of the 4 answered


def test_the_target_row_is_met_only_by_turns_served() -> None:
    best = {
        "clients": 64,
        "turns_s": 310.0,
        "router_cpu_util": 0.7,
        "cpu_ms_per_turn": 2.2,
        "ceiling_turns_s": 454.5,
    }
    ((target, reference, measured, met),) = targets.hit_rate_rows({"pinned": True, "best": best})
    assert target == "hit turns/s, one core (router pinned): >= 400"
    assert "*Throughput*" in reference
    assert measured == (
        "310 turns/s at 70% of the router's core; a fully busy core at 2.200 ms CPU/turn: 454"
    )
    assert met is False  # a ceiling is not turns served
    best["turns_s"] = 410.0
    assert targets.hit_rate_rows({"pinned": True, "best": best})[0][3] is True
    # Not pinned (a 1-CPU machine): the router had every core, so no verdict on the target.
    ((target, _, _, met),) = targets.hit_rate_rows({"pinned": False, "best": best})
    assert target == "hit turns/s, one router process, not pinned: >= 400" and met is None
    assert targets.hit_rate_rows(None) == [] and targets.hit_rate_rows({"best": None}) == []


def test_the_overhead_rows_are_kvbaton_over_the_floors_at_the_fewest_clients() -> None:
    def arm(first: float, later: float, cpu: float) -> dict[str, Any]:
        return {"first": {"p50": first}, "later": {"p50": later}, "cpu_ms_per_turn": cpu}

    cells = [
        {"stream": stream, "concurrency": n, "kvbaton": arm(5.0, 6.0, 3.0)}
        | {"floor": arm(4.75, 4.0, 1.0), "work": arm(5.0, 5.0, 2.0)}
        for stream in (False, True)
        for n in (16, 1)
    ]
    cells[1]["kvbaton"] = arm(5.25, 5.5, 2.6)  # JSON at 1 client: the one the targets read
    rows = targets.rows({"overhead": {"cells": cells}}, QUICK)
    assert [(r[0], r[2], r[3]) for r in rows] == [
        ("own added p50 on first turns, 1 client: <= 0.5 ms", "0.50 ms (5.25 - 4.75)", True),
        ("own added p50 on hits, 1 client: <= 1 ms", "1.50 ms (5.50 - 4.00)", False),
        ("router CPU per turn: <= 1.25x the work floor's", "1.30x (2.600 vs 2.000 ms)", False),
    ]
    assert "2 of every 3 turns are hits" in rows[2][1]  # the quick plan's conversations
    assert targets.rows({}, QUICK) == []


@pytest.mark.skipif(not throughput.can_pin(), reason="needs 2 CPUs and sched_setaffinity")
def test_pinned_puts_the_router_on_its_core_and_the_rest_on_the_other_then_frees_them() -> None:
    # Real processes for the router, an engine, redis-server and the load generator.
    procs = [subprocess.Popen(["sleep", "30"]) for _ in range(4)]
    router, engine, redis_server, loadgen = procs

    def holder(proc: subprocess.Popen[bytes]) -> SimpleNamespace:
        return SimpleNamespace(proc=proc)

    st = SimpleNamespace(engines=[holder(engine)], redis_proc=redis_server)
    lg = SimpleNamespace(proc=loadgen)
    every = set(range(os.cpu_count() or 1))
    try:
        with throughput.pinned(router.pid, st, lg) as ok:  # type: ignore[arg-type]
            assert ok
            assert os.sched_getaffinity(router.pid) == {throughput.ROUTER_CPU}
            for p in (engine, redis_server, loadgen):
                assert os.sched_getaffinity(p.pid) == {throughput.OTHERS_CPU}
        # The others are free again; the router stays pinned (it is the block's own).
        for p in (engine, redis_server, loadgen):
            assert os.sched_getaffinity(p.pid) == every
        assert os.sched_getaffinity(router.pid) == {throughput.ROUTER_CPU}
    finally:
        for p in procs:
            p.kill()
            p.wait()
