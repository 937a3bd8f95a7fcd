"""A connection's idle watch on a timer: Hypercorn's keep-alive and header timeout without a
task made and cancelled per request.

Hypercorn watches each idle connection (from its opening, or the end of a response, until a
request head is complete) with a task that waits for the server's end or
`keep_alive_timeout`, then closes the connection; a request's head cancels it, the response's
end starts another. Per request that is two tasks made and one cancelled through two
coroutines: 2.0% of the router's instructions per turn on JSON hits (6.441 against 6.572 M,
medians of 3 alternating rounds of 300 turns, ranges apart: `python -m tools.instructions`).
`IdleTimer` arms one timer instead and closes the connection as Hypercorn's task would: when
the timer fires, or at once when the server begins to shut down (its `terminated` event: idle
connections must not hold the shutdown to its grace).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import hypercorn.asyncio.tcp_server as tcp_server
from hypercorn.asyncio.worker_context import AsyncioSingleTask

_ENDING = "_kvbaton_idle_ending"  # where a server's `_Ending` is kept: on its WorkerContext


class _Ending:
    """One task per server: when it begins to shut down, every armed timer fires at once."""

    def __init__(self, terminated: Any) -> None:
        self.armed: set[IdleTimer] = set()
        self.task = asyncio.get_running_loop().create_task(self._wait(terminated))

    async def _wait(self, terminated: Any) -> None:
        await terminated.wait()
        armed, self.armed = self.armed, set()
        for timer in armed:
            timer.fire()


class IdleTimer:
    """Hypercorn's `SingleTask` for a TCP connection's idle watch (`restart`, `stop`). One per
    connection: what it closes is found on the first `restart`, so each later one (every
    response's end) only arms a timer."""

    def __init__(self) -> None:
        self._handle: asyncio.TimerHandle | None = None
        self._close: Callable[[], None] | None = None
        self._ending: _Ending | None = None
        self._timeout = 0.0
        self._fallback: AsyncioSingleTask | None = None

    async def restart(self, task_group: Any, action: Callable[[], Any]) -> None:
        if self._close is None and self._fallback is None:
            self._bind(task_group, action)
        if self._fallback is not None:
            await self._fallback.restart(task_group, action)
            return
        self.cancel()
        assert self._ending is not None
        if self._ending.task.done():  # shutting down: an idle connection closes now
            self.fire()
            return
        self._ending.armed.add(self)
        self._handle = asyncio.get_running_loop().call_later(self._timeout, self.fire)

    def _bind(self, task_group: Any, action: Callable[[], Any]) -> None:
        server: Any = getattr(action, "__self__", None)
        close = getattr(server, "_initiate_server_close", None)
        if close is None or getattr(action, "__name__", "") != "_idle_timeout":
            # Not the watch this stands in for (another Hypercorn): Hypercorn's own way.
            self._fallback = AsyncioSingleTask()
            return
        context = server.context
        ending = getattr(context, _ENDING, None)
        if ending is None:
            ending = _Ending(context.terminated)
            setattr(context, _ENDING, ending)
        self._ending, self._timeout = ending, server.config.keep_alive_timeout
        self._close = lambda: task_group._task_group.create_task(close())

    def fire(self) -> None:
        """Close the connection (the timer ran out, or the server is shutting down)."""
        self.cancel()
        assert self._close is not None
        self._close()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._ending is not None:
            self._ending.armed.discard(self)

    async def stop(self) -> None:
        self.cancel()
        if self._fallback is not None:
            await self._fallback.stop()


def install() -> None:
    """Make Hypercorn's TCP connections watch their idle time with `IdleTimer` (Hypercorn has
    no setting for it; its TCP server looks the class up by this name)."""
    tcp_server.AsyncioSingleTask = IdleTimer  # type: ignore[attr-defined,assignment]
