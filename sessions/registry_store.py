"""The instance registry's storage: what the admin API decided about each engine URL.

In Redis it is one HASH, `kvbaton:instances` (sessions/keys.py), URL -> JSON
`{"role", "state", "updated_at"}` (and `"kv_events"` for an instance added with its KV-events
endpoint), a public contract operators read with redis-cli; without
Redis it lives in the process. Both pass tests/sessions/test_registry_contract.py.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Literal, Protocol, cast

import msgspec
from redis.exceptions import RedisError

from sessions.connect import RedisClient
from sessions.keys import INSTANCES_KEY
from sessions.store import StoreError

log = logging.getLogger("kvbaton.registry")

# The same literals as router.engines.pool.Role (sessions never imports the router).
Role = Literal["prefill", "decode"]
State = Literal["active", "draining", "removed"]


class Entry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What the admin API decided about one instance URL (the HASH value, as JSON)."""

    role: Role
    state: State
    updated_at: float = 0.0
    kv_events: str = ""  # the engine's KV-events endpoint as `ENDPOINT[,REPLAY]` ("" for none)


_decode_entry = msgspec.json.Decoder(Entry).decode
_encode = msgspec.json.Encoder().encode


class Registry(Protocol):
    async def load(self) -> dict[str, Entry]:
        """Every entry by URL (a malformed one is skipped); raises StoreError when the backend
        fails."""
        ...

    async def put(self, url: str, entry: Entry) -> None:
        """Record an entry (replacing the URL's previous one); raises StoreError."""
        ...


class RedisRegistry:
    """One HASH, `kvbaton:instances`: URL -> `{"role", "state", "updated_at"}`."""

    def __init__(self, client: RedisClient) -> None:
        self._client = client

    async def load(self) -> dict[str, Entry]:
        try:
            raw = await cast(Awaitable[dict[bytes, bytes]], self._client.hgetall(INSTANCES_KEY))
        except (RedisError, OSError) as exc:
            raise StoreError(f"reading {INSTANCES_KEY} failed: {exc}") from exc
        entries: dict[str, Entry] = {}
        for url, value in raw.items():
            try:
                entries[url.decode()] = _decode_entry(value)
            except (msgspec.DecodeError, UnicodeDecodeError) as exc:
                log.warning("ignoring a malformed %s entry %r: %s", INSTANCES_KEY, url, exc)
        return entries

    async def put(self, url: str, entry: Entry) -> None:
        try:
            await self._client.hset(INSTANCES_KEY, url, _encode(entry))
        except (RedisError, OSError) as exc:
            raise StoreError(f"writing {INSTANCES_KEY} failed: {exc}") from exc


@dataclass
class MemoryRegistry:
    """The registry of a single replica without Redis: lost when the process stops."""

    entries: dict[str, Entry] = field(default_factory=dict)

    async def load(self) -> dict[str, Entry]:
        return dict(self.entries)

    async def put(self, url: str, entry: Entry) -> None:
        self.entries[url] = entry
