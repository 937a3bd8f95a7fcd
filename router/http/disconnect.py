"""A client that hangs up before the response starts: notice it at once and cancel the turn
(and with it the engine requests), instead of finding out when D finally answers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Coroutine
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

# nginx's "client closed request": logged and counted, never seen by the client.
CLIENT_CLOSED = 499


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Coroutine[Any, Any, Response]) -> Response:
    """Run `work` (the body is already read); cancel it if the client goes away first."""
    task = asyncio.create_task(work)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for pending in (task, watcher):
            if not pending.done():
                pending.cancel()
        if not task.done():
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        return Response(status_code=CLIENT_CLOSED)
    return task.result()
