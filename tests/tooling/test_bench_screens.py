"""Sections 1, 2, 4 and 5 as screens: built from made-up results, every table rectangular and
every answer naming the figures it is made of."""

from __future__ import annotations

from typing import Any

import pytest

from bench import overhead, profile, throughput
from bench.plan import QUICK
from bench.screen import Screen

pytestmark = pytest.mark.unit


def lat(p50: float, p99: float) -> dict[str, float]:
    return {"p50": p50, "p90": (p50 + p99) / 2, "p99": p99}


def arm(first: tuple[float, float], later: tuple[float, float], cpu: float) -> dict[str, Any]:
    return {"first": lat(*first), "later": lat(*later), "cpu_ms_per_turn": cpu}


def overhead_res() -> dict[str, Any]:
    cells = [
        {
            "stream": stream,
            "concurrency": c,
            "kvbaton": arm((10.75, 15.0), (9.0, 20.0), 2.5),
            "floor": arm((7.5, 12.0), (6.5, 10.0), 1.25),
            "work": arm((8.0, 13.0), (7.5, 12.0), 2.0),
        }
        for stream in (False, True)
        for c in (16, 1)
    ]
    sample = {
        "turns": 12,
        "hits": 8,
        "top": {"evalsha": 24, "zrangebyscore": 2},
        "inner": {"hset": 60},
        "round_trips_per_turn": 26 / 12,
    }
    return {"cells": cells, "turns": 5, "monitor": {"reuse": sample}}


def check(screen: Screen, lines: int) -> str:
    assert screen.question.endswith((".", "?"))
    assert 1 <= len(screen.tables) <= 2 and 1 <= len(screen.answer) <= 2
    for t in screen.tables:
        assert t.rows and len(t.rows) <= 12
        assert all(len(row) == len(t.header) for row in t.rows)
    rendered = 4 + sum(3 + len(t.rows) for t in screen.tables) + len(screen.answer) + 1
    assert rendered + (2 if screen.plot else 0) <= lines
    return " ".join(screen.answer)


def test_router_overhead_and_redis_screens() -> None:
    first, redis = overhead.screens(overhead_res(), QUICK)
    answer = check(first, 30)
    assert first.plot == "bench-overhead.png" and "conversations of 5 turns" in first.question
    # kvbaton - floor at p50 of the JSON cell with the fewest clients; CPU beside both floors'
    assert "At 1 client, JSON, kvbaton adds 3.25 ms p50 to a first turn and 2.50 ms" in answer
    assert "2.500 ms against the work floor's 2.000 (the floor's 1.250)" in answer
    (turns,) = first.tables
    assert turns.rows[0] == [
        "JSON",
        "16",
        "7.50 / 10.75",
        "6.50 / 9.00",
        "3.25 / 2.50",
        "3.12 / 6.25",
        "2.500 / 1.250 / 2.000",
    ]
    assert [row[0] for row in turns.rows] == ["JSON", "JSON", "stream", "stream"]
    assert overhead.first_json(overhead_res())["concurrency"] == 1  # type: ignore[index]
    answer = check(redis, 12)
    assert answer == "A turn takes 2.17 round trips."
    assert redis.tables[0].rows[0][3] == "evalsha 2.00, zrangebyscore 0.17"


def sweep(turns_s: float, cpu: float) -> dict[str, Any]:
    best = {"p50_ms": 10.0, "p99_ms": 30.0, "router_cpu_util": 0.5}
    return {
        "best": best,
        "sustained_turns_s": turns_s,
        "cpu_ms_per_turn": cpu,
        "ceiling_turns_s": 1000 / cpu,
    }


def test_throughput_screen() -> None:
    hits = {"turns_s": 150.0, "p50_ms": 8.0, "p99_ms": 20.0, "router_cpu_util": 0.4}
    hits.update(clients=8, cpu_ms_per_turn=2.0, ceiling_turns_s=500.0)
    res = {
        "pinned": True,
        "sweeps": {"json": sweep(195.0, 4.0), "stream": sweep(97.0, 8.0)},
        "hits": {"pinned": True, "levels": [hits], "best": hits},
    }
    (screen,) = throughput.screens(res, QUICK)
    answer = check(screen, 20)
    assert (
        "sustains 195 JSON first turns/s" in answer and "ceiling at its CPU per turn: 250" in answer
    )
    assert "150 hit turns/s" in answer
    assert screen.tables[0].rows[-1][:3] == ["hits, JSON, 8 clients, 1 core", "150", "8.00 / 20.00"]


def test_profile_screen_and_parse() -> None:
    text = "\n".join(
        [
            "main (router/__main__.py:1);send (aiohttp/client.py:9) 6",
            "main (router/__main__.py:1);claim (sessions/redis_store.py:5) 2",
            "main (router/__main__.py:1);run (asyncio/base_events.py:3) 2",
            "main (router/__main__.py:1);EpollSelector.select (selectors.py:4) 50",
        ]
    )
    got = profile.parse(text)
    assert got["samples"] == 10 and got["idle"] == 50
    assert got["groups"]["upstream HTTP client (aiohttp)"] == pytest.approx(0.6)
    res = {x: {**got, "cpu_ms_per_turn": 2.5} for x in ("json", "hits")}
    (screen,) = profile.screens(res, QUICK)
    answer = check(screen, 20)
    assert "first turns, JSON: upstream HTTP client (aiohttp) (60%)" in answer
    assert screen.tables[0].header == ["share of busy samples", "first turns, JSON", "hits"]
    assert ["router CPU ms/turn", "2.500", "2.500"] in screen.tables[0].rows
