"""What every turn needs, opened by the app's lifespan and passed down (no module globals)."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from router.config import Settings
from router.engines.client import Upstream
from router.engines.pool import Pool
from router.metrics import Metrics
from sessions.store import SessionStore, StoreError

log = logging.getLogger("kvbaton.store")

T = TypeVar("T")


@dataclass
class StoreGuard:
    """A circuit breaker around the session store: after a failure, route without the store
    for `retry_after` seconds instead of paying a timeout on every request."""

    retry_after: float
    clock: Callable[[], float] = time.monotonic
    open_until: float = 0.0
    failures: int = 0
    on_failure: Callable[[], None] | None = None

    @property
    def is_open(self) -> bool:
        return self.clock() < self.open_until

    async def call(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run a store operation; raise StoreError at once while the breaker is open."""
        if self.is_open:
            raise StoreError("session store skipped: circuit open after a recent failure")
        try:
            result = await operation()
        except StoreError as exc:
            self.failures += 1
            if self.on_failure is not None:
                self.on_failure()
            if not self.is_open:
                log.warning(
                    "session store failed (%s); routing without reuse for %.1fs",
                    exc,
                    self.retry_after,
                )
            self.open_until = self.clock() + self.retry_after
            raise
        return result


@dataclass
class Services:
    settings: Settings
    upstream: Upstream
    pool: Pool
    store: SessionStore
    guard: StoreGuard
    metrics: Metrics
    model: str = ""
    block_size: int = 0
    clock: Callable[[], float] = time.time
    stopping: bool = False
    # Why P no longer gets prompts as token ids in this process ("" while it does).
    ids_leg_off: str = ""

    def ids_leg_on(self) -> bool:
        return self.settings.prefill_token_ids and not self.ids_leg_off

    def switch_ids_leg_off(self, reason: str) -> None:
        if not self.ids_leg_off:
            self.ids_leg_off = reason
            logging.getLogger("kvbaton.legs").error(
                "P legs by token ids switched off in this process: %s", reason
            )
