"""What only the Redis store has: the readable key layout, failures as StoreError, scripts."""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from harness.procs import free_port, redis_server, restart_redis, stop
from sessions.codec import to_fields
from sessions.guard import StoreGuard
from sessions.keys import (
    STORE_RUN_KEY,
    conversation_key,
    pin_blocks_key,
    pin_held_key,
    pin_sizes_key,
    pins_key,
)
from sessions.model import PinSize, PinTotals, SessionState
from sessions.redis_store import RedisSessionStore
from sessions.store import CorruptState, StoreError

KEY = conversation_key("tenant-a", "conv-1")
STATE = SessionState(
    turn=1,
    api="chat",
    decode="http://d1:8000",
    decode_engine_id="d-engine-1",
    kv_transfer_params={"remote_engine_id": "d-engine-1", "remote_num_tokens": 40},
    token_count=40,
    created_at=1_732_934_400.0,
    updated_at=1_732_934_400.0,
)


@pytest.fixture
async def store(redis_url: str) -> AsyncIterator[RedisSessionStore]:
    s = RedisSessionStore(redis_url)
    yield s
    await s.close()


@pytest.fixture
async def raw(redis_url: str) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_url, decode_responses=True)
    yield client
    await client.aclose()


async def test_hash_is_readable_with_redis_cli(
    store: RedisSessionStore, raw: aioredis.Redis
) -> None:
    await store.commit(KEY, STATE, 0, 450.0)
    assert await raw.keys("kvbaton:conv:*") == ["kvbaton:conv:{tenant-a:conv-1}"]
    assert await raw.type(KEY) == "hash"
    assert 0 < await raw.ttl(KEY) <= 450
    fields = await raw.hgetall(KEY)
    assert fields["turn"] == "1"
    assert fields["decode"] == "http://d1:8000"
    assert fields["decode_engine_id"] == "d-engine-1"
    assert json.loads(fields["kv_transfer_params"]) == STATE.kv_transfer_params
    assert fields["token_count"] == "40"
    assert fields["created"] == "2024-11-30T02:40:00.000+00:00"
    assert fields["updated_at"] == "1732934400.0"
    assert list(fields)[:2] == ["turn", "api"]  # HGETALL keeps the documented order


async def test_fields_survive_the_scripts_json_byte_for_byte(
    store: RedisSessionStore, raw: aioredis.Redis
) -> None:
    """The commit sends its fields as one JSON array that the Lua script decodes (cjson):
    quotes, backslashes, control characters and non-ASCII text arrive unchanged, and the
    state reads back equal."""
    odd = 'q"uote \\ back\nnew\tline \u00e9t\u00e9 \u6f22 \U0001f600 \x01'
    state = msgspec.structs.replace(
        STATE,
        prefill=f"http://p/{odd}",
        no_handle_reason=odd,
        kv_transfer_params={"remote_engine_id": odd, "remote_num_tokens": 40, "x": [1.5, None]},
    )
    assert await store.commit(KEY, state, 0, 450.0)
    assert await raw.hgetall(KEY) == to_fields(state)
    assert await store.get(KEY) == state


def store_calls(store: RedisSessionStore) -> list[Callable[[], Awaitable[Any]]]:
    return [
        lambda: store.claim(KEY, "req-1"),
        lambda: store.commit(KEY, STATE, 0, 450.0),
        lambda: store.release(KEY, "req-1"),
        lambda: store.get(KEY),
        lambda: store.delete(KEY),
        store.ping,
        lambda: store.take_handle(KEY, math.inf),
        lambda: store.end(KEY),
        lambda: store.note_pin("http://d1:8000", KEY, 1.0, 450.0),
        lambda: store.forget_pin("http://d1:8000", KEY),
        lambda: store.pins_due("http://d1:8000", math.inf, 10),
        lambda: store.pin_totals("http://d1:8000"),
    ]


CALLS = 12


