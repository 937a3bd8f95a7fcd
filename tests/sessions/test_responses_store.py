"""The response store seam: one contract for Redis and the in-process store (TTL, replace,
atomic delete), and the record's seal (an HMAC bound to its key)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sessions import connect
from sessions.keys import response_key
from sessions.responses_store import (
    MemoryResponseStore,
    RedisResponseStore,
    ResponseStore,
    StoredResponse,
    seal,
    unseal,
)
from sessions.store import StoreError
from tests.sessions.conftest import FakeClock

RECORD = StoredResponse(
    id="resp_1",
    response={"id": "resp_1", "object": "response", "status": "completed", "output": []},
    input=[{"role": "user", "content": "hi"}],
    conversation="h-abc",
    turn=1,
)
SECRETS = ("first-secret-0123456789", "older-secret-0123456789")


@pytest.fixture(params=["memory", "redis"])
async def store(
    request: pytest.FixtureRequest, clock: FakeClock, redis_url_session: str
) -> AsyncIterator[ResponseStore]:
    if request.param == "memory":
        yield MemoryResponseStore(clock)
        return
    client = connect.connect(redis_url_session, socket_timeout=1.0, connect_timeout=1.0)
    try:
        yield RedisResponseStore(client, timeout=1.0)
    finally:
        await client.delete(response_key("t1", "resp_1"))
        await connect.close(client)


async def test_put_get_replace_delete(store: ResponseStore) -> None:
    key = response_key("t1", "resp_1")
    assert await store.get(key) is None
    await store.put(key, b"one", 60)
    await store.put(key, b"two", 60)
    assert await store.get(key) == b"two"
    assert await store.get(response_key("t2", "resp_1")) is None  # another tenant's key
    assert await store.delete(key) == b"two"
    assert await store.delete(key) is None
    assert await store.get(key) is None


async def test_memory_store_expires_by_its_clock(clock: FakeClock) -> None:
    store = MemoryResponseStore(clock)
    await store.put("k", b"v", 10)
    clock.advance(9.9)
    assert await store.get("k") == b"v"
    clock.advance(0.1)
    assert await store.get("k") is None and len(store) == 0


async def test_memory_store_drops_the_oldest_past_its_bounds(clock: FakeClock) -> None:
    store = MemoryResponseStore(clock, max_entries=2, max_bytes=10)
    for key in ("a", "b", "c"):
        await store.put(key, b"xx", 60)
    assert [await store.get(k) for k in "abc"] == [None, b"xx", b"xx"]
    await store.put("d", b"x" * 9, 60)  # 13 bytes in all: c and b go
    assert [await store.get(k) for k in "bcd"] == [None, None, b"x" * 9]


async def test_redis_ttl_is_set(redis_url: str) -> None:
    client = connect.connect(redis_url, socket_timeout=1.0, connect_timeout=1.0)
    store = RedisResponseStore(client, timeout=1.0)
    await store.put("kvbaton:resp:{t:r}", b"v", 2.5)
    assert 2000 < await client.pttl("kvbaton:resp:{t:r}") <= 2500
    await connect.close(client)


async def test_an_unreachable_redis_is_a_store_error() -> None:
    client = connect.connect("redis://127.0.0.1:1/0", socket_timeout=0.2, connect_timeout=0.2)
    store = RedisResponseStore(client, timeout=0.5)
    with pytest.raises(StoreError, match="storing a Responses API response"):
        await store.put("k", b"v", 1)
    await connect.close(client)


def test_a_sealed_record_opens_with_any_secret_bound_to_its_key() -> None:
    key = response_key("t1", "resp_1")
    value = seal(SECRETS, key, RECORD)
    assert unseal(SECRETS, key, value) == RECORD
    assert unseal(SECRETS[1:], key, seal(SECRETS[1:], key, RECORD)) == RECORD
    assert unseal(("rotated-in-0123456789", *SECRETS), key, value) == RECORD
    assert unseal(SECRETS, response_key("t2", "resp_1"), value) is None  # another tenant
    assert unseal(("another-secret-01234567",), key, value) is None
    tampered = value.replace(b'"hi"', b'"ho"')
    assert tampered != value and unseal(SECRETS, key, tampered) is None
    assert unseal(SECRETS, key, b"- " + value.partition(b" ")[2]) is None  # unsigned copy


def test_unsigned_records_and_garbage() -> None:
    key = response_key("t1", "resp_1")
    value = seal((), key, RECORD)
    assert value.startswith(b"- ") and unseal((), key, value) == RECORD
    for junk in (b"", b"- ", b"- {", b"- []", b'- {"id": 1}'):
        assert unseal((), key, junk) is None


@pytest.mark.parametrize(("tenant", "rid"), [("a{b", "r"), ("t", "r}x"), ("t", "{r")])
def test_response_keys_refuse_braces(tenant: str, rid: str) -> None:
    with pytest.raises(ValueError, match="braces"):
        response_key(tenant, rid)
