"""Pressure first: on a D with room a handle is kept until the handle TTL; on a D over its
high-water mark the handles least likely to be read go first (idle for the most of their own
conversation's cadences). A table of the order, then the sweep on an injected clock."""

from __future__ import annotations

import math
from typing import Any

import msgspec
import pytest

from router.lifecycle import pin_sweep, release_order
from router.lifecycle.release_order import least_likely_first, overdue, prior
from router.services import Services
from sessions.keys import conversation_key
from sessions.memory_store import MemorySessionStore
from sessions.model import PinSize, SessionState, TurnTimes
from sessions.store import PinNote
from tests.unit.fake_engines import FakeEngines
from tests.unit.handles import HANDLE
from tests.unit.turns import D1, services

T0 = 1_700_000_000.0
TTL = 450.0


def pace(turn: int, cadence: float, last: float) -> TurnTimes:
    """A conversation of `turn` turns, `cadence` seconds apart, the last committed at `last`."""
    return TurnTimes(turn, last - cadence * (turn - 1), last)


@pytest.mark.parametrize(
    ("since", "times", "expected"),
    [
        (T0 - 30, pace(5, 10.0, T0 - 30), 3.0),  # quiet for three of its own gaps
        (T0 - 30, pace(2, 60.0, T0 - 30), 0.5),  # a human who types for a minute
        (T0 - 30, pace(9, 0.2, T0 - 30), 30.0),  # a script: taken at one second a turn
        (T0 - 30, pace(1, 0.0, T0 - 30), 6.0),  # one turn: the prior's pace (5 s here)
        (T0 - 30, None, 6.0),  # no state readable: the same
        (T0 - 30, TurnTimes(3, 0.0, T0 - 30), 6.0),  # created_at not recorded: the prior
        (T0 - TTL, pace(2, 600.0, T0 - TTL), math.inf),  # past the handle TTL: no reader
        (T0 + 5, pace(3, 10.0, T0 + 5), 0.0),  # committed after `now` (another clock)
    ],
)
def test_how_overdue_a_handle_is(since: float, times: TurnTimes | None, expected: float) -> None:
    assert overdue(since, times, T0, 5.0, TTL) == pytest.approx(expected)


def test_the_prior_is_the_measured_p95_gap() -> None:
    assert prior(None) == release_order.DEFAULT_PRIOR_S == 60.0
    assert prior(42.0) == 42.0
    # A quick fleet's p95 is floored where it is used, as a measured cadence is.
    assert overdue(T0 - 3, None, T0, prior(0.26), TTL) == 3.0


def test_the_least_likely_to_be_read_go_first_ties_oldest_first() -> None:
    due = [  # the pin index's order: oldest first
        ("human", T0 - 100),  # 60 s between turns: 1.7 gaps quiet
        ("one-turn-old", T0 - 90),  # one turn, prior 5 s: 18
        ("slow-human", T0 - 80),  # 300 s between turns: 0.27
        ("script", T0 - 60),  # 1 s between turns: 60
        ("one-turn", T0 - 40),  # 8
        ("twin", T0 - 40),  # the same as one-turn: by key
    ]
    times = [
        pace(3, 60.0, T0 - 100),
        pace(1, 0.0, T0 - 90),
        pace(2, 300.0, T0 - 80),
        pace(12, 1.0, T0 - 60),
        None,
        None,
    ]
    ranked = least_likely_first(due, times, now=T0, prior=5.0, ttl=TTL)
    assert [key for key, _ in ranked] == [
        "script",
        "one-turn-old",
        "one-turn",
        "twin",
        "human",
        "slow-human",
    ]
    assert dict(ranked) == dict(due)  # each with its own index time


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


def swept(clock: Clock, **settings: Any) -> Services:
    """Services on a memory store, both on `clock`, with a releaser (not started: its queue
    shows what was released) and D1 known to announce HANDLE's side channel."""
    svc = services(FakeEngines(), **settings)
    svc.clock = clock
    svc.store = MemorySessionStore(clock)
    svc.releaser = pin_sweep.releaser(svc)
    d1 = svc.pool.find("decode", D1)
    assert d1 is not None
    origin = svc.connector.origin(HANDLE)
    assert origin is not None
    d1.ident.admit(origin)
    return svc


