"""sessions.connect.BoundedPool against a real redis-server: commands past the bound wait for a
connection (and fail clearly when none comes in time); every release frees its slot."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from sessions import connect


@contextlib.asynccontextmanager
async def bounded(
    url: str, size: int, timeout: float
) -> AsyncIterator[tuple[connect.BoundedPool, aioredis.Redis]]:
    pool = connect.BoundedPool.from_url(url, max_connections=size, timeout=timeout)
    client = aioredis.Redis.from_pool(pool)
    try:
        yield pool, client
    finally:
        await client.aclose()


async def test_a_single_server_url_gets_the_bounded_pool(redis_url_session: str) -> None:
    client = connect.connect(redis_url_session, max_connections=7)
    try:
        pool = client.connection_pool
        assert isinstance(pool, connect.BoundedPool) and pool.bound == 7
        assert await client.ping()
    finally:
        await connect.close(client)


async def test_commands_past_the_bound_wait_for_a_free_connection(redis_url_session: str) -> None:
    async with bounded(redis_url_session, 2, 10) as (pool, client):
        # 20 commands that each hold their connection 50 ms, through 2 connections.
        key = "kvbaton-test:bounded-pool:empty"
        replies = await asyncio.gather(*(client.blpop([key], timeout=0.05) for _ in range(20)))
        assert replies == [None] * 20
        assert len(pool._available_connections) == 2  # never more than the bound
        assert not pool._in_use_connections
        assert not pool._slots.locked()  # every slot is back


async def test_no_connection_in_time_is_a_clear_connection_error(redis_url_session: str) -> None:
    async with bounded(redis_url_session, 1, 0.1) as (pool, client):
        held = await pool.get_connection()
        with pytest.raises(RedisConnectionError, match="No connection available"):
            await client.ping()
        await pool.release(held)
        assert await client.ping()  # the slot is free again
        with pytest.raises(KeyError):  # released twice: refused as redis-py's pool refuses it
            await pool.release(held)
        assert pool._slots._value == 1  # and no slot more


async def test_a_cancelled_wait_leaves_the_slots_as_they_were(redis_url_session: str) -> None:
    async with bounded(redis_url_session, 1, 10) as (pool, client):
        held = await pool.get_connection()
        waiting = asyncio.create_task(client.ping())
        await asyncio.sleep(0.05)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        await pool.release(held)
        assert pool._slots._value == 1
        assert await client.ping()


async def test_a_connection_that_cannot_connect_frees_its_slot() -> None:
    # redis-py's get_connection releases a connection it made but could not connect before
    # the caller sees it: the slot is freed once, not twice.
    async with bounded("redis://127.0.0.1:1", 2, 1) as (pool, client):
        for _ in range(3):
            with pytest.raises(RedisConnectionError):
                await client.ping()
        assert pool._slots._value == 2 and not pool._holding
