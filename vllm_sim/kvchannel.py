"""The KV side channel (NIXL's stand-in): handshake, block read and free notification.

Bodies are msgpack. A read returns whatever the blocks hold now, as an RDMA READ would.
Each producer process has its own agent name; a reader keeps the agent of an engine id from
its first handshake and never handshakes that engine id again, as vLLM's NIXL connector
keeps `_remote_agents` (measured on the vLLM CPU build: after a producer restarted with the
same engine id, every read from it failed with NIXL_ERR_REMOTE_DISCONNECT, new handles too).
Every body carries the connector version (NIXL_CONNECTOR_VERSION, in vLLM's compatibility
hash): engines of different vLLM versions refuse each other. vLLM 0.33 (version 15) also drops
the agent it keeps when a handle names a higher `remote_registration_generation`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import aiohttp
import msgspec
from aiohttp import web

_MSGPACK = "application/msgpack"


class KVSource(Protocol):
    """What a producer exposes on its side channel."""

    engine_id: str
    block_size: int
    agent: str  # this process's NIXL agent name: a restart (or a re-registration) changes it
    connector_version: int
    registered: bool  # False while asleep: its KV memory is not registered with NIXL

    def now(self) -> float: ...

    def read_blocks(self, block_ids: Sequence[int]) -> list[list[int]] | None: ...

    def release(self, request_id: str) -> bool: ...


class TransferError(Exception):
    """Handshake, read or notification failed (vLLM: a failed transfer)."""


@dataclass(frozen=True)
class Handshake:
    engine_id: str
    block_size: int
    offset: float  # remote clock minus local clock, estimated at the handshake
    agent: str

    def remote_now(self, local_now: float) -> float:
        return local_now + self.offset


def pack(obj: Any, status: int = 200) -> web.Response:
    return web.Response(body=msgspec.msgpack.encode(obj), status=status, content_type=_MSGPACK)


async def unpack(request: web.Request) -> dict[str, Any]:
    try:
        body = msgspec.msgpack.decode(await request.read())
    except msgspec.DecodeError as exc:
        raise web.HTTPBadRequest(text=f"bad msgpack: {exc}") from exc
    if not isinstance(body, dict):
        raise web.HTTPBadRequest(text="body must be a map")
    return body


def incompatible(mine: int, theirs: object) -> str:
    """vLLM's handshake error for peers of different connector versions."""
    return (
        f"NIXL compatibility hash mismatch (connector version {mine} vs {theirs}): prefill "
        "and decode instances have incompatible configurations (different vLLM versions?)"
    )


def _refused(source: KVSource, body: dict[str, Any]) -> web.Response | None:
    """Another engine, an agent of another process or registration (the reader's handshake
    was with the process before a restart or a sleep), or another connector version."""
    if body.get("connector_version") != source.connector_version:
        return pack(
            {"error": incompatible(source.connector_version, body.get("connector_version"))},
            status=409,
        )
    if not source.registered or ("agent" in body and body["agent"] != source.agent):
        return pack({"error": "NIXL_ERR_REMOTE_DISCONNECT: unknown agent"}, status=409)
    if body.get("engine_id") != source.engine_id:
        return pack({"error": "engine id mismatch"}, status=409)
    return None


def _read_refused(source: KVSource, body: dict[str, Any]) -> web.Response | None:
    """Why a block read cannot be served (None: it can)."""
    if (error := _refused(source, body)) is not None:
        return error
    if body.get("block_size") != source.block_size:
        return pack({"error": "block size mismatch"}, status=409)
    ids = body.get("block_ids")
    if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
        return pack({"error": "block_ids must be a list of ints"}, status=400)
    return None


def side_channel_app(
    source: KVSource, extra: Callable[[web.Application], None] | None = None
) -> web.Application:
    """The producer's side-channel server (`extra` adds routes: push mode's)."""

    async def handshake(_: web.Request) -> web.Response:
        return pack(
            {
                "engine_id": source.engine_id,
                "now": source.now(),
                "block_size": source.block_size,
                "agent": source.agent,
                "connector_version": source.connector_version,
            }
        )

    async def read(request: web.Request) -> web.Response:
        body = await unpack(request)
        if (error := _read_refused(source, body)) is not None:
            return error
        blocks = source.read_blocks(body["block_ids"])
        if blocks is None:
            return pack({"error": "block id out of range"}, status=400)
        notify = body.get("notify")
        if isinstance(notify, str):
            source.release(notify)
        return pack({"blocks": blocks})

    async def notify(request: web.Request) -> web.Response:
        body = await unpack(request)
        if (error := _refused(source, body)) is not None:
            return error
        request_id = body.get("request_id")
        if not isinstance(request_id, str):
            return pack({"error": "request_id must be a string"}, status=400)
        return pack({"released": source.release(request_id)})

    app = web.Application()
    app.router.add_get("/handshake", handshake)
    app.router.add_post("/read", read)
    app.router.add_post("/notify", notify)
    if extra is not None:
        extra(app)
    return app


