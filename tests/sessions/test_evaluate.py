"""sessions.evaluate against a real redis-server: the same replies and errors as redis-py's
Script, a script the server lost loaded again, a broken connection retried once, a cancelled
call leaving no reply behind for the next one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis import exceptions as redis_exceptions
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from harness.waiting import timeout_scale
from sessions import connect
from sessions.evaluate import evaluate, pool_of
from sessions.redis_store import turn_retry

ECHO = "return {KEYS[1], ARGV[1], ARGV[2]}"
# Busy for ~200 ms inside the server (scripts cannot sleep), then answers.
SLOW = """
local start = redis.call('TIME')
while true do
  local now = redis.call('TIME')
  if (now[1] - start[1]) * 1000000 + (now[2] - start[2]) > 200000 then break end
end
return ARGV[1]
"""


@pytest.fixture
async def client(redis_url_session: str) -> AsyncIterator[aioredis.Redis]:
    # As the router opens it (sessions/backend.py): its retry policy is the turn's.
    c = connect.connect(redis_url_session, socket_timeout=5, connect_timeout=5, retry=turn_retry())
    assert isinstance(c, aioredis.Redis)
    yield c
    await connect.close(c)


async def test_the_same_reply_as_redis_pys_script(client: aioredis.Redis) -> None:
    pool = pool_of(client)
    assert pool is not None
    script = client.register_script(ECHO)
    via_redis_py = await script(keys=["k"], args=["a", 7])
    assert await evaluate(pool, script, ["k"], ["a", 7]) == via_redis_py == [b"k", b"a", b"7"]
    assert await evaluate(None, script, ["k"], ["a", 7]) == via_redis_py  # no pool: redis-py
    assert not pool._in_use_connections and not pool._slots.locked()


async def test_a_script_the_server_lost_is_loaded_again(client: aioredis.Redis) -> None:
    script = client.register_script("return 'fresh-" + "x" * 8 + "'")
    await client.script_flush()
    assert not (await client.script_exists(script.sha))[0]
    assert await evaluate(pool_of(client), script, ["k"], []) == b"fresh-xxxxxxxx"
    assert (await client.script_exists(script.sha))[0]


async def test_an_error_reply_is_raised_and_the_connection_kept(client: aioredis.Redis) -> None:
    pool = pool_of(client)
    await client.set("kvbaton-test:evaluate:string", "x")
    script = client.register_script("return redis.call('HGETALL', KEYS[1])")
    with pytest.raises(ResponseError, match="WRONGTYPE"):
        await evaluate(pool, script, ["kvbaton-test:evaluate:string"], [])
    assert pool is not None and len(pool._available_connections) == 1
    assert await evaluate(pool, client.register_script(ECHO), ["k"], ["b", "c"]) == [
        b"k",
        b"b",
        b"c",
    ]


async def test_a_broken_connection_is_retried_once(
    client: aioredis.Redis, redis_url_session: str
) -> None:
    pool = pool_of(client)
    assert pool is not None
    script = client.register_script(ECHO)
    await evaluate(pool, script, ["k"], ["a", "b"])
    (idle,) = pool._available_connections
    await idle.send_command("CLIENT", "ID")
    idle_id = await idle.read_response()
    # The server closes the idle pooled connection (as a restart or its idle timeout would);
    # the client does not know until it uses it.
    other = aioredis.from_url(redis_url_session)
    try:
        assert await other.execute_command("CLIENT", "KILL", "ID", idle_id) == 1
    finally:
        await other.aclose()
    assert await evaluate(pool, script, ["k"], ["a", "b"]) == [b"k", b"a", b"b"]
    assert pool._available_connections == [idle]  # the same connection, connected again


@pytest.mark.parametrize(
    ("retry", "tries"),
    [(turn_retry(), 2), (Retry(NoBackoff(), 2, supported_errors=(RedisConnectionError,)), 3)],
    ids=["turn_retry", "two-retries"],
)
async def test_a_server_that_drops_the_script_is_tried_as_the_client_retries(
    retry: Retry, tries: int
) -> None:
    # A server that answers the connection's set-up commands and hangs up on the EVALSHA (as
    # a Redis going down mid-command): the script is sent as often as the client's retry
    # policy says (the router's, turn_retry: once more), each time on a connection made
    # again, then the call fails; its slot is back.
    evals = 0

    async def drop_scripts(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal evals
        while data := await reader.read(65536):
            if b"EVALSHA" in data:
                evals += 1
                break
            if b"HELLO" in data:  # redis-py speaks RESP3: HELLO 3 wants a map back
                writer.write(b"%1\r\n$5\r\nproto\r\n:3\r\n")
            else:
                writer.write(b"+OK\r\n" * (data.count(b"\r\n*") + data.startswith(b"*")))
        writer.close()

    server = await asyncio.start_server(drop_scripts, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = connect.BoundedPool.from_url(
        f"redis://127.0.0.1:{port}", max_connections=2, timeout=1, retry=retry
    )
    client = aioredis.Redis.from_pool(pool)
    try:
        with pytest.raises(RedisConnectionError):
            await evaluate(pool, client.register_script(ECHO), ["k"], ["a", "b"])
        assert evals == tries
        assert not pool._in_use_connections and pool._slots._value == 2  # the slot is back
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


# Busy for ARGV[2] microseconds, then ARGV[1].
BUSY = SLOW.replace("> 200000", "> tonumber(ARGV[2])")


async def test_a_cancelled_call_leaves_no_reply_for_the_next(client: aioredis.Redis) -> None:
    pool = pool_of(client)
    busy, echo = client.register_script(BUSY), client.register_script(ECHO)
    await evaluate(pool, echo, ["k"], ["warm", "up"])
    await evaluate(pool, busy, ["k"], ["loaded", "0"])  # the script cached: one EVALSHA below
    # Busy long enough that a loaded machine's event loop cancels it before its reply.
    micros = int(200_000 * timeout_scale())
    call = asyncio.create_task(evaluate(pool, busy, ["k"], ["late", str(micros)]))
    await asyncio.sleep(0.05)  # sent; the server is busy with it
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # The next call on the same pool gets its own reply, not the slow script's "late".
    assert await evaluate(pool, echo, ["k"], ["next", "one"]) == [b"k", b"next", b"one"]
    assert pool is not None and not pool._in_use_connections and pool._slots._value > 0


async def test_concurrent_calls_stay_within_the_pools_bound(redis_url_session: str) -> None:
    # 30 calls at once through 3 connections: the first 3 take free slots (or make their
    # connections), the others wait for one to come back; none fails, none goes past the bound.
    pool = connect.BoundedPool.from_url(redis_url_session, max_connections=3, timeout=10)
    client = aioredis.Redis.from_pool(pool)
    try:
        slow, echo = client.register_script(SLOW), client.register_script(ECHO)
        await evaluate(pool, echo, ["k"], ["warm", "up"])  # one idle connection: the fast path
        seen: list[int] = []

        async def call(i: int) -> Any:
            reply = await evaluate(pool, slow if i % 10 == 0 else echo, ["k"], [str(i), "x"])
            seen.append(len(pool._in_use_connections))
            return reply

        replies = await asyncio.gather(*(call(i) for i in range(30)))
        assert [r if isinstance(r, bytes) else r[1] for r in replies] == [
            str(i).encode() for i in range(30)
        ]
        assert max(seen) <= 3 and len(pool._available_connections) <= 3
        assert not pool._in_use_connections and pool._slots._value == 3
    finally:
        await client.aclose()


async def test_the_callers_deadline_bounds_a_call_not_the_socket_timeout(
    redis_url_session: str,
) -> None:
    # A 50 ms socket timeout does not cut the 200 ms script (the store's asyncio.timeout
    # bounds its calls as a whole); the connection has its socket timeout back after, for the
    # commands that go through redis-py.
    client = connect.connect(redis_url_session, socket_timeout=0.05, connect_timeout=5)
    assert isinstance(client, aioredis.Redis)
    pool = pool_of(client)
    assert pool is not None
    try:
        slow = client.register_script(SLOW)
        assert await evaluate(pool, slow, ["k"], ["slow", "x"]) == b"slow"
        (connection,) = pool._available_connections
        assert connection.socket_timeout == 0.05
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.05):
                await evaluate(pool, slow, ["k"], ["cut", "x"])
        assert all(c.socket_timeout == 0.05 for c in pool._available_connections)
        with pytest.raises(redis_exceptions.TimeoutError):  # redis-py's own commands: bounded
            await client.eval(SLOW, 1, "k", "late", "x")
    finally:
        await connect.close(client)
