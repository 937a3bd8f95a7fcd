"""Stored Responses API responses (`store`, `previous_response_id`): the signed record of
one response, and the `ResponseStore` seam with its Redis and in-process implementations."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import math
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Protocol, TypeVar, cast

import msgspec
from redis.exceptions import RedisError

from sessions.connect import RedisClient
from sessions.failures import failure

T = TypeVar("T")


class StoredResponse(msgspec.Struct, frozen=True):
    """One finished response as kept for its tenant (docs/responses.md)."""

    id: str
    # The response object as its client got it (`store: true`), D's handle and token ids out.
    response: dict[str, Any]
    # Every input item it was generated from, the chain expanded (its instructions aside).
    input: list[Any]
    # The conversation (session) its turn ran in, which the next response of the chain
    # continues: its KV on D. "" when it had none.
    conversation: str = ""
    # The client named that conversation (conversation_id, conversation, ...): deleting the
    # response never ends it. False: the chain's own session, ended with its last response.
    named: bool = False
    # The conversation's turn its commit wrote (0: it committed none).
    turn: int = 0
    created_at: float = 0.0


_ENCODE = msgspec.json.Encoder().encode
_DECODE = msgspec.json.Decoder(StoredResponse).decode
_UNSIGNED = b"-"


def _mac(secret: str, key: str, body: bytes) -> bytes:
    # Personalised, so that no session state's HMAC can pass for a response's.
    message = b"kvbaton-response\n" + key.encode() + b"\n" + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest().encode()


def seal(secrets: Sequence[str], key: str, record: StoredResponse) -> bytes:
    """The value stored under `key`: `<hmac hex> <record JSON>` (`-` unsigned), readable with
    redis-cli GET. The first secret signs, as for session states."""
    body = _ENCODE(record)
    return (_mac(secrets[0], key, body) if secrets else _UNSIGNED) + b" " + body


def unseal(secrets: Sequence[str], key: str, value: bytes) -> StoredResponse | None:
    """The record a stored value holds; None when it is not one, or (with secrets) no secret
    made its HMAC: a value someone else wrote is never trusted, never served."""
    mac, _, body = value.partition(b" ")
    if secrets and not any(hmac.compare_digest(mac, _mac(s, key, body)) for s in secrets):
        return None
    try:
        return _DECODE(body)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


class ResponseStore(Protocol):
    """Sealed records by key (`sessions.keys.response_key`). Every method raises StoreError,
    never a backend exception, when the backend fails."""

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        """Store value under key for ttl_s seconds (a new value replaces the old)."""
        ...

    async def get(self, key: str) -> bytes | None:
        """The value; None when there is none (never stored, expired or deleted)."""
        ...

    async def delete(self, key: str) -> bytes | None:
        """Remove key, atomically returning the value it had; None when there was none."""
        ...


# GET and DEL in one step (GETDEL needs Redis 6.2; this runs on any server with scripting).
_TAKE = """
local value = redis.call('GET', KEYS[1])
if value then redis.call('DEL', KEYS[1]) end
return value
"""


class RedisResponseStore:
    """ResponseStore on Redis: one STRING per response, with its TTL. Each call is bounded by
    `timeout`, as the session store's are."""

    def __init__(self, client: RedisClient, *, timeout: float) -> None:
        self._client = client
        self._timeout = timeout
        self._take = client.register_script(_TAKE)

    async def _run(self, what: str, call: Awaitable[T]) -> T:
        try:
            async with asyncio.timeout(self._timeout):
                return await call
        except (RedisError, OSError) as exc:
            raise failure(what, exc, self._timeout) from exc

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        ttl_ms = max(1, math.ceil(ttl_s * 1000))
        stored = cast(Awaitable[Any], self._client.set(key, value, px=ttl_ms))
        await self._run("response put", stored)

    async def get(self, key: str) -> bytes | None:
        return await self._run("response get", cast(Awaitable[bytes | None], self._client.get(key)))

    async def delete(self, key: str) -> bytes | None:
        value = await self._run("response delete", self._take(keys=[key], args=[]))
        return cast(bytes | None, value)


class MemoryResponseStore:
    """ResponseStore in a dict for a single replica: expired lazily by a clock, the oldest
    dropped first past max_entries or max_bytes in all."""

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        *,
        max_entries: int = 100_000,
        max_bytes: int = 512 * 1024 * 1024,
    ) -> None:
        self._clock = clock
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._bytes = 0
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    async def put(self, key: str, value: bytes, ttl_s: float) -> None:
        self._pop(key)
        self._entries[key] = (value, self._clock() + ttl_s)
        self._bytes += len(value)
        while self._entries and (
            len(self._entries) > self._max_entries or self._bytes > self._max_bytes
        ):
            self._pop(next(iter(self._entries)))

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self._clock() >= entry[1]:
            self._pop(key)
            return None
        return entry[0]

    async def delete(self, key: str) -> bytes | None:
        value = await self.get(key)
        self._pop(key)
        return value

    def _pop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry[0])