class KVChannelClient:
    """The reader's side: one pooled aiohttp session with explicit timeouts."""

    def __init__(
        self,
        timeout: float,
        clock: Callable[[], float] = time.monotonic,
        connector_version: int = 15,
    ) -> None:
        self._timeout = aiohttp.ClientTimeout(total=timeout, connect=timeout)
        self._clock = clock
        self._session: aiohttp.ClientSession | None = None
        self._agents: dict[str, str] = {}  # engine id -> agent of its first handshake
        self._handshakes: dict[str, Handshake] = {}  # engine id -> that handshake (its clock)
        self._generations: dict[str, int] = {}  # engine id -> highest registration seen
        self.connector_version = connector_version

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(timeout=self._timeout)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def _call(self, method: str, url: str, body: Any = None) -> dict[str, Any]:
        if self._session is None:
            raise TransferError("side-channel client not started")
        data = None if body is None else msgspec.msgpack.encode(body)
        headers = {"Content-Type": _MSGPACK} if data is not None else None
        try:
            async with self._session.request(method, url, data=data, headers=headers) as resp:
                raw = await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise TransferError(f"{method} {url}: {exc!r}") from exc
        try:
            out = msgspec.msgpack.decode(raw)
        except msgspec.DecodeError as exc:
            raise TransferError(f"{method} {url}: HTTP {status}, not msgpack") from exc
        if status != 200 or not isinstance(out, dict):
            raise TransferError(f"{method} {url}: HTTP {status} {out!r:.200}")
        return out

    async def post(self, url: str, body: Any) -> dict[str, Any]:
        """One msgpack POST on a peer's side channel (push mode's registration and write)."""
        return await self._call("POST", url, body)

    async def handshake(self, host: str, port: int, engine_id: str) -> Handshake:
        t0 = self._clock()
        out = await self._call("GET", f"http://{host}:{port}/handshake")
        t1 = self._clock()
        if out.get("connector_version") != self.connector_version:
            raise TransferError(incompatible(self.connector_version, out.get("connector_version")))
        if out.get("engine_id") != engine_id:
            raise TransferError(f"engine id mismatch: want {engine_id}, got {out.get('engine_id')}")
        remote_now = out.get("now")
        block_size = out.get("block_size")
        agent = out.get("agent")
        if (
            not isinstance(remote_now, float | int)
            or not isinstance(block_size, int)
            or not isinstance(agent, str)
        ):
            raise TransferError(f"bad handshake reply {out!r:.200}")
        hs = Handshake(engine_id, block_size, float(remote_now) - (t0 + t1) / 2, agent)
        self._agents.setdefault(engine_id, agent)
        self._handshakes.setdefault(engine_id, hs)
        return hs

    async def _agent(self, host: str, port: int, engine_id: str, generation: int = 0) -> str:
        """The agent this reader knows for the engine id; an unknown one is handshaken first,
        and so is one whose handle names a newer registration (vLLM 0.33's pull worker)."""
        if generation > self._generations.get(engine_id, 0):
            self._agents.pop(engine_id, None)
            self._handshakes.pop(engine_id, None)
            self._generations[engine_id] = generation
        if engine_id not in self._agents:
            await self.handshake(host, port, engine_id)
        return self._agents[engine_id]

    async def clock(self, host: str, port: int, engine_id: str, generation: int = 0) -> Handshake:
        """The producer's handshake as this reader keeps it: vLLM measures the clock offset
        once, at the handshake, and converts every later deadline with it (vllm#47021)."""
        await self._agent(host, port, engine_id, generation)
        return self._handshakes[engine_id]

    async def read(
        self,
        host: str,
        port: int,
        engine_id: str,
        block_size: int,
        block_ids: list[int],
        notify: str | None,
        generation: int = 0,
    ) -> list[list[int]]:
        """The blocks' contents; the producer checks engine id and block size (the
        compatibility check of vLLM's handshake), then frees `notify`'s pin."""
        body = {
            "connector_version": self.connector_version,
            "engine_id": engine_id,
            "agent": await self._agent(host, port, engine_id, generation),
            "block_size": block_size,
            "block_ids": block_ids,
            "notify": notify,
        }
        out = await self._call("POST", f"http://{host}:{port}/read", body)
        blocks = out.get("blocks")
        if not isinstance(blocks, list) or len(blocks) != len(block_ids):
            raise TransferError(f"bad read reply {out!r:.200}")
        return blocks

    async def notify(
        self, host: str, port: int, engine_id: str, request_id: str, generation: int = 0
    ) -> None:
        agent = await self._agent(host, port, engine_id, generation)
        body = {
            "connector_version": self.connector_version,
            "engine_id": engine_id,
            "agent": agent,
            "request_id": request_id,
        }
        await self._call("POST", f"http://{host}:{port}/notify", body)
