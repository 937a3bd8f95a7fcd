"""One contract for every SessionStore: the Redis store and the in-memory store pass it alike,
the part every topology passes (store_contract.py) and the tests run on these two only."""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from harness.waiting import scaled
from sessions.codec import handle_id
from sessions.keys import conversation_key, history_key, pins_key
from sessions.memory_store import MemorySessionStore
from sessions.model import PinSize, PinTotals, SessionState
from sessions.redis_store import RedisSessionStore
from sessions.store import SessionStore
from sessions.vocabulary import Reason
from tests.sessions.conftest import FakeClock

# The store contract every topology passes, run here on the in-memory store and redis-server.
from tests.sessions.store_contract import *  # noqa: F403 (the contract's tests)
from tests.sessions.store_contract import D1, D2, KEY, OTHER, TTL, Harness, held, state_with, totals


@pytest.fixture(params=["memory", "redis"])
async def harness(
    request: pytest.FixtureRequest, clock: FakeClock, redis_url_session: str
) -> AsyncIterator[Harness]:
    if request.param == "memory":
        memory = MemorySessionStore(clock)

        async def memory_ttl(key: str, ttl_s: float) -> None:
            clock.advance(ttl_s - 0.01)
            assert await memory.get(key) is not None
            clock.advance(0.01)
            assert await memory.get(key) is None

        async def memory_pin_ttl(decode: str, ttl_s: float) -> None:
            clock.advance(ttl_s - 0.01)
            assert (await memory.pin_totals(decode)).handles > 0
            clock.advance(0.01)
            assert (await memory.pin_totals(decode)).handles == 0

        yield Harness(memory, memory_ttl, memory_pin_ttl)
        await memory.close()
        return
    # The async `redis_url` fixture cannot be requested lazily; flush here as it does.
    raw = aioredis.Redis.from_url(redis_url_session)
    await raw.flushall()
    # The contract is about atomicity, not latency: a busy machine must not time a call out.
    store = RedisSessionStore(redis_url_session, timeout=scaled(2.0))

    async def redis_ttl(key: str, ttl_s: float) -> None:
        pttl = await raw.pttl(key)
        assert ttl_s * 1000 - 5_000 < pttl <= ttl_s * 1000

    async def redis_pin_ttl(decode: str, ttl_s: float) -> None:
        await redis_ttl(pins_key(decode), ttl_s)

    yield Harness(store, redis_ttl, redis_pin_ttl)
    await store.close()
    await raw.aclose()


async def test_a_claim_expecting_another_prefix_takes_nothing(
    harness: Harness, params: dict[str, Any]
) -> None:
    store = harness.store
    assert await store.commit(KEY, state_with(params), 0, TTL)
    seen = await store.claim(KEY, "req-1", expect_prefix="ef" * 16)
    assert seen is not None and seen.kv_transfer_params == params
    kept = await store.get(KEY)
    assert kept is not None and kept.kv_transfer_params == params and not kept.inflight
    taken = await store.claim(KEY, "req-2", expect_prefix="ab" * 16)
    assert taken is not None and taken.kv_transfer_params == params
    after = await store.get(KEY)
    assert after is not None and after.kv_transfer_params is None and after.inflight == "req-2"


async def test_history_keys_are_values_with_a_ttl(harness: Harness) -> None:
    store = harness.store
    hist = history_key("tenant-a", "ab" * 16)
    other = history_key("tenant-b", "ab" * 16)
    assert await store.find_history([]) == []
    assert await store.find_history([hist, other]) == [None, None]
    await store.index_history(hist, "3 h-one", TTL)
    assert await store.find_history([other, hist]) == [None, "3 h-one"]
    await store.index_history(hist, "5 h-two", TTL)
    assert await store.find_history([hist]) == ["5 h-two"]


async def test_the_pin_index_sums_what_its_handles_pin(harness: Harness) -> None:
    store = harness.store
    assert await store.pin_totals(D1) == PinTotals()
    await store.note_pin(D1, KEY, 1.0, TTL, held(521, *range(1, 34)))
    await store.note_pin(D1, OTHER, 2.0, TTL, held(70, *range(100, 105)))
    await store.note_pin(D2, KEY, 3.0, TTL, held(16000, *range(1, 1001)))
    assert await store.pin_totals(D1) == totals(2, 38, 38, 591)
    await store.note_pin(D1, KEY, 4.0, TTL, held(630, *range(1, 41)))  # its next handle
    assert await store.pin_totals(D1) == totals(2, 45, 45, 700)
    await store.forget_pin(D1, OTHER)
    assert await store.pin_totals(D1) == totals(1, 40, 40, 630)
    await store.note_pin(D1, OTHER, 5.0, TTL)  # a handle of unknown size counts none
    assert await store.pin_totals(D1) == totals(2, 40, 40, 630)
    await store.forget_pin(D1, KEY)
    await store.forget_pin(D1, OTHER)
    assert await store.pin_totals(D1) == PinTotals()
    assert await store.pin_totals(D2) == totals(1, 1000, 1000, 16000)


async def test_a_block_listed_twice_in_one_handle_is_one_block(harness: Harness) -> None:
    store = harness.store
    await store.note_pin(D1, KEY, 1.0, TTL, PinSize(3, 40, "0:7 0:7 0:8"))
    await store.note_pin(D1, OTHER, 2.0, TTL, held(20, 7))
    assert await store.pin_totals(D1) == totals(2, 2, 4, 60)
    await store.note_pin(D1, KEY, 3.0, TTL, held(20, 8))
    assert await store.pin_totals(D1) == totals(2, 2, 2, 40)
    await store.forget_pin(D1, OTHER)
    assert await store.pin_totals(D1) == totals(1, 1, 1, 20)


