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
    return {"p50": p50, "p99": p99}


def slope(router: float, floor: float) -> dict[str, Any]:
    at = {"128": router}
    return {"us_per_chunk": router, "us_per_chunk_at": at, "floor": {"us_per_chunk": floor}}


def overhead_res() -> dict[str, Any]:
    cells = [
        {
            "stream": stream,
            "concurrency": c,
            "direct": {"latency": lat(5.0, 9.0)},
            "floor": {"latency": lat(7.5, 12.0)},
            "kvbaton": {"latency": lat(10.75, 15.0)},
            "router_cpu_ms_per_turn": 2.5,
            "floor_cpu_ms_per_turn": 1.25,
            "turns": 100,
            "redis_delta": {"evalsha": {"calls": 200.0, "usec": 9000.0}},
        }
        for stream in (False, True)
        for c in (1, 16)
    ]
    hit = {
        "stream": False,
        "concurrency": 1,
        "kvbaton": {"later": lat(9.0, 20.0), "cpu_ms_per_turn": 3.0},
        "floor": {"later": lat(6.5, 10.0), "cpu_ms_per_turn": 1.5},
    }
    long = {
        "ms_per_token": 1.0,
        "us_per_chunk_at": {"1000": 40.0, "16000": 41.0},
        "floor": {"us_per_chunk_at": {"1000": 35.0, "16000": 36.0}},
        "above_floor_us_at": {"1000": 5.0, "16000": 5.5},
    }
    stock = {**slope(84.0, 77.0), "above_floor_us": 7.5}
    sample = {
        "turns": 12,
        "hits": 8,
        "top": {"evalsha": 24, "zrangebyscore": 2},
        "inner": {"hset": 60},
        "round_trips_per_turn": 26 / 12,
    }
    return {
        "cells": cells,
        "hit_path": {"cells": [hit]},
        "chunk_cpu": {"stock, paced": stock},
        "chunk_long": long,
        "monitor": {"reuse": sample},
        "redis_rtt": {"script_50_us": 120.0, "script_99_us": 900.0},
    }


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
    assert first.plot == "bench-overhead.png"
    # kvbaton - floor at p50 on the first JSON cell, CPU against the floor's, the hits' own
    assert "3.25 ms p50 above the floor (2.500 vs 1.250 ms CPU)" in answer
    assert "on hits at 1 client 2.50 ms (3.000 vs 1.500 ms CPU)" in answer
    assert "spends 84.0 us of CPU, the floor 77.0: 7.5 us above it" in answer
    turns, chunks = first.tables
    assert turns.rows[0][2:4] == ["5.00 / 7.50 / 10.75", "3.25 / 3.00"]
    assert turns.rows[-1][0].startswith("hits") and turns.rows[-1][3] == "2.50 / 10.00"
    assert chunks.rows[-1] == ["16,000 tokens into a stream (D 1 ms/token)", "41.0", "36.0", "5.5"]
    answer = check(redis, 12)
    assert "2.17 round trips" in answer and "90-90 us of server time" in answer
    assert "120 us p50 (900 p99)" in answer and "0.26 ms" in answer


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
    assert "JSON: upstream HTTP client (aiohttp) (60%)" in answer
    assert screen.tables[0].header == ["share of busy samples", "JSON", "hits"]
    assert ["router CPU ms/turn", "2.500", "2.500"] in screen.tables[0].rows
