"""The shutdown drain: requests in progress are counted, streamed bodies included."""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import pytest

from router.errors import ConfigError
from router.http.server import Requests, drain, event_loop_factory
from router.http.workers import describe


class Slow:
    """An ASGI app whose requests finish when `done` is set."""

    def __init__(self) -> None:
        self.done = asyncio.Event()
        self.lifespan = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            self.lifespan += 1
            return
        await self.done.wait()


async def test_drain_waits_for_requests_in_progress() -> None:
    app = Slow()
    requests = Requests(app)
    await requests({"type": "lifespan"}, None, None)  # not a request
    assert (requests.active, app.lifespan) == (0, 1)
    assert await drain(requests, 5.0) > 4.0  # nothing in progress: at once
    tasks = [asyncio.create_task(requests({"type": "http"}, None, None)) for _ in range(3)]
    await asyncio.sleep(0)
    assert requests.active == 3
    waiting = asyncio.create_task(drain(requests, 5.0))
    await asyncio.sleep(0.05)
    assert not waiting.done()
    app.done.set()
    left = await waiting
    assert 4.0 < left <= 5.0 and requests.active == 0
    await asyncio.gather(*tasks)


async def test_drain_gives_up_after_the_grace_period() -> None:
    app = Slow()
    requests = Requests(app)
    task = asyncio.create_task(requests({"type": "http"}, None, None))
    await asyncio.sleep(0)
    assert await drain(requests, 0.1) == 0.0
    assert requests.active == 1
    app.done.set()
    await task
    assert requests.active == 0


async def test_start_up_reported_once_the_lifespan_completes() -> None:
    started: list[str] = []
    sent: list[str] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "lifespan.startup.failed" if scope.get("fail") else "x"})
        if not scope.get("fail"):
            await send({"type": "lifespan.startup.complete"})

    async def send(message: Any) -> None:
        sent.append(message["type"])

    requests = Requests(app, lambda: started.append("ready"))
    await requests({"type": "lifespan", "fail": True}, None, send)
    assert started == [] and sent == ["lifespan.startup.failed"]
    await requests({"type": "lifespan"}, None, send)
    assert started == ["ready"] and sent[-1] == "lifespan.startup.complete"


def test_worker_exit_statuses_in_words() -> None:
    assert describe(3) == "exited with status 3"
    assert describe(-9) == "was killed by SIGKILL"
    assert describe(-200) == "was killed by signal 200"


def test_event_loop_factory() -> None:
    import uvloop

    assert event_loop_factory("asyncio") is None  # the standard library's
    factory = event_loop_factory("uvloop")
    assert factory is not None
    loop = factory()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_uvloop_missing_is_a_clear_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "uvloop", None)  # import fails as if not installed
    with pytest.raises(ConfigError, match="--event-loop asyncio"):
        event_loop_factory("uvloop")