async def committed(svc: Services, name: str, turn: int, cadence: float) -> str:
    """A conversation of `turn` turns `cadence` apart whose last left a handle on D1 now."""
    key = conversation_key("t", name)
    now = svc.clock()
    params = {**HANDLE, "remote_request_id": name}
    state = SessionState(
        turn=turn,
        api="chat",
        decode=D1,
        decode_engine_id=str(HANDLE["remote_engine_id"]),
        kv_transfer_params=params,
        created_at=now - cadence * (turn - 1),
        updated_at=now,
    )
    note = PinNote(D1, now, PinSize(3, 10))
    assert await svc.store.commit(key, state, 0, 3600.0, note)
    return name


def released(svc: Services) -> list[tuple[str, str]]:
    """(conversation, reason) of the releases queued so far, emptying the queue."""
    assert svc.releaser is not None
    out = []
    while not svc.releaser.queue.empty():
        job = svc.releaser.queue.get_nowait()
        out.append((job.handle["remote_request_id"], job.reason))
    return out


async def test_without_pressure_a_handle_waits_for_the_handle_ttl_not_the_gaps() -> None:
    clock = Clock()
    svc = swept(clock, handle_ttl=TTL)
    for _ in range(50):  # quick scripted turns drove the measured p95 to half a second
        svc.gaps.note(0.5)
    await committed(svc, "human", 1, 0.0)
    clock.now += 12  # the human's next turn is typed 12 s later: still there
    assert await pin_sweep.sweep(svc) == 0 and await pin_sweep.relieve(svc) == 0
    clock.now += 60
    assert await pin_sweep.sweep(svc) == 0
    state = await svc.store.get(conversation_key("t", "human"))
    assert state is not None and state.kv_transfer_params is not None
    clock.now = T0 + TTL  # no turn reads it now: released as idle
    assert await pin_sweep.sweep(svc) == 1
    assert released(svc) == [("human", "idle")]


async def test_a_fixed_release_after_still_releases_after_that_delay() -> None:
    clock = Clock()
    svc = swept(clock, release_after=7.0)
    await committed(svc, "c", 1, 0.0)
    clock.now += 6.9
    assert await pin_sweep.sweep(svc) == 0
    clock.now += 0.2
    assert await pin_sweep.sweep(svc) == 1 and released(svc) == [("c", "idle")]


async def test_under_pressure_the_most_overdue_go_first_down_to_the_low_water_mark() -> None:
    clock = Clock()
    svc = swept(clock)
    for _ in range(50):
        svc.gaps.note(20.0)  # the p95 gap: one-turn conversations are taken at this pace
    await committed(svc, "slow-human", 2, 300.0)
    clock.now += 10
    await committed(svc, "human", 4, 60.0)
    clock.now += 10
    await committed(svc, "script", 12, 1.0)
    clock.now += 10
    await committed(svc, "one-turn", 1, 0.0)
    clock.now += 60
    d1 = svc.pool.find("decode", D1)
    assert d1 is not None
    # Idle: slow-human 90 s (0.3 of its gaps), human 80 s (1.3), script 70 s (70), one-turn
    # 60 s (3). Oldest first would release slow-human and human: the two likeliest reads.
    d1.note_kv_usage(0.95)  # over the 0.9 high-water mark: 4 pins, 21 % above 0.75 -> 1
    assert d1.pressured
    assert await pin_sweep.relieve(svc) == 1
    assert released(svc) == [("script", "pressure")]
    assert await pin_sweep.relieve(svc) == 1  # D reads as full still (its /metrics say nothing)
    assert released(svc) == [("one-turn", "pressure")]
    d1.note_kv_usage(0.7)  # under the low-water mark: nothing more goes
    assert not d1.pressured and await pin_sweep.relieve(svc) == 0
    for name in ("slow-human", "human"):
        state = await svc.store.get(conversation_key("t", name))
        assert state is not None and state.kv_transfer_params is not None, name


async def test_under_pressure_a_handle_committed_again_since_the_listing_is_not_taken() -> None:
    """The pass takes each handle only if it is not newer than the pass itself."""
    clock = Clock()
    svc = swept(clock)
    name = await committed(svc, "c", 1, 0.0)
    key = conversation_key("t", name)
    state = await svc.store.get(key)
    assert state is not None
    newer = msgspec.structs.replace(state, turn=2, updated_at=T0 + 100)
    assert await svc.store.commit(key, newer, 1, 3600.0)  # a later commit, no new note
    d1 = svc.pool.find("decode", D1)
    assert d1 is not None
    d1.note_kv_usage(0.95)
    clock.now = T0 + 50
    assert await pin_sweep.relieve(svc) == 0 and released(svc) == []
