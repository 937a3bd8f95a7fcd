"""A minimal Redis (RESP2) client for the shared KV store: one connection, one command at a
time, commands pipelined in one write. The simulator keeps its own client (it shares no code
with the router, whose Redis access lives in `sessions/`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

Reply = bytes | int | str | list["Reply"] | None


class RespError(Exception):
    """The server answered an error, or the connection failed or broke."""


@dataclass(frozen=True)
class Address:
    host: str
    port: int
    db: int
    password: str | None
    username: str | None


def parse_url(url: str) -> Address:
    """redis://[[user]:password@]host[:port][/db]"""
    parts = urlsplit(url)
    if parts.scheme != "redis":
        raise ValueError(f"--kv-store must be a redis:// URL, got {url!r}")
    path = parts.path.strip("/")
    return Address(
        host=parts.hostname or "127.0.0.1",
        port=parts.port or 6379,
        db=int(path) if path else 0,
        password=unquote(parts.password) if parts.password else None,
        username=unquote(parts.username) if parts.username else None,
    )


def encode(*args: bytes | str | int) -> bytes:
    out = [f"*{len(args)}\r\n".encode()]
    for arg in args:
        data = arg if isinstance(arg, bytes) else str(arg).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


async def read_reply(reader: asyncio.StreamReader) -> Reply:
    line = await reader.readline()
    if not line.endswith(b"\r\n"):
        raise RespError("connection closed by the store")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest.decode()
    if kind == b"-":
        raise RespError(rest.decode("utf-8", "replace"))
    if kind == b":":
        return int(rest)
    if kind == b"$":
        size = int(rest)
        if size < 0:
            return None
        data = await reader.readexactly(size + 2)
        return data[:-2]
    if kind == b"*":
        count = int(rest)
        if count < 0:
            return None
        return [await read_reply(reader) for _ in range(count)]
    raise RespError(f"unexpected reply {line[:40]!r}")


class RespClient:
    """Connects on first use; a failed command drops the connection (the next one redials)."""

    def __init__(self, url: str, timeout: float = 2.0) -> None:
        self.address = parse_url(url)
        self.timeout = timeout
        self._conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self._lock = asyncio.Lock()

    async def _connect(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        a = self.address
        reader, writer = await asyncio.open_connection(a.host, a.port)
        setup: list[bytes] = []
        if a.password is not None:
            auth = (a.username, a.password) if a.username else (a.password,)
            setup.append(encode("AUTH", *auth))
        if a.db:
            setup.append(encode("SELECT", a.db))
        writer.write(b"".join(setup))
        for _ in setup:
            await read_reply(reader)
        return reader, writer

    async def pipeline(self, commands: list[tuple[bytes | str | int, ...]]) -> list[Reply]:
        """Send every command in one write; their replies in order."""
        async with self._lock:
            try:
                return await asyncio.wait_for(self._run(commands), self.timeout)
            except (OSError, EOFError, TimeoutError, RespError, ValueError) as exc:
                self.close()
                raise RespError(f"{type(exc).__name__}: {exc}") from exc

    async def _run(self, commands: list[tuple[bytes | str | int, ...]]) -> list[Reply]:
        if self._conn is None:
            self._conn = await self._connect()
        reader, writer = self._conn
        writer.write(b"".join(encode(*c) for c in commands))
        await writer.drain()
        return [await read_reply(reader) for _ in commands]

    async def command(self, *args: bytes | str | int) -> Reply:
        return (await self.pipeline([args]))[0]

    def close(self) -> None:
        if self._conn is not None:
            self._conn[1].close()
            self._conn = None