@pytest.mark.parametrize("method", range(CALLS))
async def test_dead_redis_raises_store_error_fast(method: int) -> None:
    store = RedisSessionStore(f"redis://127.0.0.1:{free_port()}/0")
    started = time.monotonic()
    with pytest.raises(StoreError):
        await store_calls(store)[method]()
    assert time.monotonic() - started < 1.0
    await store.close()


async def _silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """A server that accepts and never answers: a Redis too slow to be useful."""
    await reader.read()
    writer.close()


@pytest.mark.parametrize("method", range(CALLS))
async def test_stalled_redis_raises_store_error_fast(method: int) -> None:
    server = await asyncio.start_server(_silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    store = RedisSessionStore(f"redis://127.0.0.1:{port}/0", timeout=0.1)
    started = time.monotonic()
    with pytest.raises(StoreError):
        await store_calls(store)[method]()
    assert time.monotonic() - started < 1.0
    await store.close()
    server.close()
    await server.wait_closed()


@pytest.mark.parametrize(
    "garbage",
    [
        {"turn": "not-a-number", "api": "chat"},
        {"api": "chat"},
        {"turn": "1", "kv_transfer_params": "{oops"},
        {"turn": "1", "created_at": "yesterday"},
    ],
)
async def test_garbage_hash_is_that_conversation_s_corrupt_state(
    store: RedisSessionStore, raw: aioredis.Redis, garbage: dict[str, str]
) -> None:
    await raw.hset(KEY, mapping=dict(garbage.items()))
    with pytest.raises(CorruptState, match="get"):
        await store.get(KEY)
    assert await raw.exists(KEY), "a read leaves it (the admin API shows what is there)"
    with pytest.raises(CorruptState, match="claim"):
        await store.claim(KEY, "req-1")
    # The claim dropped the key: the conversation's turn commits a good state afresh instead
    # of failing on it until the TTL.
    assert not await raw.exists(KEY)
    assert await store.commit(KEY, STATE, 0, 450.0) is True
    assert await store.get(KEY) == STATE


async def test_a_garbage_hash_whose_handle_is_taken_is_dropped(
    store: RedisSessionStore, raw: aioredis.Redis
) -> None:
    """take_handle and end raise CorruptState, as get does, and leave no key behind: the
    script changed it already, and its handle cannot be read to be released."""
    garbage = {"turn": "1", "kv_transfer_params": "{oops"}
    await raw.hset(KEY, mapping=garbage)
    assert await store.take_handle(KEY, 1e12) is None  # no readable updated_at: not due
    assert await raw.hgetall(KEY) == garbage  # and untouched
    with pytest.raises(CorruptState, match="take handle"):
        await store.take_handle(KEY, math.inf)
    assert not await raw.exists(KEY)
    # Another garbage handle: the one taken above is spent, and would come back without it.
    await raw.hset(KEY, mapping={**garbage, "kv_transfer_params": "{oops, again"})
    with pytest.raises(CorruptState, match="end"):
        await store.end(KEY)
    assert not await raw.exists(KEY)


async def test_a_garbage_hash_without_a_handle_is_left_to_the_claim(
    store: RedisSessionStore, raw: aioredis.Redis
) -> None:
    await raw.hset(KEY, mapping={"turn": "not-a-number"})
    assert await store.take_handle(KEY, math.inf) is None
    assert await raw.hgetall(KEY) == {"turn": "not-a-number"}


async def test_a_key_of_another_type_is_corrupt_state_and_dropped(
    store: RedisSessionStore, raw: aioredis.Redis
) -> None:
    await raw.set(KEY, "a string, not a hash")
    for call in [store_calls(store)[i] for i in (1, 2, 3)]:  # commit, release, get
        with pytest.raises(CorruptState, match="WRONGTYPE"):
            await call()
    with pytest.raises(CorruptState, match="WRONGTYPE"):
        await store.claim(KEY, "req-1")
    assert not await raw.exists(KEY)


@pytest.mark.parametrize("call", [6, 7])  # take_handle, end
async def test_a_key_of_another_type_is_dropped_by_take_handle_and_end(
    store: RedisSessionStore, raw: aioredis.Redis, call: int
) -> None:
    await raw.set(KEY, "a string, not a hash")
    with pytest.raises(CorruptState, match="WRONGTYPE"):
        await store_calls(store)[call]()
    assert not await raw.exists(KEY)


async def test_the_pin_index_is_readable_with_redis_cli(
    store: RedisSessionStore, raw: aioredis.Redis
) -> None:
    decode, other = "http://10.0.0.21:8200", "kvbaton:conv:{t:b}"
    await store.note_pin(decode, KEY, 1_732_934_400.125, 480.0, PinSize(3, 40, "0:7 0:8 0:9"))
    await store.note_pin(decode, other, 1_732_934_399.5, 60.0, PinSize(2, 20, "0:7 0:12"))
    assert sorted(await raw.keys("kvbaton:pins:*")) == [
        "kvbaton:pins:{http://10.0.0.21:8200}",
        "kvbaton:pins:{http://10.0.0.21:8200}:blocks",
        "kvbaton:pins:{http://10.0.0.21:8200}:held",
        "kvbaton:pins:{http://10.0.0.21:8200}:sizes",
    ]
    assert await raw.type(pins_key(decode)) == "zset"
    assert await raw.zrange(pins_key(decode), 0, -1, withscores=True) == [
        (other, 1_732_934_399.5),
        (KEY, 1_732_934_400.125),
    ]
    assert await raw.hgetall(pin_sizes_key(decode)) == {KEY: "3 40", other: "2 20"}
    assert await raw.hgetall(pin_held_key(decode)) == {KEY: "0:7 0:8 0:9", other: "0:7 0:12"}
    blocks = {"0:7": "2", "0:8": "1", "0:9": "1", "0:12": "1"}
    assert await raw.hgetall(pin_blocks_key(decode)) == blocks
    assert await raw.hlen(pin_blocks_key(decode)) == 4  # D's distinct pinned blocks
    keys = (pins_key(decode), pin_sizes_key(decode), pin_held_key(decode), pin_blocks_key(decode))
    for key in keys:
        assert 470 < await raw.ttl(key) <= 480
    await store.forget_pin(decode, KEY)
    await store.forget_pin(decode, other)
    assert await raw.keys("kvbaton:pins:*") == []  # the last one out takes all four along


# What a router before the blocks keys wrote for a member: its size, no blocks.
async def _old_note(raw: aioredis.Redis, decode: str, member: str, at: float, size: str) -> None:
    await raw.zadd(pins_key(decode), {member: at})
    await raw.hset(pin_sizes_key(decode), member, size)


async def test_entries_of_an_older_router_read_and_forget_cleanly(
    store: RedisSessionStore, raw: aioredis.Redis
) -> None:
    """A size without blocks counts as a handle and in the handles' sums, not in D's distinct
    blocks (which blocks it pins is unknown); it is forgotten or replaced like any other."""
    decode, other = "http://d1:8000", conversation_key("t", "old")
    await _old_note(raw, decode, other, 1.0, "33 521")
    await store.note_pin(decode, KEY, 2.0, 60.0, PinSize(2, 30, "0:1 0:2"))
    assert await store.pin_totals(decode) == PinTotals(2, 2, 35, 551)
    await store.note_pin(decode, other, 3.0, 60.0, PinSize(2, 30, "0:2 0:3"))  # replaced
    assert await store.pin_totals(decode) == PinTotals(2, 3, 4, 60)
    await _old_note(raw, decode, KEY, 4.0, "5 70")  # an older router notes its next handle
    await store.forget_pin(decode, other)
    # KEY's former blocks stay counted until a router that knows them notes or forgets it.
    assert await store.pin_totals(decode) == PinTotals(1, 2, 5, 70)
    await store.forget_pin(decode, KEY)
    assert await store.pin_totals(decode) == PinTotals()
    assert await raw.keys("kvbaton:pins:*") == []


async def test_blocks_an_older_router_left_for_no_member_are_dropped(
    store: RedisSessionStore, raw: aioredis.Redis
) -> None:
    """An older router forgets a member without taking back its blocks: once D's index is
    empty, what is beside it belongs to nobody, and the next note starts afresh."""
    decode = "http://d1:8000"
    await store.note_pin(decode, KEY, 1.0, 60.0, PinSize(2, 30, "0:1 0:2"))
    await raw.hdel(pin_sizes_key(decode), KEY)  # the older router's forget
    await raw.zrem(pins_key(decode), KEY)
    other = conversation_key("t", "new")
    await store.note_pin(decode, other, 2.0, 60.0, PinSize(1, 16, "0:9"))
    assert await store.pin_totals(decode) == PinTotals(1, 1, 1, 16)
    assert await raw.hgetall(pin_held_key(decode)) == {other: "0:9"}


async def test_a_long_handle_is_counted_in_parts(
    store: RedisSessionStore, raw: aioredis.Redis
) -> None:
    """20,000 blocks (320k tokens): more than Lua unpacks at once, written 512 at a time."""
    decode, other = "http://d1:8000", conversation_key("t", "long")
    names = [f"0:{i}" for i in range(20_000)]
    await store.note_pin(decode, KEY, 1.0, 60.0, PinSize(20_000, 320_000, " ".join(names)))
    middle = " ".join(names[5_000:15_000])
    await store.note_pin(decode, other, 2.0, 60.0, PinSize(10_000, 1, middle))
    assert await store.pin_totals(decode) == PinTotals(2, 20_000, 30_000, 320_001)
    await store.note_pin(decode, KEY, 3.0, 60.0, PinSize(10_000, 1, " ".join(names[10_000:])))
    assert await store.pin_totals(decode) == PinTotals(2, 15_000, 20_000, 2)
    assert await raw.hget(pin_blocks_key(decode), "0:12000") == "2"
    await store.forget_pin(decode, KEY)
    assert await store.pin_totals(decode) == PinTotals(1, 10_000, 10_000, 1)


async def test_a_pin_index_without_expiry_gets_one(
    store: RedisSessionStore, raw: aioredis.Redis
) -> None:
    await raw.zadd(pins_key("http://d1:8000"), {"kvbaton:conv:{t:old}": 1.0})  # no TTL
    await store.note_pin("http://d1:8000", KEY, 2.0, 60.0)
    assert 50 < await raw.ttl(pins_key("http://d1:8000")) <= 60


async def test_release_and_end_are_one_round_trip_each(
    store: RedisSessionStore, raw: aioredis.Redis
) -> None:
    await store.commit(KEY, STATE, 0, 450.0)
    await store.take_handle(KEY, 0.0)  # not due: loads the script, changes nothing
    await store.end(conversation_key("t", "none"))
    await store.note_pin("http://d1:8000", KEY, 1.0, 450.0)
    await raw.config_resetstat()
    assert await store.take_handle(KEY, math.inf) == STATE
    assert await store.end(KEY) is not None
    await store.note_pin("http://d1:8000", KEY, 2.0, 450.0)
    stats = await raw.info("commandstats")
    calls = {name: s["calls"] for name, s in stats.items() if name != "cmdstat_config"}
    assert calls.get("cmdstat_evalsha") == 3
    assert "cmdstat_eval" not in calls and "cmdstat_script|load" not in calls


async def test_corrupt_state_never_opens_the_breaker(
    store: RedisSessionStore, raw: aioredis.Redis
) -> None:
    guard = StoreGuard(retry_after=60.0)
    await raw.hset(KEY, mapping={"turn": "abc"})
    with pytest.raises(CorruptState):
        await guard.call(lambda: store.claim(KEY, "req-1"))
    assert not guard.is_open and guard.failures == 0
    assert await guard.call(lambda: store.claim(KEY, "req-2")) is None  # dropped: no session


async def test_scripts_survive_script_flush(store: RedisSessionStore, raw: aioredis.Redis) -> None:
    await store.commit(KEY, STATE, 0, 450.0)
    await raw.script_flush()  # NOSCRIPT on the next EVALSHA: redis-py loads and retries
    claimed = await store.claim(KEY, "req-1")
    assert claimed == STATE
    await raw.script_flush()
    await store.release(KEY, "req-1")
    await raw.script_flush()
    assert await store.commit(KEY, STATE, 0, 450.0) is False
    await raw.script_flush()
    assert await store.commit(KEY, STATE, 1, 450.0) is True


async def test_claim_is_one_round_trip(store: RedisSessionStore, raw: aioredis.Redis) -> None:
    await store.commit(KEY, STATE, 0, 450.0)
    await store.claim(KEY, "warm-up")  # EVALSHA may have needed a SCRIPT LOAD once
    await raw.config_resetstat()
    await store.claim(KEY, "req-1")
    await store.commit(KEY, STATE, 1, 450.0)
    stats = await raw.info("commandstats")
    calls = {name: s["calls"] for name, s in stats.items() if name != "cmdstat_config"}
    assert calls.get("cmdstat_evalsha") == 2
    assert "cmdstat_eval" not in calls and "cmdstat_script|load" not in calls


async def test_injected_client_is_left_open(redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    store = RedisSessionStore(redis_url, client=client)
    await store.ping()
    await store.close()
    assert await client.ping() is True
    await client.aclose()


async def test_the_store_follows_the_server_s_run_id(caplog: pytest.LogCaptureFixture) -> None:
    """A first server is trusted (since 0), and so is one that comes back empty (nothing of
    before to doubt); one that comes back with its data (an RDB: older than what the routers
    did since) moves `history_since` to when it was first seen, for every store of every
    replica, and says so once each."""
    with redis_server() as (url, port, proc):
        first, second = RedisSessionStore(url), RedisSessionStore(url)
        raw = aioredis.Redis.from_url(url, decode_responses=True)
        try:
            await first.ping()
            await second.ping()
            assert first.history_since == second.history_since == 0.0
            assert (await raw.hgetall(STORE_RUN_KEY))["since"] == "0"
            directory = (await raw.config_get("dir"))["dir"]
            await raw.save()
            stop(proc)
            before = time.time()
            proc = restart_redis(port, directory)  # the snapshot, with the old run id
            with caplog.at_level("WARNING", logger="kvbaton.store"):
                await first.ping()  # reconnected: the new connection reads the run id
                await second.ping()
            assert before <= first.history_since == second.history_since <= time.time()
            assert caplog.text.count("the session store's server changed") == 2
            stop(proc)
            proc = restart_redis(port)  # empty this time
            await first.ping()
            assert first.history_since == second.history_since, "nothing of before to doubt"
        finally:
            await first.close()
            await second.close()
            await raw.aclose()
            stop(proc)


async def test_a_server_that_refuses_info_is_used_all_the_same(
    redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    raw = aioredis.Redis.from_url(redis_url)
    await raw.acl_setuser(
        "noinfo", enabled=True, passwords=["+pw"], commands=["+@all", "-info"], keys=["*"]
    )
    url = redis_url.replace("redis://", "redis://noinfo:pw@")
    store = RedisSessionStore(url)
    try:
        with caplog.at_level("WARNING", logger="kvbaton.store"):
            await store.commit(KEY, STATE, 0, 60)
            assert await store.claim(KEY, "r1") == STATE
        assert store.history_since == 0.0
        assert "the session store's history cannot be followed" in caplog.text
    finally:
        await store.close()
        await raw.acl_deluser("noinfo")
        await raw.aclose()


async def test_turn_times_read_a_key_of_another_type_as_none(
    store: RedisSessionStore, raw: aioredis.Redis
) -> None:
    await store.commit(KEY, STATE, 0, 450.0)
    other = conversation_key("tenant-a", "not-a-hash")
    await raw.set(other, "a string, not a hash")
    garbage = conversation_key("tenant-a", "garbage")
    await raw.hset(garbage, mapping={"turn": "x", "created_at": "1.0"})
    times = await store.turn_times([other, KEY, garbage])
    assert times[0] is None and times[2] is None
    assert times[1] is not None and times[1].turn == 1
    assert await raw.get(other) == "a string, not a hash"  # read, never dropped
