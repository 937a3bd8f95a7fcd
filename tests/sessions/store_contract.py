"""The store contract every topology passes: the in-memory store and a redis-server here
(test_store_contract.py), a Redis Cluster and a Sentinel-managed master (test_store_topologies.py).
Each test module runs the tests it imports with its own `harness` fixture."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
import pytest

from sessions.keys import conversation_key
from sessions.model import PinSize, PinTotals, SessionState, TurnTimes, handle_unusable_reason
from sessions.store import PinNote, SessionStore
from sessions.vocabulary import Reason

KEY = conversation_key("tenant-a", "conv-1")
OTHER = conversation_key("tenant-b", "conv-1")
TTL = 600.0
D1 = "http://d1:8000"
D2 = "http://10.0.0.22:8200/v1"


@dataclass
class Harness:
    store: SessionStore
    # Checks that key expires after about ttl_s (Redis: PTTL; memory: by moving the clock).
    assert_ttl: Callable[[str, float], Awaitable[None]]
    # The same for a decode instance's pin index (`pins_key`).
    assert_pin_ttl: Callable[[str, float], Awaitable[None]]


def state_with(params: dict[str, Any] | None, **fields: Any) -> SessionState:
    base = SessionState(
        turn=1,
        api="chat",
        prefill="http://p1:8000",
        decode="http://d1:8000",
        decode_engine_id="d-engine-1",
        kv_transfer_params=params,
        prefix_digest="ab" * 16,
        prefix_len=3,
        token_count=40,
        block_size=16,
        block_digests=("0123456789abcdef", "fedcba9876543210"),
        seq_digest="cd" * 16,
        handle_expires_at=1_700_000_400.0,
        created_at=1_700_000_000.0,
        updated_at=1_700_000_000.0,
    )
    return msgspec.structs.replace(base, **fields)


async def test_absent_key(harness: Harness) -> None:
    store = harness.store
    assert await store.claim(KEY, "req-1") is None
    assert await store.get(KEY) is None
    assert await store.delete(KEY) is False
    await store.release(KEY, "req-1")
    assert await store.get(KEY) is None  # release never creates a state
    await store.ping()


async def test_commit_then_get(harness: Harness, params: dict[str, Any]) -> None:
    state = state_with(params)
    assert await harness.store.commit(KEY, state, 0, TTL) is True
    assert await harness.store.get(KEY) == state
    assert await harness.store.get(OTHER) is None


async def test_claim_takes_the_handle(harness: Harness, params: dict[str, Any]) -> None:
    store = harness.store
    state = state_with(params)
    await store.commit(KEY, state, 0, TTL)

    first = await store.claim(KEY, "req-1")
    assert first == state  # as it was, handle included
    assert handle_unusable_reason(first, "chat", 1_700_000_001.0) is None

    second = await store.claim(KEY, "req-2")
    assert second is not None
    assert second.kv_transfer_params is None
    assert second.inflight == "req-1"  # the holder, not the late comer
    assert handle_unusable_reason(second, "chat", 1_700_000_001.0) == "busy"
    # Only the handle went: affinity, digests and turn stay for the next turn.
    assert second == state_with(None, inflight="req-1")
    assert await store.get(KEY) == second


async def test_claim_without_handle_changes_nothing(harness: Harness) -> None:
    state = state_with(None, no_handle_reason="stream-no-kv-params")
    await harness.store.commit(KEY, state, 0, TTL)
    assert await harness.store.claim(KEY, "req-1") == state
    assert await harness.store.get(KEY) == state


async def test_concurrent_claims_single_use(harness: Harness, params: dict[str, Any]) -> None:
    await harness.store.commit(KEY, state_with(params), 0, TTL)
    claims = await asyncio.gather(*(harness.store.claim(KEY, f"req-{i}") for i in range(20)))
    winners = [c for c in claims if c is not None and c.kv_transfer_params is not None]
    assert len(winners) == 1
    assert all(c is not None for c in claims)


async def test_commit_is_compare_and_set(harness: Harness, params: dict[str, Any]) -> None:
    store = harness.store
    first = state_with(params, no_handle_reason="")
    assert await store.commit(KEY, first, 0, TTL) is True
    assert await store.commit(KEY, state_with(params, prefill="http://p9:8000"), 0, TTL) is False
    assert await store.get(KEY) == first

    await store.claim(KEY, "req-1")
    second = state_with(None, turn=2, no_handle_reason="stream-no-kv-params", block_digests=())
    assert await store.commit(KEY, second, 1, TTL) is True
    # A slower turn that read turn 1 loses; the stored state is the whole committed one.
    assert await store.commit(KEY, state_with(params, turn=2), 1, TTL) is False
    assert await store.commit(KEY, state_with(params, turn=3), 3, TTL) is False
    assert await store.get(KEY) == second


async def test_concurrent_commits_one_wins(harness: Harness, params: dict[str, Any]) -> None:
    candidates = [state_with(params, decode=f"http://d{i}:8000") for i in range(10)]
    results = await asyncio.gather(*(harness.store.commit(KEY, s, 0, TTL) for s in candidates))
    assert results.count(True) == 1
    assert await harness.store.get(KEY) == candidates[results.index(True)]


async def test_commit_sets_the_ttl(harness: Harness, params: dict[str, Any]) -> None:
    await harness.store.commit(KEY, state_with(params), 0, 30.0)
    await harness.store.commit(KEY, state_with(params, turn=2), 1, TTL)  # refreshed, not kept
    await harness.store.claim(KEY, "req-1")  # claim and release keep it
    await harness.store.release(KEY, "req-1")
    await harness.assert_ttl(KEY, TTL)


async def test_release(harness: Harness, params: dict[str, Any]) -> None:
    store = harness.store
    await store.commit(KEY, state_with(params), 0, TTL)
    await store.claim(KEY, "req-1")
    await store.release(KEY, "req-2")  # not the holder: no-op
    held = await store.get(KEY)
    assert held is not None and held.inflight == "req-1"

    await store.release(KEY, "req-1")
    released = await store.get(KEY)
    assert released == state_with(None)  # the handle stays spent
    assert handle_unusable_reason(released, "chat", 1_700_000_001.0) == "no-handle"


async def test_delete(harness: Harness, params: dict[str, Any]) -> None:
    await harness.store.commit(KEY, state_with(params), 0, TTL)
    await harness.store.commit(OTHER, state_with(params), 0, TTL)
    assert await harness.store.delete(KEY) is True
    assert await harness.store.get(KEY) is None
    assert await harness.store.delete(KEY) is False
    assert await harness.store.get(OTHER) is not None
    assert await harness.store.commit(KEY, state_with(params), 0, TTL) is True  # starts over


async def test_stored_state_is_a_copy(harness: Harness, params: dict[str, Any]) -> None:
    await harness.store.commit(KEY, state_with(params), 0, TTL)
    params["remote_engine_id"] = "mutated"
    got = await harness.store.get(KEY)
    assert got is not None and got.kv_transfer_params is not None
    got.kv_transfer_params["remote_port"] = 1
    claimed = await harness.store.claim(KEY, "req-1")
    assert claimed is not None and claimed.kv_transfer_params is not None
    assert claimed.kv_transfer_params["remote_engine_id"] == "d-engine-1"
    assert claimed.kv_transfer_params["remote_port"] == 5600


RELEASED = state_with(None, no_handle_reason="released")
UPDATED = 1_700_000_000.0  # state_with's updated_at


async def test_take_handle_takes_an_idle_handle_once(
    harness: Harness, params: dict[str, Any]
) -> None:
    store = harness.store
    state = state_with(params)
    await store.commit(KEY, state, 0, TTL)
    assert await store.take_handle(KEY, UPDATED) == state  # as it was, handle included
    # Only the handle went, as a claim takes it, and the next turn learns why.
    assert await store.get(KEY) == RELEASED
    assert handle_unusable_reason(RELEASED, "chat", UPDATED + 1) is Reason.RELEASED
    assert await store.take_handle(KEY, math.inf) is None  # single use
    assert await store.claim(KEY, "req-1") == RELEASED  # nothing left to claim
    assert await store.get(KEY) == RELEASED  # and the claim took nothing
    await harness.assert_ttl(KEY, TTL)  # the conversation keeps its TTL


@pytest.mark.parametrize(
    ("stored", "not_after"),
    [
        ("fresh", UPDATED - 0.001),  # updated after not_after: a turn may read it soon
        ("no-handle", math.inf),
        ("null-handle", math.inf),
        ("in-flight", math.inf),
    ],
)
async def test_take_handle_leaves_what_it_may_not_take(
    harness: Harness, params: dict[str, Any], stored: str, not_after: float
) -> None:
    state = {
        "fresh": state_with(params),
        "no-handle": state_with(None, no_handle_reason="stream-no-kv-params"),
        "null-handle": state_with(None),
        "in-flight": state_with(params, inflight="req-9"),
    }[stored]
    await harness.store.commit(KEY, state, 0, TTL)
    assert await harness.store.take_handle(KEY, not_after) is None
    assert await harness.store.get(KEY) == state


async def test_take_handle_without_a_state(harness: Harness) -> None:
    assert await harness.store.take_handle(KEY, math.inf) is None
    assert await harness.store.get(KEY) is None  # creates nothing


async def test_take_handle_any_age_with_inf(harness: Harness, params: dict[str, Any]) -> None:
    state = state_with(params, updated_at=4_000_000_000.0)  # even one from the future
    await harness.store.commit(KEY, state, 0, TTL)
    assert await harness.store.take_handle(KEY, math.inf) == state


async def test_a_handle_is_claimed_or_released_never_both(
    harness: Harness, params: dict[str, Any]
) -> None:
    store = harness.store
    await store.commit(KEY, state_with(params), 0, TTL)
    calls = [store.claim(KEY, f"req-{i}") for i in range(10)]
    calls += [store.take_handle(KEY, math.inf) for _ in range(10)]
    results = await asyncio.gather(*calls)
    winners = [r for r in results if r is not None and r.kv_transfer_params is not None]
    assert len(winners) == 1


async def test_a_claimed_handle_cannot_be_released(
    harness: Harness, params: dict[str, Any]
) -> None:
    store = harness.store
    await store.commit(KEY, state_with(params), 0, TTL)
    await store.claim(KEY, "req-1")
    assert await store.take_handle(KEY, math.inf) is None
    held = await store.get(KEY)
    assert held == state_with(None, inflight="req-1")  # still the turn's, reason untouched


async def test_end_returns_the_state_and_deletes_it(
    harness: Harness, params: dict[str, Any]
) -> None:
    store = harness.store
    state = state_with(params)
    await store.commit(KEY, state, 0, TTL)
    await store.commit(OTHER, state, 0, TTL)
    assert await store.end(KEY) == state  # with its handle, for the release
    assert await store.get(KEY) is None
    assert await store.end(KEY) is None
    assert await store.get(OTHER) == state
    assert await store.commit(KEY, state, 0, TTL) is True  # starts over


async def test_end_and_claim_race(harness: Harness, params: dict[str, Any]) -> None:
    """The handle goes to one of them: a claim after the end finds no session."""
    store = harness.store
    await store.commit(KEY, state_with(params), 0, TTL)
    claimed, ended = await asyncio.gather(store.claim(KEY, "req-1"), store.end(KEY))
    assert ended is not None
    holders = [s for s in (claimed, ended) if s is not None and s.kv_transfer_params]
    assert len(holders) == 1
    assert await store.get(KEY) is None


async def test_pins_are_listed_oldest_first(harness: Harness) -> None:
    store = harness.store
    assert (await store.pin_totals(D1)).handles == 0
    assert await store.pins_due(D1, math.inf, 10) == []
    for name, at in [("c", 30.0), ("a", 10.0), ("b", 20.0), ("z", 20.0), ("y", 20.0)]:
        await store.note_pin(D1, conversation_key("t", name), at, TTL)
    a, b, c, y, z = (conversation_key("t", n) for n in "abcyz")
    assert (await store.pin_totals(D1)).handles == 5
    assert await store.pins_due(D1, 20.0, 10) == [(a, 10.0), (b, 20.0), (y, 20.0), (z, 20.0)]
    assert await store.pins_due(D1, 19.999, 10) == [(a, 10.0)]
    assert (await store.pins_due(D1, 30.0, 10))[-1] == (c, 30.0)
    assert await store.pins_due(D1, 9.0, 10) == []
    assert await store.pins_due(D1, math.inf, 2) == [(a, 10.0), (b, 20.0)]
    assert await store.pins_due(D1, math.inf, 0) == []
    assert await store.pins_due(D1, math.inf, -1) == []
    assert await store.pins_due(D2, math.inf, 10) == []  # another D's index
    assert (await store.pin_totals(D2)).handles == 0


async def test_a_newer_note_replaces_and_forget_removes(harness: Harness) -> None:
    store = harness.store
    await store.note_pin(D1, KEY, 1_700_000_000.25, TTL)
    await store.note_pin(D1, OTHER, 1_700_000_001.5, TTL)
    await store.note_pin(D2, KEY, 1_700_000_002.0, TTL)
    await store.note_pin(D1, KEY, 1_700_000_009.75, TTL)  # its next handle
    assert (await store.pin_totals(D1)).handles == 2
    assert await store.pins_due(D1, math.inf, 10) == [
        (OTHER, 1_700_000_001.5),
        (KEY, 1_700_000_009.75),
    ]
    await store.forget_pin(D1, KEY)
    await store.forget_pin(D1, KEY)  # absent: no-op
    await store.forget_pin(D2, OTHER)
    assert await store.pins_due(D1, math.inf, 10) == [(OTHER, 1_700_000_001.5)]
    assert await store.pins_due(D2, math.inf, 10) == [(KEY, 1_700_000_002.0)]
    await store.forget_pin(D1, OTHER)
    assert (await store.pin_totals(D1)).handles == 0
    await store.note_pin(D1, KEY, 5.0, TTL)  # an emptied index starts over
    assert await store.pins_due(D1, math.inf, 10) == [(KEY, 5.0)]


def held(tokens: int, *ids: int) -> PinSize:
    """A handle's size that names its blocks of D (rank 0), as a connector reads them."""
    return PinSize(len(ids), tokens, " ".join(f"0:{i}" for i in ids))


