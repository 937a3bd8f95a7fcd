"""Operator views of stored conversations: list those a decode instance holds, read a TTL,
read one conversation's HASH as stored (`kvbaton session show`).

Not part of the `SessionStore` protocol the turn uses. Listing walks the keyspace with a
bounded SCAN, one page per call (cost and paging: docs/operations.md).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol, cast

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from sessions.connect import RedisClient, close, connect
from sessions.keys import CONVERSATION_PATTERN, split_conversation_key
from sessions.memory_store import MemorySessionStore
from sessions.model import SessionState
from sessions.store import StoreError

# The HASH fields a summary needs; never the handle itself (only whether there is one).
_FIELDS = ("decode", "turn", "kv_transfer_params", "token_count", "updated_at")


class Summary(msgspec.Struct, frozen=True, kw_only=True):
    """One conversation as a listing shows it (no handle, no digests)."""

    tenant: str
    conversation_id: str
    key: str
    turn: int
    decode: str
    has_handle: bool
    token_count: int
    updated_at: float


class Page(msgspec.Struct, frozen=True, kw_only=True):
    """One page of a listing; `cursor` "0" means the walk is complete."""

    conversations: list[Summary]
    cursor: str
    scanned: int


class ConversationIndex(Protocol):
    async def list(self, decode: str, cursor: str, count: int) -> Page:
        """Conversations whose last decode instance is `decode` ("" : all), one page."""
        ...

    async def ttl(self, key: str) -> float | None:
        """Seconds until the key expires; None when it does not exist or never expires."""
        ...


def _int(raw: bytes | str | None) -> int:
    text = raw.decode() if isinstance(raw, bytes) else (raw or "")
    return int(text) if text.isascii() and text.isdigit() else 0


def _float(raw: bytes | str | None) -> float:
    text = raw.decode() if isinstance(raw, bytes) else (raw or "")
    try:
        value = float(text)
    except ValueError:
        return 0.0
    return value if math.isfinite(value) else 0.0


def _text(raw: bytes | str | None) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else (raw or "")


def _summary(key: str, values: Sequence[bytes | str | None]) -> Summary | None:
    names = split_conversation_key(key)
    if names is None:
        return None
    decode, turn, params, tokens, updated = values
    return Summary(
        tenant=names[0],
        conversation_id=names[1],
        key=key,
        turn=_int(turn),
        decode=_text(decode),
        has_handle=_text(params) not in ("", "null"),
        token_count=_int(tokens),
        updated_at=_float(updated),
    )


def parse_cursor(cursor: str) -> int:
    """A listing cursor as an integer; ValueError for anything else."""
    value = int(cursor)
    if value < 0:
        raise ValueError("cursor must be >= 0")
    return value


class RedisConversationIndex:
    """SCAN `kvbaton:conv:*` with COUNT, then one pipelined HMGET per page."""

    def __init__(self, client: aioredis.Redis) -> None:
        self._client = client

    async def list(self, decode: str, cursor: str, count: int) -> Page:
        try:
            next_cursor, raw_keys = await self._client.scan(
                cursor=parse_cursor(cursor), match=CONVERSATION_PATTERN, count=count
            )
            keys = [k.decode() if isinstance(k, bytes) else str(k) for k in raw_keys]
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.hmget(key, list(_FIELDS))
            rows = cast(list[list[bytes | None]], await pipe.execute()) if keys else []
        except (RedisError, OSError) as exc:
            raise StoreError(f"listing conversations failed: {exc}") from exc
        found = [_summary(key, row) for key, row in zip(keys, rows, strict=True)]
        matches = [
            s for s in found if s is not None and s.turn and (not decode or s.decode == decode)
        ]
        return Page(conversations=matches, cursor=str(next_cursor), scanned=len(keys))

    async def ttl(self, key: str) -> float | None:
        try:
            ms = await self._client.pttl(key)
        except (RedisError, OSError) as exc:
            raise StoreError(f"reading the TTL of {key} failed: {exc}") from exc
        return ms / 1000 if ms >= 0 else None


async def read_conversation(url: str, key: str, timeout: float) -> tuple[dict[str, str], float]:
    """The key's HASH fields as stored ({}: no such key) and its TTL in seconds (negative:
    none), from the Redis at `url`; StoreError when it does not answer."""
    client = connect(url, socket_timeout=timeout, connect_timeout=timeout, max_connections=2)
    try:
        raw = await client.hgetall(key)
        ms = await client.pttl(key)
    except (RedisError, OSError) as exc:
        raise StoreError(str(exc)) from exc
    finally:
        await close(client)
    fields = {_text(k): _text(v) for k, v in raw.items()}
    return fields, ms / 1000 if ms >= 0 else float(ms)


def redis_index(client: RedisClient) -> RedisConversationIndex | None:
    """The index over client; None for a Redis Cluster client: listing pages with SCAN cursors,
    which a cluster does not offer (one cursor per node), so there the conversation admin
    routes are unavailable."""
    return RedisConversationIndex(client) if isinstance(client, aioredis.Redis) else None


def _memory_summary(key: str, state: SessionState) -> Summary | None:
    values: list[Any] = [
        state.decode,
        str(state.turn),
        "x" if state.kv_transfer_params else "",
        str(state.token_count),
        repr(state.updated_at),
    ]
    return _summary(key, values)


class MemoryConversationIndex:
    """The same views over `MemorySessionStore`; the cursor is an offset in sorted keys."""

    def __init__(self, store: MemorySessionStore) -> None:
        self._store = store

    def _live(self) -> dict[str, tuple[SessionState, float]]:
        return self._store.live_entries()

    async def list(self, decode: str, cursor: str, count: int) -> Page:
        start = parse_cursor(cursor)
        entries = self._live()
        keys = sorted(entries)
        chunk = keys[start : start + count]
        found = [_memory_summary(k, entries[k][0]) for k in chunk]
        matches = [s for s in found if s is not None and (not decode or s.decode == decode)]
        end = start + len(chunk)
        return Page(
            conversations=matches, cursor=str(end if end < len(keys) else 0), scanned=len(chunk)
        )

    async def ttl(self, key: str) -> float | None:
        entry = self._live().get(key)
        return None if entry is None else entry[1]
