"""bench/handover.py's comparison of answers and its screen (numbers made up)."""

from __future__ import annotations

from typing import Any

from bench import handover
from bench.plan import QUICK


def turn(conv: int, n: int, answer: str, ok: bool = True) -> dict[str, Any]:
    return {"round": 0, "conv": conv, "turn": n, "answer": answer, "ok": ok}


def test_answers_must_match_the_baseline_turn_by_turn() -> None:
    same = [turn(0, 1, "a"), turn(0, 2, "b")]
    arms = {arm: list(same) for arm in handover.ARMS}
    assert handover.same_answers(arms)
    assert not handover.same_answers({**arms, "both": [turn(0, 1, "a"), turn(0, 2, "x")]})
    assert not handover.same_answers({**arms, "seed": [turn(0, 1, "a")]})  # one missing
    assert not handover.same_answers({arm: [] for arm in handover.ARMS})


def cell(first: float, later: float) -> dict[str, Any]:
    return {
        "first": {"p50": first, "p90": first},
        "later": {"p50": later, "p90": later},
        "reuse": {"hit": 3},
        "failed": 0,
    }


def test_the_screen_says_whether_both_on_saved_the_modelled_handover() -> None:
    r: dict[str, Any] = {
        "modelled_ms": 22.5,
        "admission_ms": 15.0,
        "forward_ms": 7.5,
        "same_answers": True,
        "arms": {"off": cell(100, 60), "seed": cell(92, 52), "concurrent": cell(85, 45)},
    }
    r["arms"]["both"] = cell(77, 37)
    (screen,) = handover.screens(r, QUICK)
    (table,) = screen.tables
    assert all(len(row) == len(table.header) for row in table.rows)
    assert table.rows[-1] == ["both on", "77.0", "37.0 / 37.0", "+23.0 / +23.0", "0"]
    assert "22.5 ms" in screen.question
    assert screen.answer == [
        "Both on saves 23.0 ms p50 on turn 1 and 23.0 ms on later turns; both at least the "
        "modelled 22.5 ms: yes; answers identical across arms: yes."
    ]
    r["arms"]["both"] = cell(80, 37)
    assert "22.5 ms: no;" in handover.screens(r, QUICK)[0].answer[0]
