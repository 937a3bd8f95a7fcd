"""The per-turn plan (router/turn/decide/plan.py), table-driven: pull, decode or recompute
from the tokens D's cache holds and lacks, a handle, D's and P's load (any API: the state, or
D's own rendering, says what it holds)."""

from __future__ import annotations

import pytest

from router.turn.decide.plan import Inputs, Limits, Plan, choose, d_has_room, d_idle

LIMITS = Limits(max_tokens=512, max_inflight=4, idle_inflight=2)


def inputs(**kw: object) -> Inputs:
    base: dict[str, object] = {
        "new_tokens": 76,
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
        ("new tokens at the limit", {"new_tokens": 512}, Plan.DECODE),
        ("one token over the limit", {"new_tokens": 513}, Plan.RECOMPUTE),
        ("over the limit with a handle: pull", {"new_tokens": 1900, "handle": True}, Plan.PULL),
        ("D crowded: recompute", {"d_inflight": 4}, Plan.RECOMPUTE),
        ("D crowded with a handle: pull", {"d_inflight": 4, "handle": True}, Plan.PULL),
        ("D one below its limit", {"d_inflight": 3}, Plan.DECODE),
        ("a handle, D idle: its next step comes first", {"handle": True}, Plan.DECODE),
        (
            "a handle, D with one in flight: still idle",
            {"handle": True, "d_inflight": 1},
            Plan.DECODE,
        ),
        ("a handle, D busy, P has room: pull", {"handle": True, "d_inflight": 2}, Plan.PULL),
        (
            "a handle, D busy, P as crowded as the limit",
            {"handle": True, "d_inflight": 2, "p_inflight": 4},
            Plan.DECODE,
        ),
        (
            "a handle, D idle, too many new tokens: pull",
            {"handle": True, "new_tokens": 600},
            Plan.PULL,
        ),
        ("D holds nothing of the prompt", {"d_holds": 0}, Plan.RECOMPUTE),
        ("nothing new (or not known)", {"new_tokens": 0}, Plan.RECOMPUTE),
    ],
)
def test_plan(case: str, kw: dict[str, object], want: Plan) -> None:
    assert choose(inputs(**kw), LIMITS) is want, case


def test_zero_max_tokens_turns_the_decode_plan_off() -> None:
    off = Limits(max_tokens=0, max_inflight=4, idle_inflight=2)
    assert choose(inputs(), off) is Plan.RECOMPUTE
    assert choose(inputs(handle=True, p_inflight=99), off) is Plan.PULL
    assert not d_has_room(0, off)


def test_zero_idle_inflight_keeps_the_pull_while_p_has_room() -> None:
    pull_first = Limits(max_tokens=512, max_inflight=4, idle_inflight=0)
    assert not d_idle(0, pull_first)
    assert choose(inputs(handle=True), pull_first) is Plan.PULL
    assert choose(inputs(handle=True, p_inflight=4), pull_first) is Plan.DECODE
    assert choose(inputs(), pull_first) is Plan.DECODE  # no handle: D is still the best


def test_room_and_idleness_on_d() -> None:
    assert d_has_room(3, LIMITS)
    assert not d_has_room(4, LIMITS)
    assert d_idle(1, LIMITS) and not d_idle(2, LIMITS)
    # Never idler than it has room for.
    assert not d_idle(4, Limits(max_tokens=512, max_inflight=4, idle_inflight=9))