def totals(handles: int, blocks: int, handle_blocks: int, tokens: int) -> PinTotals:
    return PinTotals(handles, blocks, handle_blocks, tokens)


async def test_blocks_several_handles_pin_count_once(harness: Harness) -> None:
    """issue 48: handles that share D's blocks (a common system prompt D's prefix cache served
    to each) count them once in `blocks`, as D does; `handle_blocks` sums handle by handle."""
    store, third = harness.store, conversation_key("t", "third")
    shared = range(1, 31)  # 30 blocks of a system prompt
    await store.note_pin(D1, KEY, 1.0, TTL, held(500, *shared, 31, 32))
    await store.note_pin(D1, OTHER, 2.0, TTL, held(500, *shared, 40, 41))
    await store.note_pin(D1, third, 3.0, TTL, held(500, *shared, 50, 51))
    assert await store.pin_totals(D1) == totals(3, 36, 96, 1500)
    # Another rank's block 31 (data parallelism: a pool of its own) is another block.
    await store.note_pin(D1, KEY, 4.0, TTL, PinSize(2, 30, "0:31 1:31"))
    assert await store.pin_totals(D1) == totals(3, 36, 66, 1030)  # the shared 30 still held
    await store.forget_pin(D1, OTHER)
    await store.forget_pin(D1, OTHER)  # forgotten twice: taken back once
    assert await store.pin_totals(D1) == totals(2, 34, 34, 530)
    await store.forget_pin(D1, third)
    assert await store.pin_totals(D1) == totals(1, 2, 2, 30)
    await store.forget_pin(D2, KEY)  # another D's index: nothing here changes
    assert await store.pin_totals(D1) == totals(1, 2, 2, 30)


