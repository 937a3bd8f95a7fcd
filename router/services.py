"""What every turn needs, opened by the app's lifespan and passed down (no module globals)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

from router.config import Settings
from router.connectors.base import Connector
from router.engines.client import EngineClient, EngineStream
from router.engines.kv_watch import KvEvents
from router.engines.pool import Instance, Pool
from router.engines.release import Gaps, Releaser
from router.engines.spent import Spent
from router.metrics import Metrics
from sessions.guard import StoreGuard
from sessions.model import SessionState
from sessions.responses_store import MemoryResponseStore, ResponseStore
from sessions.store import SessionStore

# Opens a D leg (Services, D, API, body, request id, headers): the connectors' D leg
# (router/connectors/legs/decode.py), given to the turn, which may not import a connector.
DecodeOpener = Callable[
    ["Services", Instance, str, dict[str, Any], str, dict[str, str]], Awaitable[EngineStream]
]

# StoreGuard lives with the store it guards (sessions/guard.py); the router imports it here.
__all__ = ["Services", "StoreGuard"]


@dataclass
class Services:
    settings: Settings
    engines: EngineClient
    pool: Pool
    store: SessionStore
    guard: StoreGuard
    metrics: Metrics
    connector: Connector[Any]  # the KV-transfer protocol: its legs, params, capabilities
    model: str = ""
    block_size: int = 0
    # The smallest context length the decode instances report (0: unknown).
    max_model_len: int = 0
    clock: Callable[[], float] = time.time
    stopping: bool = False
    # Why P no longer gets prompts as token ids in this process ("" while it does).
    ids_leg_off: str = ""
    # What each engine's prefix cache holds, from its KV events (None: no --kv-events).
    kv_events: KvEvents | None = None
    # Per conversation whose last turn here left a handle: that turn's P and the tokens of
    # the handle it lacks, and its D (router/turn/early.py).
    prefill_hints: dict[str, tuple[str, int, str]] = field(default_factory=dict)
    # Per conversation, the state this process committed last (router/turn/ahead.py: D's leg
    # sent beside the claim), and how a D leg is opened (None: never beside the claim).
    last_states: dict[str, SessionState] = field(default_factory=dict)
    open_decode: DecodeOpener | None = None
    # Releases handles nobody will read (None: the connector pins nothing, or --no-release-pins).
    releaser: Releaser | None = None
    gaps: Gaps = field(default_factory=Gaps)  # the measured time between turns
    # Work a turn starts and does not wait for (the pin index's writes).
    background: set[asyncio.Task[None]] = field(default_factory=set)
    # The handles read or released here (a state naming one again is stale): set up below.
    spent: Spent = field(init=False)
    # Handles released after a commit that timed out, to be marked spent in the store once it
    # answers (conversation key, handle digest, until): router/turn/pins.py.
    unspent: deque[tuple[str, str, float]] = field(default_factory=lambda: deque(maxlen=4096))
    flushing: bool = False  # a task writes `unspent` now
    # Stored Responses API responses (router/turn/responses_chain.py, docs/responses.md).
    responses: ResponseStore = field(default_factory=MemoryResponseStore)

    def __post_init__(self) -> None:
        self.spent = Spent(self.settings.handle_ttl, lambda: self.clock())

    def spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run `work` without waiting for it (kept referenced until it ends)."""
        task = asyncio.create_task(work)
        self.background.add(task)
        task.add_done_callback(self.background.discard)

    def ids_leg_on(self) -> bool:
        return self.settings.prefill_token_ids and not self.ids_leg_off

    def switch_ids_leg_off(self, reason: str) -> None:
        if not self.ids_leg_off:
            self.ids_leg_off = reason
            logging.getLogger("kvbaton.legs").error(
                "P legs by token ids switched off in this process: %s", reason
            )
