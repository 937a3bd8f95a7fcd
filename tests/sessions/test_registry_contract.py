"""One contract for every instance registry store: the Redis one and the in-memory one pass it
alike; then what only Redis has (the `kvbaton:instances` layout, failures as StoreError)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from harness.procs import free_port
from sessions import connect
from sessions.registry_store import Entry, MemoryRegistry, RedisRegistry, Registry
from sessions.store import StoreError

D1 = "http://d1:8000"
D2 = "http://d2:8000"
P1 = "http://p1:8000"


@pytest.fixture(params=["memory", "redis"])
async def registry(
    request: pytest.FixtureRequest, redis_url_session: str
) -> AsyncIterator[Registry]:
    if request.param == "memory":
        yield MemoryRegistry()
        return
    client = connect.connect(redis_url_session)
    await client.flushall()
    try:
        yield RedisRegistry(client)
    finally:  # a later file's router on this worker would list D1 as its own instance
        await client.flushall()
        await connect.close(client)


async def test_empty(registry: Registry) -> None:
    assert await registry.load() == {}


async def test_put_then_load(registry: Registry) -> None:
    await registry.put(D1, Entry(role="decode", state="draining", updated_at=1.5))
    await registry.put(P1, Entry(role="prefill", state="active"))
    assert await registry.load() == {
        D1: Entry(role="decode", state="draining", updated_at=1.5),
        P1: Entry(role="prefill", state="active", updated_at=0.0),
    }


async def test_put_replaces_the_urls_entry(registry: Registry) -> None:
    await registry.put(D1, Entry(role="decode", state="active", updated_at=1.0))
    await registry.put(D2, Entry(role="decode", state="active", updated_at=1.0))
    await registry.put(D1, Entry(role="decode", state="removed", updated_at=2.0))
    assert await registry.load() == {
        D1: Entry(role="decode", state="removed", updated_at=2.0),
        D2: Entry(role="decode", state="active", updated_at=1.0),
    }


async def test_loaded_entries_are_a_copy(registry: Registry) -> None:
    await registry.put(D1, Entry(role="decode", state="active"))
    loaded = await registry.load()
    loaded.clear()
    assert await registry.load() == {D1: Entry(role="decode", state="active")}


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


async def test_redis_layout_is_readable_with_redis_cli(redis_url: str, raw: aioredis.Redis) -> None:
    """The public contract: HGETALL kvbaton:instances, URL -> a JSON object, fields in order."""
    client = connect.connect(redis_url)
    try:
        await RedisRegistry(client).put(D1, Entry(role="decode", state="draining", updated_at=1.25))
    finally:
        await connect.close(client)
    stored = await raw.hgetall("kvbaton:instances")
    assert stored == {D1: '{"role":"decode","state":"draining","updated_at":1.25}'}
    assert json.loads(stored[D1]) == {"role": "decode", "state": "draining", "updated_at": 1.25}


async def test_redis_entries_written_by_hand_are_read_and_garbage_skipped(
    redis_url: str, raw: aioredis.Redis
) -> None:
    await raw.hset("kvbaton:instances", D1, '{"role":"decode","state":"active"}')
    await raw.hset("kvbaton:instances", D2, "not json")
    await raw.hset("kvbaton:instances", P1, '{"role":"router","state":"active"}')
    client = connect.connect(redis_url)
    try:
        assert await RedisRegistry(client).load() == {D1: Entry(role="decode", state="active")}
    finally:
        await connect.close(client)


async def test_redis_down_is_a_store_error() -> None:
    client = connect.connect(f"redis://127.0.0.1:{free_port()}/0", connect_timeout=0.5)
    registry = RedisRegistry(client)
    try:
        with pytest.raises(StoreError, match="kvbaton:instances"):
            await registry.load()
        with pytest.raises(StoreError, match="kvbaton:instances"):
            await registry.put(D1, Entry(role="decode", state="active"))
    finally:
        await connect.close(client)
