"""The Redis session store: one HASH per conversation, claim and commit as single Lua scripts
(sessions/scripts.py), and one ZSET per decode instance indexing its live handles.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import msgspec
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from sessions import connect, scripts
from sessions.codec import StateDecodeError, from_fields, to_fields
from sessions.connect import RedisClient
from sessions.evaluate import evaluate, pool_of
from sessions.failures import failure
from sessions.keys import pin_blocks_key, pin_held_key, pin_sizes_key, pins_key, spent_key
from sessions.model import UNKNOWN_SIZE, PinSize, PinTotals, SessionState, TurnTimes
from sessions.run_watch import RunWatch
from sessions.store import CorruptState, PinNote, StoreError
from sessions.vocabulary import Reason

T = TypeVar("T")

_ENCODE = msgspec.json.Encoder().encode

# TimeoutError (the builtin, which asyncio uses) is an OSError.
_FAILURES = (RedisError, OSError)


def turn_retry() -> Retry:
    """One immediate retry on a broken pooled connection; none on a timeout: a slow Redis must
    not hold up the turn, which proceeds without reuse."""
    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


def _text(value: bytes | str) -> str:
    # A garbage value reads as no `<prefix_len> <id>`: the router ignores it.
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _decode_pairs(reply: Sequence[bytes] | None) -> SessionState | None:
    if not reply:
        return None
    if len(reply) % 2:
        raise StateDecodeError("a script returned an odd number of hash fields and values")
    return from_fields(dict(zip(reply[::2], reply[1::2], strict=True)))


class RedisSessionStore:
    """SessionStore on Redis (or anything speaking its protocol with Lua scripting).

    `url` may name one server, a Redis Cluster or a Sentinel-managed master (sessions.connect).
    Every call is bounded by `timeout` as a whole (waiting for a pooled connection, the retry
    and the reply included), so it may share a client whose socket timeout is longer (the
    process's one client, sessions/backend.py).
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 0.25,
        client: RedisClient | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._owns_client = client is None
        self._clock = clock
        if client is None:
            client = connect.connect(
                url, socket_timeout=timeout, connect_timeout=timeout, retry=turn_retry()
            )
        self._client = client
        self._timeout = timeout
        # redis-py's cluster client, set up by many concurrent first commands, loses
        # connections ("Connection closed by server", measured with 300 at once) and may
        # retry a script that already ran: it is set up once, before the first command.
        self._set_up = not isinstance(client, RedisCluster)
        self._set_up_lock = asyncio.Lock()
        self._pool = pool_of(client)  # the claim's and commit's connections (sessions.evaluate)
        self._claim = client.register_script(scripts.CLAIM)
        self._commit = client.register_script(scripts.COMMIT)
        self._commit_noted = client.register_script(scripts.COMMIT_NOTED)
        self.notes_pins_in_commit = not isinstance(client, RedisCluster)
        self._release = client.register_script(scripts.RELEASE)
        self._take_handle = client.register_script(scripts.TAKE_HANDLE)
        self._end = client.register_script(scripts.END)
        self._note_pin = client.register_script(scripts.NOTE_PIN)
        self._forget_pin = client.register_script(scripts.FORGET_PIN)
        self._pin_totals = client.register_script(scripts.PIN_TOTALS)
        self._spend = client.register_script(scripts.SPEND)
        self._probe = client.register_script(scripts.PROBE)
        # The server's run id, read by each new connection (the first, and every one after a
        # restart or a failover) before its first command; not followed on Redis Cluster.
        self._watch = RunWatch(clock)
        if not isinstance(client, RedisCluster):
            client.connection_pool.connection_kwargs["redis_connect_func"] = self._watch.connected

    @property
    def history_since(self) -> float:
        return self._watch.since

    async def _set_up_cluster(self) -> None:
        async with self._set_up_lock:
            if not self._set_up and isinstance(self._client, RedisCluster):
                await self._client.initialize()
                self._set_up = True

    async def _run(self, what: str, call: Awaitable[T]) -> T:
        try:
            # A timed-out command's connection is dropped, as redis-py drops it on a socket
            # timeout: its reply would otherwise answer the next command.
            async with asyncio.timeout(self._timeout):
                if not self._set_up:
                    try:
                        await self._set_up_cluster()
                    except BaseException:
                        if inspect.iscoroutine(call):
                            call.close()  # never started: no "never awaited" warning
                        raise
                return await call
        except StateDecodeError as exc:
            raise CorruptState(f"session store {what}: not a session state: {exc}") from exc
        except ResponseError as exc:
            if str(exc).startswith("WRONGTYPE"):  # the key holds another type than a HASH
                raise CorruptState(f"session store {what}: {exc}") from exc
            raise failure(what, exc, self._timeout) from exc
        except _FAILURES as exc:
            raise failure(what, exc, self._timeout) from exc

    async def claim(
        self, key: str, request_id: str, expect_prefix: str = ""
    ) -> SessionState | None:
        keys = [key, spent_key(key)]

        async def claim() -> SessionState | None:
            args = [request_id, expect_prefix, repr(self._clock())]
            return _decode_pairs(await evaluate(self._pool, self._claim, keys, args))

        try:
            return await self._run("claim", claim())
        except CorruptState:
            await self._drop(key)
            raise

    async def _taking(
        self, what: str, key: str, call: Callable[[], Awaitable[Any]]
    ) -> SessionState | None:
        """A script that returns the hash as it was; a key that holds no state is dropped."""

        async def run() -> SessionState | None:
            return _decode_pairs(await call())  # called here: never a coroutine left unawaited

        try:
            return await self._run(what, run())
        except CorruptState:
            await self._drop(key)
            raise

    async def take_handle(self, key: str, not_after: float) -> SessionState | None:
        bound = "" if not_after == math.inf else repr(float(not_after))
        args = [bound, str(Reason.RELEASED), repr(self._clock())]
        keys = [key, spent_key(key)]
        return await self._taking("take handle", key, lambda: self._take_handle(keys, args))

    async def end(self, key: str) -> SessionState | None:
        keys, args = [key, spent_key(key)], [repr(self._clock())]
        return await self._taking("end", key, lambda: self._end(keys, args))

    async def spend(self, key: str, handle_id: str, until: float) -> None:
        args = [handle_id, repr(float(until)), repr(self._clock())]
        await self._run("spend", self._spend(keys=[key, spent_key(key)], args=args))

    async def _drop(self, key: str) -> None:
        """Remove a key that holds no state, so the conversation's next turn starts afresh
        (its commit then writes a good state) instead of failing on it until it expires."""
        with contextlib.suppress(StoreError):
            await self._run("delete", self._client.delete(key))

    async def commit(
        self,
        key: str,
        state: SessionState,
        expected_turn: int,
        ttl_s: float,
        pin: PinNote | None = None,
    ) -> bool:
        ttl_ms = max(1, math.ceil(ttl_s * 1000))
        pairs = [x for item in to_fields(state).items() for x in item]
        args: list[int | bytes | str] = [expected_turn, ttl_ms, _ENCODE(pairs)]
        if pin is None or not self.notes_pins_in_commit:
            done = await self._run("commit", evaluate(self._pool, self._commit, [key], args))
            if done and pin is not None:
                await self.note_pin(pin.decode, key, pin.at, ttl_s, pin.size)
            return bool(done)
        args += [repr(float(pin.at)), *_size_args(pin.size)]
        keys = [key, *_pin_keys(pin.decode)]
        noted = evaluate(self._pool, self._commit_noted, keys, args)
        return bool(await self._run("commit", noted))

    async def release(self, key: str, request_id: str) -> None:
        await self._run("release", self._release(keys=[key], args=[request_id]))

    async def find_history(self, keys: Sequence[str]) -> list[str | None]:
        """One MGET; on Redis Cluster the keys' slots differ, so redis-py splits it by node
        (mget_nonatomic: one round trip per node holding some, sent concurrently)."""

        async def mget() -> list[str | None]:
            if not keys:
                return []
            if isinstance(self._client, RedisCluster):
                raw = await self._client.mget_nonatomic(list(keys))
            else:
                raw = await cast(Awaitable[list[bytes | None]], self._client.mget(list(keys)))
            return [None if v is None else _text(v) for v in raw]

        return await self._run("history lookup", mget())

    async def index_history(self, key: str, value: str, ttl_s: float) -> None:
        ttl_ms = max(1, math.ceil(ttl_s * 1000))
        await self._run(
            "history index", cast(Awaitable[Any], self._client.set(key, value, px=ttl_ms))
        )

    async def note_pin(
        self, decode: str, key: str, at: float, ttl_s: float, size: PinSize = UNKNOWN_SIZE
    ) -> None:
        ttl_ms = max(1, math.ceil(ttl_s * 1000))
        args: list[str | int] = [repr(float(at)), key, ttl_ms, *_size_args(size)]
        await self._run("note pin", self._note_pin(keys=_pin_keys(decode), args=args))

    async def forget_pin(self, decode: str, key: str, not_after: float = math.inf) -> None:
        bound = "" if not_after == math.inf else repr(float(not_after))
        forget = self._forget_pin(keys=_pin_keys(decode), args=[key, bound])
        await self._run("forget pin", forget)

    async def pins_due(self, decode: str, before: float, limit: int) -> list[tuple[str, float]]:
        name = pins_key(decode)
        top = "+inf" if before == math.inf else repr(float(before))

        async def due() -> list[tuple[str, float]]:
            if limit < 1:  # LIMIT 0 0 is empty, but LIMIT 0 -1 would be everything
                return []
            raw = await cast(
                Awaitable[list[tuple[bytes, float]]],
                self._client.zrangebyscore(name, "-inf", top, start=0, num=limit, withscores=True),
            )
            return [(_text(member), float(score)) for member, score in raw]

        return await self._run("pins due", due())

    async def pin_totals(self, decode: str) -> PinTotals:
        keys = [pins_key(decode), pin_sizes_key(decode), pin_blocks_key(decode)]
        handles, blocks, handle_blocks, tokens = await self._run(
            "pin totals", self._pin_totals(keys=keys, args=[])
        )
        return PinTotals(int(handles), int(blocks), int(handle_blocks), int(tokens))

    async def turn_times(self, keys: Sequence[str]) -> list[TurnTimes | None]:
        """One pipelined HMGET per key (on Redis Cluster redis-py sends it to each key's node);
        a key of another type answers an error, which reads as None."""

        async def read() -> list[TurnTimes | None]:
            if not keys:
                return []
            client = self._client
            pipe = client.pipeline() if isinstance(client, RedisCluster) else client.pipeline(False)
            for key in keys:
                pipe.hmget(key, _TIME_FIELDS)
            replies = await pipe.execute(raise_on_error=False)
            return [_turn_times(reply) for reply in replies]

        return await self._run("turn times", read())

    async def get(self, key: str) -> SessionState | None:
        async def get() -> SessionState | None:
            reply = await cast(Awaitable[dict[bytes, bytes]], self._client.hgetall(key))
            return from_fields(reply) if reply else None

        return await self._run("get", get())

    async def delete(self, key: str) -> bool:
        removed = await self._run("delete", self._client.delete(key))
        return bool(removed)

    async def ping(self) -> None:
        async def ping() -> None:  # it answers, and runs scripts (an ACL may allow PING only)
            await self._client.ping()
            await evaluate(self._pool, self._probe, [], [])

        await self._run("ping", ping())

    async def close(self) -> None:
        """Close the connection pool, unless the client was passed in (its owner closes it)."""
        if self._owns_client:
            await connect.close(self._client)


def _pin_keys(decode: str) -> list[str]:
    return [pins_key(decode), pin_sizes_key(decode), pin_held_key(decode), pin_blocks_key(decode)]


def _size_args(size: PinSize) -> list[str]:
    """A note's "<blocks> <tokens>" and its block names (the Lua scripts' arguments)."""
    return [f"{size.blocks} {size.tokens}", size.held]


_TIME_FIELDS = ("turn", "created_at", "updated_at")


def _turn_times(reply: object) -> TurnTimes | None:
    """An HMGET of _TIME_FIELDS as TurnTimes; None for no state, an error or garbage."""
    if not isinstance(reply, list) or len(reply) != len(_TIME_FIELDS) or reply[0] is None:
        return None
    turn, created, updated = (_text(v) if v is not None else "" for v in reply)
    try:
        return TurnTimes(int(turn), float(created or 0), float(updated or 0))
    except ValueError:
        return None
