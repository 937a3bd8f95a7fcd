"""bench/handover.py's comparison of answers and its report section (numbers made up)."""

from __future__ import annotations

from typing import Any

from bench import handover


def turn(conv: int, n: int, answer: str, ok: bool = True) -> dict[str, Any]:
    return {"round": 0, "conv": conv, "turn": n, "answer": answer, "ok": ok}


def test_answers_must_match_the_baseline_turn_by_turn() -> None:
    same = [turn(0, 1, "a"), turn(0, 2, "b")]
    arms = {arm: list(same) for arm in handover.ARMS}
    assert handover._same_answers(arms)
    assert not handover._same_answers({**arms, "both": [turn(0, 1, "a"), turn(0, 2, "x")]})
    assert not handover._same_answers({**arms, "seed": [turn(0, 1, "a")]})  # one missing
    assert not handover._same_answers({arm: [] for arm in handover.ARMS})


def cell(first: float, later: float) -> dict[str, Any]:
    return {
        "first": {"p50": first, "p90": first},
        "later": {"p50": later, "p90": later},
        "reuse": {"hit": 3},
        "failed": 0,
    }


def test_the_section_says_whether_both_on_saved_the_modelled_handover() -> None:
    r: dict[str, Any] = {
        "modelled_ms": 22.5,
        "admission_ms": 15.0,
        "forward_ms": 7.5,
        "same_answers": True,
        "arms": {"off": cell(100, 60), "seed": cell(92, 52), "concurrent": cell(85, 45)},
    }
    r["arms"]["both"] = cell(77, 37)
    text = "\n".join(handover.section(r))
    assert text.startswith("## 9. The handover") and "**met**" in text
    assert "| both on | 77.0 | 37.0 | 37.0 | +23.0 / +23.0 | hit 3 | 0 |" in text
    r["arms"]["both"] = cell(80, 37)
    assert "**not met**" in "\n".join(handover.section(r))
