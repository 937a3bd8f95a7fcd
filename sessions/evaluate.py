"""The turn's own scripts (the claim, the commit) run as one EVALSHA on a pooled connection,
without redis-py's per-command machinery where the client allows it.

redis-py's `Script.__call__` goes through `execute_command`: a retry object, observability
hooks, the pool's lock and checks, a response-callback look-up. On a single server
(connect.BoundedPool) `evaluate` sends the packed EVALSHA on a connection from `take()` and
reads its reply, with what the turn needs of the rest kept: one immediate retry on a broken
connection (as sessions.redis_store.turn_retry), a script the server does not know loaded on
that connection and run again, and a reply that is an error raised as redis-py raises it.
Cluster and Sentinel clients run the script through redis-py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from sessions.connect import BoundedPool, RedisClient

Arg = int | float | bytes | str


def pool_of(client: RedisClient) -> BoundedPool | None:
    pool = getattr(client, "connection_pool", None)
    return pool if isinstance(pool, BoundedPool) else None


async def evaluate(
    pool: BoundedPool | None, script: AsyncScript, keys: Sequence[str], args: Sequence[Arg]
) -> Any:
    """`script(keys=keys, args=args)`, on `pool`'s connections directly when there is one."""
    if pool is None:
        return await script(keys=keys, args=args)
    connection = await pool.take()
    try:
        packed = connection.pack_command("EVALSHA", script.sha, len(keys), *keys, *args)
        retried = loaded = False
        while True:
            try:
                # redis-py drops the connection on any failure here (its reply unread), so
                # the retry and the next command reconnect it.
                await connection.send_packed_command(packed, check_health=False)
                return await connection.read_response()
            except NoScriptError:
                if loaded:
                    raise
                loaded = True
                await connection.send_command("SCRIPT", "LOAD", script.script, check_health=False)
                await connection.read_response()
            except RedisConnectionError:
                if retried:
                    raise
                retried = True
    finally:
        pool.give(connection)
