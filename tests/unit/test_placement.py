"""The per-turn plan (router/turn/decide/plan.py), table-driven: pull, decode or recompute
from the tokens D's cache holds, the new tokens, a handle, D's and P's load (any API: D's own
rendering says what it holds)."""

from __future__ import annotations

import pytest

from router.turn.decide.plan import Inputs, Limits, Plan, choose, d_has_room

LIMITS = Limits(max_tokens=512, max_inflight=4)


def inputs(**kw: object) -> Inputs:
    base: dict[str, object] = {
        "prompt_tokens": 1100,
        "d_holds": 1024,
        "handle": False,
        "d_inflight": 0,
        "p_inflight": 0,
    }
    base.update(kw)
    return Inputs(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("case", "kw", "want"),
    [
        ("stock stream: few new tokens, no handle", {}, Plan.DECODE),
        ("new tokens at the limit", {"prompt_tokens": 1024 + 512}, Plan.DECODE),
        ("one token over the limit", {"prompt_tokens": 1024 + 513}, Plan.RECOMPUTE),
        ("over the limit with a handle: pull", {"prompt_tokens": 3000, "handle": True}, Plan.PULL),
        ("D crowded: recompute", {"d_inflight": 4}, Plan.RECOMPUTE),
        ("D crowded with a handle: pull", {"d_inflight": 4, "handle": True}, Plan.PULL),
        ("D one below its limit", {"d_inflight": 3}, Plan.DECODE),
        ("a handle and P has room: pull", {"handle": True}, Plan.PULL),
        ("a handle but P as crowded as the limit", {"handle": True, "p_inflight": 4}, Plan.DECODE),
        ("D holds nothing of the prompt", {"d_holds": 0}, Plan.RECOMPUTE),
        ("D holds it all (nothing new)", {"d_holds": 1100}, Plan.RECOMPUTE),
        ("prompt length unknown", {"prompt_tokens": 0}, Plan.RECOMPUTE),
    ],
)
def test_plan(case: str, kw: dict[str, object], want: Plan) -> None:
    assert choose(inputs(**kw), LIMITS) is want, case


def test_zero_max_tokens_turns_the_decode_plan_off() -> None:
    off = Limits(max_tokens=0, max_inflight=4)
    assert choose(inputs(), off) is Plan.RECOMPUTE
    assert choose(inputs(handle=True, p_inflight=99), off) is Plan.PULL
    assert not d_has_room(0, off)


def test_room_on_d() -> None:
    assert d_has_room(3, LIMITS)
    assert not d_has_room(4, LIMITS)
