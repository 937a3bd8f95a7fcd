"""The turn's own scripts (the claim, the commit) run as one EVALSHA on a pooled connection,
without redis-py's per-command machinery where the client allows it.

redis-py's `Script.__call__` goes through `execute_command`: a retry object, observability
hooks, the pool's lock and checks, a response-callback look-up. On a single server
(connect.BoundedPool) `evaluate` sends the packed EVALSHA on a connection from `take()` and
reads its reply, with what the turn needs of the rest kept: the client's retry policy on a
broken connection (sessions.redis_store.turn_retry: one, at once), a script the server does
not know loaded on that connection and run again, and a reply that is an error raised as
redis-py raises it. Cluster and Sentinel clients run the script through redis-py.

The caller bounds the whole call in time (sessions.redis_store runs each one under
asyncio.timeout): while `evaluate` holds a connection, redis-py's socket timeout is off on
it, since with one redis-py wraps each write in asyncio.wait_for, a task of its own per
command and two more turns of the event loop before the reply is read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

from sessions.connect import BoundedPool, RedisClient

Arg = int | float | bytes | str


def pool_of(client: RedisClient) -> BoundedPool | None:
    pool = getattr(client, "connection_pool", None)
    return pool if isinstance(pool, BoundedPool) else None


async def evaluate(
    pool: BoundedPool | None, script: AsyncScript, keys: Sequence[str], args: Sequence[Arg]
) -> Any:
    """`script(keys=keys, args=args)`, on `pool`'s connections directly when there is one;
    the caller bounds it in time."""
    if pool is None:
        return await script(keys=keys, args=args)
    connection = await pool.take()
    socket_timeout = connection.socket_timeout
    connection.socket_timeout = None  # the caller's deadline bounds the call (see above)
    try:
        packed = connection.pack_command("EVALSHA", script.sha, len(keys), *keys, *args)
        # The client's own retry policy (sessions.redis_store.turn_retry: once, at once, on a
        # broken connection); redis-py drops the connection on any failure here (its reply
        # unread), so the retry and the next command reconnect it.
        return await connection.retry.call_with_retry(
            lambda: _run(connection, packed, script), _no_cleanup
        )
    finally:
        if connection.socket_timeout is None:  # unless redis-py set one meanwhile (relaxed
            connection.socket_timeout = socket_timeout  # for a server's maintenance, RESP3)
        pool.give(connection)


async def _run(connection: Any, packed: Any, script: AsyncScript) -> Any:
    """One EVALSHA and its reply; a script the server does not know is loaded on this
    connection and run once more."""
    await connection.send_packed_command(packed, check_health=False)
    try:
        return await connection.read_response()
    except NoScriptError:
        await connection.send_command("SCRIPT", "LOAD", script.script, check_health=False)
        await connection.read_response()
        await connection.send_packed_command(packed, check_health=False)
        return await connection.read_response()


async def _no_cleanup(error: Exception) -> None:
    """Nothing to undo between tries: redis-py has already dropped the broken connection."""
