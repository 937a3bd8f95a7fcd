"""tools/instructions.py: instructions per turn under callgrind, counted only around the
measured conversations."""

from __future__ import annotations

from pathlib import Path

import pytest

from tools import instructions


def test_the_total_comes_from_the_totals_line(tmp_path: Path) -> None:
    dump = tmp_path / "x.callgrind.1"
    dump.write_text("version: 1\nevents: Ir\nsummary: 0\nfn=(1) main\n5 3\ntotals: 123456\n")
    assert instructions.total_instructions(dump) == 123456
    (tmp_path / "empty").write_text("events: Ir\n")
    with pytest.raises(ValueError, match="no totals"):
        instructions.total_instructions(tmp_path / "empty")


def test_the_summary_gives_medians_ranges_and_ratios() -> None:
    rows = {
        "kvbaton": [{"instructions_per_turn": v} for v in (6.0e6, 6.4e6, 6.2e6)],
        "work floor": [{"instructions_per_turn": v} for v in (3.1e6, 3.1e6, 3.1e6)],
    }
    lines = instructions.summary(rows)
    assert lines[0] == "kvbaton: 6.200 M instructions per turn (median of 3, 6.000-6.400)"
    assert lines[1].endswith("(median of 3, 3.100-3.100); kvbaton is 2.000x this")


def test_per_chunk_the_summary_gives_thousands_and_the_difference() -> None:
    rows = {
        "kvbaton": [{"instructions_per_turn": v} for v in (134.0e3, 133.0e3)],
        "floor": [{"instructions_per_turn": v} for v in (106.0e3, 107.0e3)],
    }
    lines = instructions.summary(rows, "chunk")
    assert lines[0] == "kvbaton: 133.5 k instructions per chunk (median of 2, 133.0-134.0)"
    assert lines[1] == (
        "floor: 106.5 k instructions per chunk (median of 2, 106.0-107.0);"
        " kvbaton is 1.254x this, 27.0 k above it"
    )


def test_the_chunk_slope_is_per_event_between_the_lengths() -> None:
    assert instructions.chunk_slope([1_000_000.0, 13_000_000.0], [10.0, 130.0]) == 100_000.0
    with pytest.raises(ValueError, match="no more events"):
        instructions.chunk_slope([1.0, 2.0], [10.0, 10.0])


@pytest.mark.skipif(not instructions.available(), reason="valgrind is not installed")
@pytest.mark.timeout(600)
def test_a_router_under_callgrind_counts_its_measured_turns_only() -> None:
    """One conversation of five turns through this checkout's router and the work floor: the
    four later turns hit, and each arm's count is of the turns alone (a router's start-up
    alone is hundreds of millions of instructions)."""
    results = instructions.run(base=None, kind="json", conversations=1, rounds=1, floor=True)
    (kvbaton,), (floor,) = results["kvbaton"], results["work floor"]
    assert (kvbaton["turns"], kvbaton["failed"], kvbaton["later_turns"]) == (5, 0, {"hit": 4})
    assert (floor["turns"], floor["failed"]) == (5, 0)
    # A turn is millions of instructions, not the hundreds of millions of an import.
    assert 1e6 < floor["instructions_per_turn"] < kvbaton["instructions_per_turn"] < 5e7


@pytest.mark.skipif(not instructions.available(), reason="valgrind is not installed")
@pytest.mark.timeout(600)
def test_per_chunk_the_router_and_the_floor_are_counted_per_relayed_chunk() -> None:
    """Four paced 0.33 streams of each length through this checkout's router and the floor:
    every stream answered, the longer ones carry ~120 more events, and each arm's slope is
    tens or hundreds of thousands of instructions a chunk, not the millions of a turn. Which
    arm is higher is left to the tool's real runs: over 4 streams, one costly event in one
    window (a collection of the whole heap, a code path's first run) moves a slope by
    ~100k (seen once, before each length was warmed up: the floor's 406k, the router's 249k)."""
    results = instructions.run(base=None, kind="chunk-0.33", conversations=4, rounds=1, floor=True)
    (kvbaton,), (floor,) = results["kvbaton"], results["floor"]
    for arm in (kvbaton, floor):
        assert (arm["turns"], arm["failed"]) == (8, 0)
        assert 100 < arm["events"][1] - arm["events"][0] < 140
        assert 2e4 < arm["instructions_per_turn"] < 1e6