async def test_distinct_blocks_follow_any_notes_and_forgets(harness: Harness) -> None:
    """Random notes and forgets of a few conversations whose next handles keep part of the
    former one and add blocks (names that begin alike, 0:1, 0:12, 0:123; lists longer than
    256 bytes; repeats), against the distinct blocks and sums counted here."""
    rng, store = random.Random(48), harness.store
    members = [conversation_key("t", f"m{i}") for i in range(4)]
    names = [f"{rank}:{b}" for rank in (0, 1) for b in (*range(1, 40), 12, 123, 1234, 12345)]
    live: dict[str, list[str]] = {}
    for _ in range(300):
        member = rng.choice(members)
        if rng.random() < 0.2:
            await store.forget_pin(D1, member)
            live.pop(member, None)
        else:
            former = live.get(member, [])
            kept = former[: rng.randint(0, len(former))] if rng.random() < 0.8 else []
            blocks = (kept + rng.choices(names, k=rng.randint(0, 40)))[:120]
            size = PinSize(len(blocks), 16 * len(blocks), " ".join(blocks))
            await store.note_pin(D1, member, 1.0, TTL, size)
            live[member] = blocks
        summed = sum(len(b) for b in live.values())
        distinct = len({n for b in live.values() for n in b})
        assert await store.pin_totals(D1) == totals(len(live), distinct, summed, 16 * summed)


async def put_back(store: SessionStore, state: SessionState) -> None:
    """An older record written over the live one, as a restore or a lagging replica would."""
    current = await store.get(KEY)
    assert await store.commit(KEY, state, current.turn if current else 0, TTL)


def stale(state: SessionState) -> SessionState:
    return msgspec.structs.replace(
        state, kv_transfer_params=None, no_handle_reason=str(Reason.STALE_HANDLE)
    )


async def test_a_claimed_handle_put_back_is_never_taken_again(
    harness: Harness, params: dict[str, Any]
) -> None:
    store = harness.store
    state = state_with(params)
    await store.commit(KEY, state, 0, TTL)
    assert await store.claim(KEY, "req-1") == state  # read once
    await put_back(store, state)
    assert await store.claim(KEY, "req-2") == stale(state)
    assert await store.get(KEY) == stale(state)  # not held by the turn: nothing to give back
    assert await store.take_handle(KEY, math.inf) is None
    # Another conversation holding the same handle is its own matter.
    await store.commit(OTHER, state, 0, TTL)
    assert await store.claim(OTHER, "req-3") == state


async def test_a_released_or_ended_handle_put_back_is_never_taken_again(
    harness: Harness, params: dict[str, Any]
) -> None:
    store = harness.store
    state = state_with(params)
    await store.commit(KEY, state, 0, TTL)
    assert await store.take_handle(KEY, math.inf) == state  # released
    await put_back(store, state)
    assert await store.take_handle(KEY, math.inf) is None
    assert await store.get(KEY) == stale(state)
    await put_back(store, state)
    assert await store.claim(KEY, "req-1") == stale(state)
    await store.delete(KEY)
    other = state_with({**params, "remote_request_id": "another"})
    await store.commit(KEY, other, 0, TTL)
    assert await store.end(KEY) == other  # ended: its handle goes to a release
    await put_back(store, other)
    assert await store.end(KEY) == msgspec.structs.replace(other, kv_transfer_params=None)


async def test_spend_takes_a_handle_that_may_have_been_committed(
    harness: Harness, params: dict[str, Any]
) -> None:
    store = harness.store
    state = state_with(params)
    await store.commit(KEY, state, 0, TTL)
    await store.spend(KEY, "0" * 40, 4e9)  # another handle: nothing changes
    assert await store.get(KEY) == state
    await store.spend(KEY, handle_id(params), 4e9)
    released = msgspec.structs.replace(
        state, kv_transfer_params=None, no_handle_reason=str(Reason.RELEASED)
    )
    assert await store.get(KEY) == released
    await put_back(store, state)
    assert await store.claim(KEY, "req-1") == stale(state)
    await store.spend(OTHER, handle_id(params), 4e9)  # no state: remembered all the same
    await store.commit(OTHER, state, 0, TTL)
    assert await store.claim(OTHER, "req-2") == stale(state)


async def test_a_handle_with_an_unreadable_deadline_is_still_spent(
    harness: Harness, params: dict[str, Any]
) -> None:
    store = harness.store
    state = state_with(params, handle_expires_at=1e18)  # absurd: spent for 900 s
    await store.commit(KEY, state, 0, TTL)
    assert await store.claim(KEY, "req-1") == state
    await put_back(store, state)
    assert (await store.claim(KEY, "req-2")) == stale(state)


async def test_a_sweep_forgets_only_the_entry_it_found_due(harness: Harness) -> None:
    """A sweep lists an entry, a commit notes a newer handle of the same conversation, then
    the sweep (whose take found nothing) forgets what it listed: the newer entry stays."""
    store = harness.store
    await store.note_pin(D1, KEY, 100.0, TTL, PinSize(2, 20))
    ((key, at),) = await store.pins_due(D1, math.inf, 10)
    await store.note_pin(D1, KEY, 200.0, TTL, PinSize(3, 30))
    await store.forget_pin(D1, key, at)
    assert await store.pins_due(D1, math.inf, 10) == [(KEY, 200.0)]
    await store.forget_pin(D1, key, 200.0)
    assert await store.pins_due(D1, math.inf, 10) == []
