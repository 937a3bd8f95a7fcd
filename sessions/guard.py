"""The session store's circuit breaker: after a failure, turns skip the store for `retry_after`
seconds instead of each paying a timeout; a direct ping that succeeds closes it at once. An
outage is logged once when it begins (with `hint`, how to fix the address), then reminded at
most every `remind_every` seconds, and once more when the store answers again."""

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
    # How the logs name the store (its address) and what to check when it does not answer.
    name: str = "session store"
    hint: str = ""
    remind_every: float = 60.0
    down_since: float | None = None  # the outage's first failure, None while it answers
    _said_at: float = 0.0

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
            self._down(exc)
            raise
        self._up()
        return result

    async def check(self, store: SessionStore) -> bool:
        """At start: ping the store; when it does not answer, say so once (with the hint) and
        open the breaker, so the first turns do not each wait for a timeout."""
        try:
            await store.ping()
        except StoreError as exc:
            self._down(exc)
            return False
        return True

    def _down(self, exc: StoreError) -> None:
        now = self.clock()
        self.open_until = now + self.retry_after
        if self.down_since is None:
            self.down_since = self._said_at = now
            hint = f"; {self.hint}" if self.hint else ""
            log.warning(
                "%s does not answer (%s): routing without reuse until it does%s",
                self.name,
                exc,
                hint,
            )
        elif now - self._said_at >= self.remind_every:
            self._said_at = now
            log.warning(
                "%s still does not answer after %.0f s (%s): routing without reuse",
                self.name,
                now - self.down_since,
                exc,
            )

    def _up(self) -> None:
        if self.down_since is not None:
            log.info(
                "%s answers again after %.0f s; routing with reuse",
                self.name,
                self.clock() - self.down_since,
            )
            self.down_since = None

    async def ping(self, store: SessionStore) -> None:
        """Ping the store past the breaker; raise StoreError if it does not answer. An answer
        closes the breaker, unless a turn's call failed while the ping was in flight. A failed
        ping changes nothing (it is not a turn's failure, and is not counted as one)."""
        opened = self.open_until
        await store.ping()
        if self.open_until == opened:
            if opened:
                self.open_until = 0.0
            self._up()

    async def watch(self, store: SessionStore, interval: float) -> None:
        """Every `interval` seconds while the breaker is open, ping the store (until cancelled).

        So reuse resumes within `interval` of the store's return even when nothing calls /ready.
        """
        while True:
            await asyncio.sleep(interval)
            if self.is_open:
                with contextlib.suppress(StoreError):  # still away: the breaker stays open
                    await self.ping(store)
