"""The per-chunk figures of bench section 1: the router's slope against the floor's measured
on the same engines in alternating rounds."""

from __future__ import annotations

from typing import Any

from bench import overhead, targets


def slope(at8: float, at128: float, us: float) -> dict[str, Any]:
    return {
        "runs": {
            "8": {"cpu_ms_per_turn": at8, "events": 10.0},
            "128": {"cpu_ms_per_turn": at128, "events": 130.0},
        },
        "us_per_chunk_at": {"128": us},
        "us_per_chunk": us,
    }


def test_an_arm_is_the_median_of_its_rounds() -> None:
    got = overhead.median_tree(
        [slope(1.0, 4.0, 30.0), slope(3.0, 9.0, 50.0), slope(2.0, 5.0, 20.0)]
    )
    assert got["runs"]["8"] == {"cpu_ms_per_turn": 2.0, "events": 10.0}
    assert got["runs"]["128"]["cpu_ms_per_turn"] == 5.0
    assert got["us_per_chunk_at"] == {"128": 30.0} and got["us_per_chunk"] == 30.0


def test_a_slope_that_could_not_be_taken_is_left_out_of_the_median() -> None:
    none = slope(1.0, 1.0, 0.0)
    none["us_per_chunk_at"]["128"] = None
    got = overhead.median_tree([none, slope(1.0, 2.0, 40.0)])
    assert got["us_per_chunk_at"]["128"] == 40.0
    assert overhead.median_tree([None, None]) is None


def test_the_target_rows_are_the_paired_differences_against_each_floor() -> None:
    # Round differences 6, 9, 12: the median 9 is under 10 us, although the router's median
    # (41) minus the floor's (30) is 11: drift between rounds moved both arms.
    stock = {
        "us_per_chunk_at": {"128": 41.0},
        "floor": {"us_per_chunk_at": {"128": 30.0}},
        "above_floor_us_at": {"128": 9.0},
        "rounds": [{}, {}, {}],
    }
    long = {
        "ms_per_token": 1.0,
        "us_per_chunk_at": {"1000": 50.0, "16000": 52.0},
        "floor": {"us_per_chunk_at": {"1000": 35.0, "16000": 36.0}},
        "above_floor_us_at": {"1000": 15.0, "16000": 16.0},
        "rounds": [{}],
    }
    ov = {"chunk_cpu": {"stock, paced": stock}, "chunk_long": long}
    rows = {row[0]: row for row in targets.chunk_rows(ov)}
    assert rows["router CPU per paced SSE chunk (stock, paced): <= 10 us above the floor's"][
        1:
    ] == (
        "floor, the same chunks: 30.0 us (medians of 3 alternating rounds)",
        "41.0 us: 9.0 above",
        True,
    )
    assert rows["the same per chunk of a 16,000-token stream"][1:] == (
        "floor, the same chunks: 36.0 us (D paced 1 ms/token)",
        "52.0 us: 16.0 above",
        False,
    )
    # D back to back (the quick plan): a figure, no verdict; a slope not taken: no row.
    long["ms_per_token"] = 0.0
    del long["above_floor_us_at"]["1000"]
    rows = {row[0]: row for row in targets.chunk_rows(ov)}
    assert "the same per chunk of a 1,000-token stream" not in rows
    assert rows["the same per chunk of a 16,000-token stream"][3] is None
    assert targets.chunk_rows({}) == []
