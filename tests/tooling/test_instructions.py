"""bench/instructions.py: instructions per turn under callgrind, counted only around the
measured conversations."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import instructions


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


@pytest.mark.skipif(not instructions.available(), reason="valgrind is not installed")
@pytest.mark.timeout(600)
def test_a_router_under_callgrind_counts_its_measured_turns_only() -> None:
    """One conversation of five turns through this checkout's router and the work floor: the
    four later turns hit, and each arm's count is of the turns alone (a router's start-up
    alone is hundreds of millions of instructions)."""
    results = instructions.run(base=None, stream=False, conversations=1, rounds=1, floor=True)
    (kvbaton,), (floor,) = results["kvbaton"], results["work floor"]
    assert (kvbaton["turns"], kvbaton["failed"], kvbaton["later_turns"]) == (5, 0, {"hit": 4})
    assert (floor["turns"], floor["failed"]) == (5, 0)
    # A turn is millions of instructions, not the hundreds of millions of an import.
    assert 1e6 < floor["instructions_per_turn"] < kvbaton["instructions_per_turn"] < 5e7
