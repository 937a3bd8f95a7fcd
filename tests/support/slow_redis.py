"""A TCP proxy in front of a redis-server that delays one command when told to: the next
client write holding `word` (e.g. EVALSHA) is held back `delay` seconds, or until released
(`hold_next`), every other byte passes at once. One slow Redis call, as a loaded machine or a
busy server makes one."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field


@dataclass
class SlowRedis:
    target_port: int
    url: str = ""
    word: bytes = b"EVALSHA"
    delay: float = 0.0
    delayed: int = 0  # commands held back so far
    armed: threading.Event = field(default_factory=threading.Event)
    # Set while a held command waits for `released` (hold_next), cleared once it passes.
    holding: threading.Event = field(default_factory=threading.Event)
    released: threading.Event | None = None

    def delay_next(self, delay: float, word: bytes = b"EVALSHA") -> None:
        self.delay, self.word, self.released = delay, word, None
        self.armed.set()

    def hold_next(self, word: bytes) -> threading.Event:
        """Hold the next write holding `word` until the returned event is set."""
        self.word, self.released = word, threading.Event()
        self.armed.set()
        return self.released

    async def _pipe(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, up: bool
    ) -> None:
        with contextlib.suppress(ConnectionError, asyncio.CancelledError):
            while data := await reader.read(65536):
                if up and self.armed.is_set() and self.word in data:
                    self.armed.clear()
                    self.delayed += 1
                    await self._wait()
                writer.write(data)
                await writer.drain()
        with contextlib.suppress(Exception):
            writer.close()

    async def _wait(self) -> None:
        released = self.released
        if released is None:
            await asyncio.sleep(self.delay)
            return
        self.holding.set()
        await asyncio.to_thread(released.wait, 300)  # a test thread sets it
        self.holding.clear()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            self._pipe(reader, up_writer, up=True), self._pipe(up_reader, writer, up=False)
        )


@contextlib.contextmanager
def slow_redis(target_port: int) -> Iterator[SlowRedis]:
    """The proxy on a free port of 127.0.0.1, served from a thread of its own."""
    proxy = SlowRedis(target_port)
    sock = socket.create_server(("127.0.0.1", 0))
    proxy.url = f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    loop = asyncio.new_event_loop()
    ready, stop = threading.Event(), asyncio.Event()

    async def serve() -> None:
        server = await asyncio.start_server(proxy._client, sock=sock)
        ready.set()
        await stop.wait()
        server.close()
        # Cancel the pipes and let them close their sockets before the loop stops (a socket
        # left to the collector warns inside whichever test runs next).
        pipes = asyncio.all_tasks() - {asyncio.current_task()}
        for task in pipes:
            task.cancel()
        await asyncio.gather(*pipes, return_exceptions=True)
        await asyncio.sleep(0)  # the transports' close callbacks

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10), "the Redis proxy did not start"
    try:
        yield proxy
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()
        sock.close()
