"""One Redis client per process: the session store, the instance registry and the conversation
index share it, each caller keeps its own timeout, and closing the backend closes it once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from sessions.backend import ADMIN_TIMEOUT, open_backend
from sessions.keys import conversation_key
from sessions.model import SessionState
from sessions.registry_store import Entry
from sessions.store import StoreError

KEY = conversation_key("default", "shared")
D1 = "http://d1:8000"


async def test_the_three_stores_share_one_client(redis_url: str) -> None:
    raw = Redis.from_url(redis_url)
    before = len(await raw.client_list())
    backend = open_backend("redis", redis_url, store_timeout=0.5)
    assert backend.conversations is not None
    assert await backend.store.commit(KEY, SessionState(turn=1, decode=D1), 0, 60.0)
    await backend.registry.put(D1, Entry(role="decode", state="draining"))
    page = await backend.conversations.list(D1, "0", 100)
    assert [s.key for s in page.conversations] == [KEY]
    assert await backend.registry.load() == {D1: Entry(role="decode", state="draining")}
    # One pool: the calls, one after the other, all used the same connection (a second
    # client would have opened its own).
    assert len(await raw.client_list()) == before + 1
    await backend.close()
    assert len(await raw.client_list()) == before  # closed once, nothing left open
    await raw.aclose()


async def test_memory_backend_lists_its_own_sessions() -> None:
    backend = open_backend("memory", "", store_timeout=0.5)
    assert backend.client is None and backend.conversations is not None
    assert await backend.store.commit(KEY, SessionState(turn=1, decode=D1), 0, 60.0)
    page = await backend.conversations.list("", "0", 10)
    assert [s.key for s in page.conversations] == [KEY]
    await backend.registry.put(D1, Entry(role="decode", state="active"))
    assert await backend.registry.load() == {D1: Entry(role="decode", state="active")}
    await backend.close()


def test_a_cluster_backend_cannot_list_conversations() -> None:
    """A cluster has one SCAN cursor per node: no listing (nothing connects until a command)."""
    backend = open_backend("redis", "redis+cluster://127.0.0.1:1", store_timeout=0.5)
    assert backend.conversations is None and backend.client is not None


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Accepts and never answers: a Redis too slow to be useful."""
    await reader.read()
    writer.close()


@pytest.fixture
async def stalled_url() -> AsyncIterator[str]:
    server = await asyncio.start_server(_silent, "127.0.0.1", 0)
    yield f"redis://127.0.0.1:{server.sockets[0].getsockname()[1]}/0"
    server.close()


async def test_a_turns_call_keeps_its_short_timeout_and_admin_its_long_one(
    stalled_url: str,
) -> None:
    backend = open_backend("redis", stalled_url, store_timeout=0.1)
    assert backend.conversations is not None
    try:
        started = time.monotonic()
        with pytest.raises(StoreError):
            await backend.store.claim(KEY, "req-1")
        assert time.monotonic() - started < 1.0  # --store-timeout, not the client's 2 s
        started = time.monotonic()
        with pytest.raises(StoreError):
            await backend.conversations.list("", "0", 100)
        assert time.monotonic() - started >= ADMIN_TIMEOUT - 0.1  # a SCAN page gets 2 s
    finally:
        await backend.close()
