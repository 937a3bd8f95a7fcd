"""What only the in-memory store has: lazy expiry by its clock, a size bound, close."""

from __future__ import annotations

import math
from typing import Any

import pytest

from sessions.memory_store import MemorySessionStore
from sessions.model import SessionState
from sessions.store import StoreError
from tests.sessions.conftest import FakeClock

STATE = SessionState(turn=1, api="chat", kv_transfer_params={"remote_num_tokens": 4})


async def test_expiry_is_lazy_and_by_the_clock(clock: FakeClock) -> None:
    store = MemorySessionStore(clock)
    await store.commit("k", STATE, 0, 10.0)
    clock.advance(9.0)
    assert await store.claim("k", "req-1") is not None  # claim keeps the deadline
    clock.advance(1.0)
    assert len(store) == 1  # nothing happens until the key is touched
    assert await store.claim("k", "req-2") is None
    assert len(store) == 0
    # An expired state counts as absent for the compare-and-set too.
    assert await store.commit("k", STATE, 0, 10.0) is True


async def test_size_is_bounded_oldest_commit_first(clock: FakeClock) -> None:
    store = MemorySessionStore(clock, max_entries=2)
    await store.commit("a", STATE, 0, 60.0)
    await store.commit("b", STATE, 0, 60.0)
    await store.commit("a", STATE, 1, 60.0)  # a is now the newest
    await store.commit("c", STATE, 0, 60.0)
    assert len(store) == 2
    assert await store.get("b") is None
    assert await store.get("a") is not None and await store.get("c") is not None


@pytest.mark.parametrize(
    ("method", "args"),
    [
        ("claim", ("k", "r")),
        ("commit", ("k", STATE, 0, 1.0)),
        ("release", ("k", "r")),
        ("get", ("k",)),
        ("delete", ("k",)),
        ("ping", ()),
        ("take_handle", ("k", math.inf)),
        ("end", ("k",)),
        ("note_pin", ("http://d:1", "k", 1.0, 1.0)),
        ("forget_pin", ("http://d:1", "k")),
        ("pins_due", ("http://d:1", math.inf, 1)),
        ("pin_totals", ("http://d:1",)),
    ],
)
async def test_closed_store_raises_store_error(method: str, args: tuple[Any, ...]) -> None:
    store = MemorySessionStore()
    await store.close()
    with pytest.raises(StoreError, match="closed"):
        await getattr(store, method)(*args)


def test_max_entries_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        MemorySessionStore(max_entries=0)


async def test_a_pin_index_is_bounded_oldest_pin_first(clock: FakeClock) -> None:
    store = MemorySessionStore(clock, max_entries=2)
    await store.note_pin("http://d:1", "b", 20.0, 60.0)
    await store.note_pin("http://d:1", "a", 10.0, 60.0)
    await store.note_pin("http://d:1", "c", 30.0, 60.0)
    assert await store.pins_due("http://d:1", math.inf, 10) == [("b", 20.0), ("c", 30.0)]


async def test_a_decode_url_with_braces_is_refused_as_by_redis() -> None:
    store = MemorySessionStore()
    with pytest.raises(ValueError, match="braces"):
        await store.note_pin("http://d:1/{x}", "k", 1.0, 1.0)
