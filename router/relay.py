"""A relayed answer that sends its body itself (`RelayResponse`), and the watch that cancels
the turn the moment its client hangs up (`Watch`): below both http/ and the legs that relay."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

# Where a request's scope holds the server's own `send` (put there by the outermost wrapper,
# router/http/server.py): a relayed stream's body goes out with it, past Starlette's two
# middleware wrappers (a coroutine call each per chunk), which only watch for the response
# start; that one still goes through them.
SERVER_SEND = "kvbaton.server_send"


async def _disconnected(receive: Callable[[], Any]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class Watch:
    """Cancels the task that made it when the client hangs up (one watcher task: the work
    itself runs in that task, not a task of its own)."""

    def __init__(self, receive: Callable[[], Any]) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.gone = False
        self._taken = False  # our cancel taken back
        self._task = task
        self._watcher = asyncio.create_task(self._watch(receive))

    async def _watch(self, receive: Callable[[], Any]) -> None:
        await _disconnected(receive)
        self.gone = True
        self._task.cancel()

    def ours(self) -> bool:
        """On a CancelledError: whether it was this watch's cancel alone (then taken back)."""
        if not self.gone or self._taken:
            return False
        self._taken = True
        return self._task.uncancel() == 0

    def close(self) -> None:
        self._watcher.cancel()
        if self.gone and not self._taken and self._task.cancelling():
            self._taken = True  # the work swallowed our cancel: take it back
            self._task.uncancel()


class RelayResponse(Response):
    """A streamed answer whose body `relay` sends itself (each chunk as it is ready: no
    generator between it and the server), the request's task cancelled (and with it `relay`,
    whose cleanup cancels D's request) when the client hangs up mid-stream. Starlette's
    StreamingResponse does the same with a task group of two more tasks per response and one
    more generator layer per chunk."""

    def __init__(
        self, relay: Callable[[Send], Awaitable[None]], headers: dict[str, str], media_type: str
    ) -> None:
        self._relay = relay  # no `self.body`: init_headers would send Content-Length: 0
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watch = Watch(receive)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            body_send = scope.get(SERVER_SEND, send)
            await self._relay(body_send)
            await body_send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not watch.ours():
                raise
        finally:
            watch.close()
