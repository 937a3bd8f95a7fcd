"""A D in front of a real one: every request is passed on, except the chat turns it is told to
break, whose answer it rewrites into a shape the API does not promise (issue 50)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import aiohttp
from aiohttp import web

Shape = Callable[[bytes], tuple[bytes, str]]  # D's real answer -> (what to send, content type)
_HOP = {"host", "content-length", "transfer-encoding", "connection"}


@dataclass
class FakeD:
    """`url` answers as the real D at `behind`, but the next chat turn is broken by `shape`."""

    behind: str
    url: str = ""
    shape: Shape | None = None
    broken: int = 0  # answers rewritten so far
    ready: threading.Event = field(default_factory=threading.Event)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        shape = self.shape if request.path.endswith("/chat/completions") else None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP}
        async with (
            aiohttp.ClientSession() as session,
            session.request(
                request.method,
                self.behind + request.path_qs,
                data=await request.read(),
                headers=headers,
            ) as upstream,
        ):
            body = await upstream.read()
            kind = upstream.headers.get("Content-Type", "application/json")
            status = upstream.status
        if shape is not None and status == 200:
            self.shape = None
            self.broken += 1
            body, kind = shape(body)
        return web.Response(body=body, status=status, headers={"Content-Type": kind})


@contextlib.contextmanager
def fake_d(behind: str) -> Iterator[FakeD]:
    """The fake D on a free port of 127.0.0.1, served from a thread of its own."""
    fake = FakeD(behind)
    sock = socket.create_server(("127.0.0.1", 0))
    fake.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def serve() -> None:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", fake.handle)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        fake.ready.set()
        await stop.wait()
        await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    fake.ready.wait(10)
    try:
        yield fake
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()
        sock.close()
