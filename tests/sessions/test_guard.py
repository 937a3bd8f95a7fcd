"""The store breaker against a real redis-server stopped and restarted: a direct ping that the
store answers closes it at once (reuse resumes when Redis is back, not `retry_after` later)."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from harness.procs import redis_server, restart_redis, stop
from sessions.guard import StoreGuard
from sessions.keys import conversation_key
from sessions.redis_store import RedisSessionStore
from sessions.store import StoreError

KEY = conversation_key("default", "guarded")


@dataclass
class Outage:
    store: RedisSessionStore
    port: int
    proc: subprocess.Popen[bytes]

    def stop(self) -> None:
        stop(self.proc)

    def start(self) -> None:
        self.proc = restart_redis(self.port)


@pytest.fixture
async def outage() -> AsyncIterator[Outage]:
    with redis_server() as (url, port, proc):
        o = Outage(RedisSessionStore(url, timeout=0.5), port, proc)
        try:
            yield o
        finally:
            await o.store.close()
            stop(o.proc)


async def open_breaker(guard: StoreGuard, o: Outage) -> None:
    o.stop()
    for _ in range(guard.trip_after):
        assert not guard.is_open, "opened before trip_after failures in a row"
        with pytest.raises(StoreError):
            await guard.call(lambda: o.store.get(KEY))
    assert guard.is_open and guard.failures == guard.trip_after


async def test_a_ping_the_store_answers_closes_the_breaker(outage: Outage) -> None:
    guard = StoreGuard(retry_after=60.0)
    await open_breaker(guard, outage)
    with pytest.raises(StoreError):
        await guard.ping(outage.store)  # still down: stays open, not counted as a failure
    assert guard.is_open and guard.failures == guard.trip_after
    outage.start()
    await guard.ping(outage.store)
    assert not guard.is_open  # 60 s early
    assert await guard.call(lambda: outage.store.get(KEY)) is None


async def test_a_ping_never_closes_a_breaker_a_turn_opened_meanwhile(outage: Outage) -> None:
    guard = StoreGuard(retry_after=60.0)
    assert not guard.is_open
    ping = asyncio.create_task(guard.ping(outage.store))
    await asyncio.sleep(0)  # the ping is out, waiting for Redis
    guard.open_until = guard.clock() + 60.0  # a turn's call failed while the ping was out
    await ping
    assert guard.is_open


async def test_watch_closes_the_breaker_when_the_store_is_back(outage: Outage) -> None:
    guard = StoreGuard(retry_after=60.0)
    await open_breaker(guard, outage)
    watching = asyncio.create_task(guard.watch(outage.store, 0.05))
    try:
        await asyncio.sleep(0.3)
        assert guard.is_open  # Redis still down
        outage.start()
        for _ in range(200):  # 10 s at most
            if not guard.is_open:
                break
            await asyncio.sleep(0.05)
        assert not guard.is_open, "the watch did not close the breaker"
    finally:
        watching.cancel()
    assert guard.failures == guard.trip_after  # the watch's failed pings were not counted


async def test_an_outage_is_said_once_reminded_each_minute_and_its_end_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A failure every 2 s for two minutes: one line for the first (which opens nothing), one
    when the third in a row opens the breaker (with the hint), one reminder per minute, one
    line when the store answers again."""
    now = [0.0]
    guard = StoreGuard(retry_after=2.0, clock=lambda: now[0], name="Redis at X", hint="fix it")

    async def fails() -> None:
        raise StoreError("Error 111 connecting")

    async def answers() -> str:
        return "ok"

    caplog.set_level("INFO", logger="kvbaton.store")
    for second in range(0, 125, 2):
        now[0] = float(second)
        with pytest.raises(StoreError):
            await guard.call(fails)
    now[0] = 127.0
    assert await guard.call(answers) == "ok"
    assert await guard.call(answers) == "ok"
    said = [r.getMessage() for r in caplog.records]
    assert said == [
        "Redis at X: Error 111 connecting (that turn runs without reuse; the others keep it)",
        "Redis at X does not answer (Error 111 connecting): routing without reuse until it "
        "does; fix it",
        "Redis at X still does not answer after 60 s (Error 111 connecting): routing without reuse",
        "Redis at X still does not answer after 120 s (Error 111 connecting): routing without "
        "reuse",
        "Redis at X answers again after 123 s; routing with reuse",
    ]
