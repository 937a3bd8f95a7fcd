"""The session store's circuit breaker: after a failure, turns skip the store for `retry_after`
seconds instead of each paying a timeout; a direct ping that succeeds closes it at once."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from sessions.store import CorruptState, SessionStore, StoreError

log = logging.getLogger("kvbaton.store")

T = TypeVar("T")


@dataclass
class StoreGuard:
    """Wraps the turns' calls to a SessionStore. `ping` is the direct check that /ready, /status
    and `watch` use: when the store answers it, the next turn uses the store again, so reuse
    resumes when the store is back, not up to `retry_after` later."""

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
        except CorruptState:
            raise  # one conversation's bad key: the store works, the breaker stays closed
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

    async def ping(self, store: SessionStore) -> None:
        """Ping the store past the breaker; raise StoreError if it does not answer. An answer
        closes the breaker, unless a turn's call failed while the ping was in flight. A failed
        ping changes nothing (it is not a turn's failure, and is not counted as one)."""
        opened = self.open_until
        await store.ping()
        if self.open_until == opened and opened:
            if self.is_open:
                log.info("session store answers again; routing with reuse")
            self.open_until = 0.0

    async def watch(self, store: SessionStore, interval: float) -> None:
        """Every `interval` seconds while the breaker is open, ping the store (until cancelled).

        So reuse resumes within `interval` of the store's return even when nothing calls /ready.
        """
        while True:
            await asyncio.sleep(interval)
            if self.is_open:
                with contextlib.suppress(StoreError):  # still away: the breaker stays open
                    await self.ping(store)