async def test_a_next_handle_takes_back_what_it_no_longer_pins(harness: Harness) -> None:
    """A conversation's next handle on the same D keeps most of its blocks (D's prefix cache):
    the blocks it dropped are no longer counted, those it kept once, a repeated note (a retried
    script) changes nothing, and a handle of unknown blocks leaves none counted."""
    store = harness.store
    await store.note_pin(D1, OTHER, 1.0, TTL, held(100, 1, 2))
    await store.note_pin(D1, KEY, 2.0, TTL, held(300, 1, 2, 3, 4, 5))
    await store.note_pin(D1, KEY, 3.0, TTL, held(400, 1, 2, 3, 6, 7, 8))  # 4 and 5 freed
    assert await store.pin_totals(D1) == totals(2, 6, 8, 500)
    await store.note_pin(D1, KEY, 3.0, TTL, held(400, 1, 2, 3, 6, 7, 8))
    assert await store.pin_totals(D1) == totals(2, 6, 8, 500)
    await store.note_pin(D1, KEY, 4.0, TTL, PinSize(6, 400))  # which blocks: unknown
    assert await store.pin_totals(D1) == totals(2, 2, 8, 500)
    await store.note_pin(D1, KEY, 5.0, TTL, held(50, 9))
    await store.forget_pin(D1, OTHER)
    assert await store.pin_totals(D1) == totals(1, 1, 1, 50)
    await store.forget_pin(D1, KEY)
    assert await store.pin_totals(D1) == PinTotals()
    await store.note_pin(D1, KEY, 6.0, TTL, held(20, 9))  # an emptied index starts over
    assert await store.pin_totals(D1) == totals(1, 1, 1, 20)


