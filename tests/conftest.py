"""Shared fixtures: one private redis-server per test session, flushed before each test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from tests.procs import redis_server


@pytest.fixture(scope="session")
def redis_url_session() -> Iterator[str]:
    with redis_server() as (url, _port, _proc):
        yield url


@pytest.fixture
async def redis_url(redis_url_session: str) -> AsyncIterator[str]:
    """The session's redis-server, emptied for this test."""
    client = aioredis.from_url(redis_url_session)
    await client.flushall()
    await client.aclose()
    yield redis_url_session
