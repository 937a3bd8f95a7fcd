"""The machine's floor for relaying one paced chunk: a bare asyncio TCP relay, no HTTP.

Run as `python -m bench.floor source|relay PORT [UPSTREAM_PORT]`, or measured with
`measure()`. The source sends `tokens` chunks of an SSE-sized payload per connection, 5 ms
apart (as the paced D of the chunk-cost runs); the relay process forwards every read to its
client with a write, as any Python proxy must (one wake-up, one read, one write per chunk);
the client reads to EOF. Relay CPU per chunk is the slope of its CPU per connection between
8 and 128 chunks, the same method as the router's figure, so the two compare directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from bench.stack import cpu_seconds
from harness.procs import ROOT, free_port

CHUNK = (
    b'data: {"id":"cmpl-0","object":"chat.completion.chunk",'
    b'"choices":[{"delta":{"content":" w"}}]}\n\n'
)
PACE_S = 0.005
CLIENTS = 32


async def _source(port: int) -> None:
    async def send(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tokens = int((await reader.readline()).strip() or b"0")
        for _ in range(tokens):
            writer.write(CHUNK)
            await writer.drain()
            await asyncio.sleep(PACE_S)
        writer.close()

    server = await asyncio.start_server(send, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def _relay(port: int, upstream: int) -> None:
    async def forward(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.readline()
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream)
        up_writer.write(first)
        while data := await up_reader.read(65536):
            writer.write(data)
            await writer.drain()
        up_writer.close()
        writer.close()

    server = await asyncio.start_server(forward, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


async def _clients(port: int, tokens: int, connections: int) -> int:
    """`connections` streams of `tokens` chunks, CLIENTS at a time; bytes received."""
    gate = asyncio.Semaphore(CLIENTS)

    async def one() -> int:
        async with gate:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"%d\n" % tokens)
            got = len(await reader.read(-1))
            writer.close()
            return got

    return sum(await asyncio.gather(*(one() for _ in range(connections))))


@contextlib.contextmanager
def _process(*args: str) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.floor", *args],
        cwd=ROOT,
        stderr=subprocess.DEVNULL,  # asyncio's "Task was destroyed" lines on SIGTERM
    )
    try:
        yield proc
    finally:
        proc.terminate()
        proc.wait(10)


def _wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def measure(connections: int = 96) -> dict[str, Any]:
    """Relay CPU per chunk (us) and per connection at 8 and 128 chunks."""
    source_port, relay_port = free_port(), free_port()
    while relay_port == source_port:
        relay_port = free_port()
    runs: dict[str, float] = {}
    with (
        _process("source", str(source_port)),
        _process("relay", str(relay_port), str(source_port)) as relay,
    ):
        _wait_port(source_port)
        _wait_port(relay_port)
        asyncio.run(_clients(relay_port, 8, CLIENTS))  # warm-up
        for tokens in (8, 128):
            before = cpu_seconds(relay.pid)
            got = asyncio.run(_clients(relay_port, tokens, connections))
            assert got == connections * tokens * len(CHUNK), "the relay lost bytes"
            runs[str(tokens)] = (cpu_seconds(relay.pid) - before) / connections * 1e6
    return {
        "us_per_connection": runs,
        "us_per_chunk": (runs["128"] - runs["8"]) / (128 - 8),
        "connections": connections,
    }


def main(argv: list[str]) -> None:
    role, port = argv[0], int(argv[1])
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_source(port) if role == "source" else _relay(port, int(argv[2])))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        main(sys.argv[1:])
    else:
        print(measure())