async def test_the_pin_index_expiry_only_grows(harness: Harness) -> None:
    store = harness.store
    await store.note_pin(D1, KEY, 1.0, 30.0)
    await store.note_pin(D1, OTHER, 2.0, 10.0)  # a shorter TTL does not shorten it
    await store.forget_pin(D1, OTHER)
    await harness.assert_pin_ttl(D1, 30.0)
    await store.note_pin(D2, KEY, 1.0, 30.0)
    await store.note_pin(D2, KEY, 3.0, TTL)  # a longer one extends it
    await harness.assert_pin_ttl(D2, TTL)


async def test_a_commit_with_a_pin_notes_it_when_it_commits(harness: Harness) -> None:
    store = harness.store
    state = SessionState(turn=1, decode=D1, kv_transfer_params={"remote_engine_id": "d1"})
    note = PinNote(D1, 1_700_000_000.5, held(40, 1, 2, 3))
    assert await store.commit(KEY, state, 0, 30.0, note)
    assert await store.pins_due(D1, math.inf, 10) == [(KEY, 1_700_000_000.5)]
    assert await store.pin_totals(D1) == totals(1, 3, 3, 40)
    assert await store.get(KEY) == state
    # A lost race commits nothing and notes nothing.
    late = PinNote(D2, 1_700_000_001.0, held(99, *range(9)))
    assert not await store.commit(KEY, msgspec.structs.replace(state, turn=2), 0, 30.0, late)
    assert await store.pin_totals(D2) == PinTotals()
    assert (await store.get(KEY)) == state
    # The next turn's note replaces it; the index expires with the state's TTL at the least.
    note = PinNote(D1, 1_700_000_002.0, held(60, 1, 2, 3, 4))
    assert await store.commit(KEY, msgspec.structs.replace(state, turn=2), 1, 30.0, note)
    assert await store.pin_totals(D1) == totals(1, 4, 4, 60)
    # Another conversation's commit on the same D counts the blocks they share once.
    note = PinNote(D1, 1_700_000_003.0, held(60, 1, 2, 3, 5))
    assert await store.commit(OTHER, state, 0, 30.0, note)
    assert await store.pin_totals(D1) == totals(2, 5, 8, 120)
    await harness.assert_pin_ttl(D1, 30.0)


async def test_turn_times_read_each_conversation_s_pace_and_leave_its_handle(
    harness: Harness, params: dict[str, Any]
) -> None:
    store = harness.store
    assert await store.turn_times([]) == []
    first = state_with(params, created_at=1_700_000_000.0, updated_at=1_700_000_000.0)
    assert await store.commit(KEY, first, 0, TTL)
    third = state_with(params, turn=3, created_at=1_700_000_000.0, updated_at=1_700_000_021.5)
    assert await store.commit(OTHER, third, 0, TTL)
    times = await store.turn_times([OTHER, conversation_key("t", "absent"), KEY])
    assert times == [
        TurnTimes(3, 1_700_000_000.0, 1_700_000_021.5),
        None,
        TurnTimes(1, 1_700_000_000.0, 1_700_000_000.0),
    ]
    assert times[0] is not None and times[0].cadence() == 10.75
    assert times[2] is not None and times[2].cadence() is None  # one turn: no cadence yet
    assert await store.get(OTHER) == third  # nothing taken, nothing changed


# The contract's tests, which each topology's test module collects with `import *`: a test
# added above runs on every topology.
__all__ = [name for name in dict(globals()) if name.startswith("test_")]
