"""Section 3's screen, built from made-up results."""

from __future__ import annotations

from typing import Any

import pytest

from bench import reuse
from bench.plan import QUICK, GpuProfile
from bench.stack import alternate, round_turns

pytestmark = pytest.mark.unit


def by_turn(*p50: float) -> dict[str, dict[str, float]]:
    return {str(t): {"p50": v, "p90": v + 10} for t, v in enumerate(p50, 1)}


def run(ttft_last: float, computed: float) -> dict[str, Any]:
    return {
        "ttft_by_turn": by_turn(90.0, 40.0, ttft_last),
        "limit_by_turn": by_turn(80.0, 14.0, 14.0),
        "turns": 24,
        "turns_failed": 1,
        "tokens": {"P": {"local_compute": computed, "local_cache_hit": 500.0}, "D": {}},
    }


def test_the_reuse_screen_has_a_row_per_run_and_names_the_last_turns() -> None:
    res = {
        "gpu": {"prefill_ms_per_token": 0.046, "decode_ms_per_token": 7.5},
        "runs": {
            "ample/a": run(21.0, 9665.0),
            "ample/b": run(42.0, 16038.0),
            "small/a": run(35.0, 9503.0),
        },
    }
    (screen,) = reuse.screens(res, QUICK)
    (table,) = screen.tables
    assert all(len(row) == len(table.header) for row in table.rows)
    assert [row[:2] for row in table.rows] == [
        ["(a) kvbaton, reuse + affinity", "ample"],
        ["(b) kvbaton, affinity only (--no-reuse)", "ample"],
        ["(a) kvbaton, reuse + affinity", "small"],
    ]
    assert table.rows[0][2:] == ["90", "21 / 31", "14", "9,665", "500", "0", "0", "24 (1)"]
    assert screen.plot == "bench-ttft.png"
    assert screen.answer == [
        "Ample P cache, turn 3 p50: (a) 21 ms, (b) 42 ms, fastest (a); tokens computed on P "
        "9,665 / 16,038; (a) at 1.50x its limit.",
        "Small P cache, turn 3 p50: (a) 35 ms, fastest (a); tokens computed on P 9,503; (a) at "
        "2.50x its limit.",
    ]


def test_the_limit_charges_each_pull_its_fixed_cost_and_reporting_step() -> None:
    """A first turn pulls once (D reads P's blocks); a reusing turn twice (P reads D's too).
    P's prefill is one forward (its fixed cost 7.0 here), D's first token another (10.0)."""
    gpu = GpuProfile(1.0, 10.0, 0.5, 2.0, 3.0, 16, first_token_forward_ms=7.0)
    # 32 new tokens, 2 blocks P -> D, one pull
    assert gpu.turn_limit_ms(32, 0) == 32 * 1.0 + 7.0 + 2 * 0.5 + (2.0 + 3.0) + 10.0
    # 16 reused (a block D -> P) and 16 new (a block P -> D): two pulls
    assert gpu.turn_limit_ms(32, 16) == 16 * 1.0 + 7.0 + 2 * 0.5 + 2 * (2.0 + 3.0) + 10.0
    assert "--pull-step-ms" in gpu.sim_args() and "--transfer-ms-per-pull" in gpu.sim_args()


def test_the_arms_take_turns_their_order_reversed_every_other_round() -> None:
    ticks: list[str] = []
    done = alternate(["a", "b"], 3, ticks.append, "x", lambda arm, rnd: {"turns": [{"arm": arm}]})
    rounds = [[t.split(", ")[2] for t in ticks[i : i + 2]] for i in (0, 2, 4)]
    assert rounds == [["a", "b"], ["b", "a"], ["a", "b"]] and ticks[2] == "x, round 2, b"
    assert round_turns(done["b"]) == [{"arm": "b", "round": r} for r in range(3)]
