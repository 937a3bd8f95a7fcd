"""The session store's circuit breaker. One slow call under load is not an outage: the breaker
opens on `trip_after` failures in a row, or when at least `trip_share` of the calls of the last
`window` seconds failed (`min_calls` or more), and then only until the store answers again: while
it is open, `watch` pings it every `probe_every` seconds (backing off to its `interval`), and
turns try the store again after `retry_after` at the latest. A store that answers but refuses
the router's commands (an ACL without scripting: `StoreRefused`) is remembered with its reason,
for /ready and /status. An outage is logged once when the breaker opens (with `hint`, how to fix
the address), then reminded at most every `remind_every` seconds, and once more when the store
answers again; failures that open nothing are said at most once per `remind_every`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from sessions.store import CorruptState, SessionStore, StoreError, StoreRefused

log = logging.getLogger("kvbaton.store")

T = TypeVar("T")


@dataclass
class StoreGuard:
    """Wraps the turns' calls to a SessionStore. `ping` is the direct check that /ready, /status
    and `watch` use: when the store answers it, the next turn uses the store again."""

    retry_after: float  # the longest the breaker stays open without a ping that answers
    clock: Callable[[], float] = time.monotonic
    trip_after: int = 3
    trip_share: float = 0.5
    window: float = 10.0
    min_calls: int = 20
    probe_every: float = 0.1
    open_until: float = 0.0
    failures: int = 0  # every turn call that failed, for /status
    in_a_row: int = 0
    refused: str = ""  # why the store refuses the router's commands ("" : it does not)
    on_failure: Callable[[], None] | None = None
    # How the logs name the store (its address) and what to check when it does not answer.
    name: str = "session store"
    hint: str = ""
    remind_every: float = 60.0
    down_since: float | None = None  # the outage's first failure, None while it answers
    _said_at: float = 0.0
    _stray_said_at: float = -1e18
    # One [second, calls, failures] per second of the window, oldest first.
    _seconds: deque[list[int]] = field(default_factory=deque)
    _opened: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def is_open(self) -> bool:
        return self.clock() < self.open_until

    async def call(self, operation: Callable[[], Awaitable[T]]) -> T:
        """Run a store operation; raise StoreError at once while the breaker is open."""
        if self.is_open:
            raise StoreError("session store skipped: the breaker is open after failures")
        try:
            result = await operation()
        except CorruptState:
            raise  # one conversation's bad key: the store works, the breaker stays closed
        except StoreError as exc:
            self._failed(exc)
            raise
        self._count(failed=False)  # a success sums nothing: the window is read on failures
        self.in_a_row = 0
        self.refused = ""
        self._up()
        return result

    async def check(self, store: SessionStore) -> bool:
        """At start: ping the store; when it does not answer, say so once (with the hint) and
        open the breaker, so the first turns do not each wait for a timeout."""
        try:
            await store.ping()
        except StoreError as exc:
            self._open(exc)
            return False
        return True

    def _failed(self, exc: StoreError) -> None:
        self.failures += 1
        self.in_a_row += 1
        if isinstance(exc, StoreRefused):
            self.refused = str(exc)
        if self.on_failure is not None:
            self.on_failure()
        self._count(failed=True)
        calls, failed = sum(s[1] for s in self._seconds), sum(s[2] for s in self._seconds)
        if self.in_a_row >= self.trip_after or (
            calls >= self.min_calls and failed >= self.trip_share * calls
        ):
            self._open(exc)
            return
        now = self.clock()
        if self.down_since is None and now - self._stray_said_at >= self.remind_every:
            self._stray_said_at = now
            log.warning("%s: %s (that turn runs without reuse; the others keep it)", self.name, exc)

    def _count(self, *, failed: bool) -> None:
        """Count one call in the window (one [second, calls, failures] entry a second)."""
        now = int(self.clock())
        seconds = self._seconds
        while seconds and seconds[0][0] <= now - self.window:
            seconds.popleft()
        if not seconds or seconds[-1][0] != now:
            seconds.append([now, 0, 0])
        seconds[-1][1] += 1
        seconds[-1][2] += failed

    def _open(self, exc: StoreError) -> None:
        now = self.clock()
        self.open_until = now + self.retry_after
        self._opened.set()
        if self.down_since is None:
            self.down_since = self._said_at = now
            hint = f"; {self.hint}" if self.hint and not isinstance(exc, StoreRefused) else ""
            log.warning(
                "%s %s (%s): routing without reuse until it does%s",
                self.name,
                "refuses the router's commands"
                if isinstance(exc, StoreRefused)
                else "does not answer",
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
        """Ping the store past the breaker; raise StoreError if it does not answer (or
        StoreRefused if it refuses the router's scripts). An answer closes the breaker, unless
        a turn's call failed while the ping was in flight. A failed ping is not counted as a
        turn's failure."""
        opened = self.open_until
        try:
            await store.ping()
        except StoreRefused as exc:
            self.refused = str(exc)
            raise
        self.refused = ""
        if self.open_until == opened:
            if opened:
                self.open_until = 0.0
                self.in_a_row = 0
            self._up()

    async def watch(self, store: SessionStore, interval: float) -> None:
        """While the breaker is open, ping the store every `probe_every` seconds, twice as
        long after each ping it does not answer, `interval` at most (until cancelled): reuse
        resumes within that of the store's return, even when nothing calls /ready."""
        while True:
            await self._opened.wait()
            self._opened.clear()
            pause = min(self.probe_every, interval)
            while self.is_open:
                await asyncio.sleep(pause)
                with contextlib.suppress(StoreError):  # still away: the breaker stays open
                    await self.ping(store)
                pause = min(pause * 2, interval)
