"""The stores of one process over one Redis client: sessions, the instance registry and the
conversation index (or all three in the process, for `--session-store memory`).

One client means one connection pool and one close. Its socket timeout is the longest any
caller needs (ADMIN_TIMEOUT: an admin listing SCANs a page of keys); each session-store call
is bounded by the turn's own, shorter timeout (RedisSessionStore). With a socket timeout
redis-py writes each command in a task of its own (asyncio.wait_for): the turn's claim and
commit (sessions.evaluate) switch it off on the connection they hold, their calls bounded by
the store's timeout alone. The client keeps it for every other command. With it off for the
whole client (before sessions.evaluate and its bounded pool), a burst of 128 new turns saw
the turns' store calls time out, cause not known; with evaluate's, 3,000 turns at 128
clients ran none without the store (docs/benchmarks.md, section 1, 06cd0e6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from sessions import connect
from sessions.admin_ops import ConversationIndex, MemoryConversationIndex, redis_index
from sessions.connect import RedisClient
from sessions.memory_store import MemorySessionStore
from sessions.redis_store import RedisSessionStore, turn_retry
from sessions.registry_store import MemoryRegistry, RedisRegistry, Registry
from sessions.responses_store import MemoryResponseStore, RedisResponseStore, ResponseStore
from sessions.store import SessionStore

# Seconds for the registry's and the admin listing's commands (a SCAN page, its HMGETs).
ADMIN_TIMEOUT = 2.0


@dataclass
class Backend:
    """What the lifespan opens once and closes once."""

    store: SessionStore
    registry: Registry
    # None where listing is impossible: Redis Cluster has one SCAN cursor per node.
    conversations: ConversationIndex | None
    # Stored Responses API responses (docs/responses.md).
    responses: ResponseStore
    client: RedisClient | None = None

    async def close(self) -> None:
        await self.store.close()
        if self.client is not None:
            await connect.close(self.client)


def open_backend(kind: Literal["redis", "memory"], url: str, *, store_timeout: float) -> Backend:
    """The stores for `--session-store kind` (nothing is connected until the first command).

    url: plain, redis+cluster:// or redis+sentinel:// (sessions.connect).
    """
    if kind == "memory":
        memory = MemorySessionStore()
        return Backend(
            memory, MemoryRegistry(), MemoryConversationIndex(memory), MemoryResponseStore()
        )
    timeout = max(store_timeout, ADMIN_TIMEOUT)
    client = connect.connect(
        url, socket_timeout=timeout, connect_timeout=timeout, retry=turn_retry()
    )
    store = RedisSessionStore(url, timeout=store_timeout, client=client)
    responses = RedisResponseStore(client, timeout=store_timeout)
    return Backend(store, RedisRegistry(client), redis_index(client), responses, client)
