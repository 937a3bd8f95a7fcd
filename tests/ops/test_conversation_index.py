"""Listing conversations by decode instance: one suite for the Redis index (a real
redis-server, SCAN paging) and the in-memory one; key parsing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import redis.asyncio as aioredis

from sessions.admin_ops import ConversationIndex, RedisConversationIndex, Summary
from sessions.backend import open_backend
from sessions.keys import conversation_key, split_conversation_key
from sessions.model import SessionState
from sessions.store import SessionStore

D1, D2 = "http://d1:8200", "http://d2:8200"


@dataclass
class Setup:
    store: SessionStore
    index: ConversationIndex


@pytest.fixture(params=["memory", "redis"])
async def setup(request: pytest.FixtureRequest, redis_url_session: str) -> AsyncIterator[Setup]:
    """The store and the index as the router's lifespan opens them: one Backend, one client."""
    backend = open_backend(request.param, redis_url_session, store_timeout=1.0)
    assert backend.conversations is not None
    if backend.client is not None:
        await backend.client.flushdb()
    try:
        yield Setup(backend.store, backend.conversations)
    finally:
        if backend.client is not None:
            await backend.client.flushdb()
        await backend.close()


async def fill(store: SessionStore, n: int) -> dict[str, str]:
    """n conversations, alternately on D1 and D2; returns key -> decode."""
    placed: dict[str, str] = {}
    for i in range(n):
        decode = D1 if i % 2 == 0 else D2
        key = conversation_key("default" if i % 3 else "abcd", f"c-{i}")
        params = {"remote_block_ids": [1], "remote_num_tokens": 32} if i % 4 else None
        state = SessionState(turn=1, decode=decode, kv_transfer_params=params, token_count=32)
        assert await store.commit(key, state, 0, 60.0)
        placed[key] = decode
    return placed


async def walk(index: ConversationIndex, decode: str, count: int) -> list[Summary]:
    found: list[Summary] = []
    cursor = "0"
    for _ in range(1000):
        page = await index.list(decode, cursor, count)
        assert page.scanned <= max(count * 10, 10)
        found += page.conversations
        cursor = page.cursor
        if cursor == "0":
            return found
    raise AssertionError("the walk never completed")


async def test_pages_cover_every_conversation_of_a_decode_instance(setup: Setup) -> None:
    placed = await fill(setup.store, 30)
    listed = await walk(setup.index, D1, 4)
    keys = [s.key for s in listed]
    assert sorted(set(keys)) == sorted(k for k, d in placed.items() if d == D1)
    everything = await walk(setup.index, "", 7)
    assert {s.key for s in everything} == set(placed)
    one = next(s for s in everything if s.conversation_id == "c-1")
    assert (one.tenant, one.turn, one.decode, one.has_handle, one.token_count) == (
        "default",
        1,
        D2,
        True,
        32,
    )
    assert next(s for s in everything if s.conversation_id == "c-0").tenant == "abcd"
    assert not next(s for s in everything if s.conversation_id == "c-4").has_handle


async def test_ttl_of_a_conversation(setup: Setup) -> None:
    placed = await fill(setup.store, 1)
    (key,) = placed
    ttl = await setup.index.ttl(key)
    assert ttl is not None and 0 < ttl <= 60
    assert await setup.index.ttl(conversation_key("default", "nothing")) is None


async def test_a_bad_cursor_is_refused(setup: Setup) -> None:
    for cursor in ("x", "-1"):
        with pytest.raises(ValueError):
            await setup.index.list("", cursor, 10)


async def test_redis_listing_skips_foreign_and_garbage_keys(redis_url_session: str) -> None:
    client = aioredis.from_url(redis_url_session)
    await client.flushdb()
    try:
        await client.hset("kvbaton:conv:not-a-tagged-key", mapping={"turn": "1", "decode": D1})
        await client.hset(conversation_key("t", "no-turn"), mapping={"decode": D1})
        await client.hset(conversation_key("t", "ok"), mapping={"turn": "2", "decode": D1})
        page = await RedisConversationIndex(client).list(D1, "0", 1000)
        assert [s.conversation_id for s in page.conversations] == ["ok"]
    finally:
        await client.flushdb()
        await client.aclose()


@pytest.mark.parametrize(
    ("key", "parts"),
    [
        ("kvbaton:conv:{default:abc}", ("default", "abc")),
        ("kvbaton:conv:{0123abcd:a:b/c}", ("0123abcd", "a:b/c")),
        ("kvbaton:conv:{nocolon}", None),
        ("kvbaton:conv:{:x}", None),
        ("kvbaton:instances", None),
        ("kvbaton:conv:default:abc", None),
    ],
)
def test_split_conversation_key(key: str, parts: tuple[str, str] | None) -> None:
    assert split_conversation_key(key) == parts
    if parts is not None:
        assert conversation_key(*parts) == key
