"""A connection's idle watch on a timer: Hypercorn's keep-alive and header timeout without a
task made and cancelled per request.

Hypercorn watches each idle connection (from its opening, or the end of a response, until a
request head is complete) with a task that waits for the server's end or
`keep_alive_timeout`, then closes the connection; a request's head cancels it, the response's
end starts another. Per request that is two tasks made and one cancelled through two
coroutines: 2.0% of the router's instructions per turn on JSON hits (6.441 against 6.572 M,
medians of 3 alternating rounds of 300 turns, ranges apart: `python -m bench.instructions`).
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

_Armed = dict["IdleTimer", Callable[[], None]]
_ENDING = "_kvbaton_idle_ending"  # where a server's `_Ending` is kept: on its WorkerContext


class _Ending:
    """One task per server: when it begins to shut down, every armed timer fires at once."""

    def __init__(self, terminated: Any) -> None:
        self.armed: _Armed = {}
        self.task = asyncio.get_running_loop().create_task(self._wait(terminated))

    async def _wait(self, terminated: Any) -> None:
        await terminated.wait()
        armed, self.armed = self.armed, {}
        for timer, fire in armed.items():
            timer.cancel()
            fire()


class IdleTimer:
    """Hypercorn's `SingleTask` for a TCP connection's idle watch (`restart`, `stop`)."""

    def __init__(self) -> None:
        self._handle: asyncio.TimerHandle | None = None
        self._ending: _Ending | None = None
        self._fallback: AsyncioSingleTask | None = None

    async def restart(self, task_group: Any, action: Callable[[], Any]) -> None:
        server: Any = getattr(action, "__self__", None)
        close = getattr(server, "_initiate_server_close", None)
        if server is None or close is None or getattr(action, "__name__", "") != "_idle_timeout":
            # Not the watch this stands in for (another Hypercorn): Hypercorn's own way.
            self._fallback = self._fallback or AsyncioSingleTask()
            await self._fallback.restart(task_group, action)
            return
        self.cancel()
        context = server.context

        def fire() -> None:
            self._handle = None
            task_group._task_group.create_task(close())

        if context.terminated.is_set():  # shutting down: an idle connection closes now
            fire()
            return
        ending = getattr(context, _ENDING, None)
        if ending is None:
            ending = _Ending(context.terminated)
            setattr(context, _ENDING, ending)
        self._ending = ending
        ending.armed[self] = fire
        loop = asyncio.get_running_loop()
        self._handle = loop.call_later(server.config.keep_alive_timeout, self._fired, fire)

    def _fired(self, fire: Callable[[], None]) -> None:
        if self._ending is not None:
            self._ending.armed.pop(self, None)
        fire()

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._ending is not None:
            self._ending.armed.pop(self, None)
            self._ending = None

    async def stop(self) -> None:
        self.cancel()
        if self._fallback is not None:
            await self._fallback.stop()


def install() -> None:
    """Make Hypercorn's TCP connections watch their idle time with `IdleTimer` (Hypercorn has
    no setting for it; its TCP server looks the class up by this name)."""
    tcp_server.AsyncioSingleTask = IdleTimer  # type: ignore[attr-defined,assignment]
