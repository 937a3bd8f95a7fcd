"""router/http/idle.py: Hypercorn's idle watch for a connection as one timer."""

from __future__ import annotations

import asyncio
from typing import Any

from router.http.idle import IdleTimer


class Group:
    """What Hypercorn's TaskGroup offers the watch: its asyncio task group."""

    def __init__(self, tg: asyncio.TaskGroup) -> None:
        self._task_group = tg


class Terminated:
    def __init__(self) -> None:
        self.event = asyncio.Event()

    async def wait(self) -> None:
        await self.event.wait()

    def is_set(self) -> bool:
        return self.event.is_set()


class Server:
    """The part of Hypercorn's TCPServer the watch uses."""

    def __init__(self, keep_alive: float, context: Any) -> None:
        self.config = type("Config", (), {"keep_alive_timeout": keep_alive})()
        self.context = context
        self.closed = 0

    async def _initiate_server_close(self) -> None:
        self.closed += 1

    async def _idle_timeout(self) -> None:  # Hypercorn's own watch: never run by IdleTimer
        raise AssertionError("the task-based watch ran")


def context() -> Any:
    return type("Context", (), {"terminated": Terminated()})()


async def test_the_timer_closes_an_idle_connection_and_a_request_stops_it() -> None:
    server = Server(0.05, context())
    async with asyncio.TaskGroup() as tg:
        timer = IdleTimer()
        await timer.restart(Group(tg), server._idle_timeout)
        await timer.stop()  # a request's head arrived in time
        await asyncio.sleep(0.1)
        assert server.closed == 0
        await timer.restart(Group(tg), server._idle_timeout)  # the response ended
        await timer.restart(Group(tg), server._idle_timeout)  # re-armed: one timer
        await asyncio.sleep(0.1)
    assert server.closed == 1


async def test_the_servers_end_closes_every_idle_connection_at_once() -> None:
    ctx = context()
    servers = [Server(60.0, ctx) for _ in range(3)]
    async with asyncio.TaskGroup() as tg:
        timers = [IdleTimer() for _ in servers]
        for timer, server in zip(timers, servers, strict=True):
            await timer.restart(Group(tg), server._idle_timeout)
        await timers[2].stop()  # busy: a request in progress is not cut
        ctx.terminated.event.set()
        await asyncio.sleep(0.01)
        assert [s.closed for s in servers] == [1, 1, 0]
        # Idle again after the end began: closed at once, no timer.
        await timers[2].restart(Group(tg), servers[2]._idle_timeout)
        await asyncio.sleep(0.01)
    assert [s.closed for s in servers] == [1, 1, 1]


async def test_any_other_action_runs_as_hypercorn_runs_it() -> None:
    ran = asyncio.Event()

    async def other() -> None:
        ran.set()
        await asyncio.sleep(60)

    async with asyncio.TaskGroup() as tg:
        timer = IdleTimer()
        await timer.restart(Group(tg), other)
        await asyncio.wait_for(ran.wait(), 1)
        await timer.stop()  # cancels Hypercorn's task; the group then ends
