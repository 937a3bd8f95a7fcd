"""MoRI-IO registration (`--moriio-register tcp://HOST:PORT`): the router binds a ZMQ ROUTER
socket, as vLLM's moriio_toy_proxy_server.py does, and each MoRI-IO instance's DEALER sends a
msgpack map `{type: "P"|"D", http_address, zmq_address, dp_size, tp_size, transfer_mode}`
again and again. An announced instance joins the pool through the registry's sync (admitted
like an admin add); one not heard from for `--moriio-register-ttl` seconds is dropped. The
first announcement fixes the transfer mode (READ or WRITE); one with another mode is refused."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import msgspec

from router.connectors.moriio.params import valid_zmq_address
from router.engines.pool import Role

log = logging.getLogger("kvbaton.announce")

MODES = ("READ", "WRITE")


@dataclass
class Peer:
    role: Role
    url: str
    zmq_address: str
    dp_size: int
    tp_size: int
    transfer_mode: str
    last_seen: float


def _size(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def parse(msg: object, now: float) -> Peer | str:
    """An announcement as a Peer, or why it is refused ("HELLO" pings are refused quietly)."""
    if not isinstance(msg, dict):
        return "not a map"
    kind = msg.get("type")
    if kind not in ("P", "D"):
        return f"type {kind!r} is not P or D"
    http, zmq_address = msg.get("http_address"), msg.get("zmq_address")
    dp, tp, mode = _size(msg.get("dp_size")), _size(msg.get("tp_size")), msg.get("transfer_mode")
    if not isinstance(http, str) or not http:
        return "no http_address"
    if not valid_zmq_address(zmq_address):
        return f"zmq_address {zmq_address!r} is not host:IP,handshake:PORT,notify:PORT"
    if not dp or not tp:
        return "dp_size and tp_size must be positive integers"
    if mode not in MODES:
        return f"transfer_mode {mode!r} is not READ or WRITE"
    url = http.rstrip("/") if "://" in http else f"http://{http.rstrip('/')}"
    role: Role = "prefill" if kind == "P" else "decode"
    return Peer(role, url, str(zmq_address), dp, tp, str(mode), now)


@dataclass
class Peers:
    """The instances heard from, by URL; what the turn asks about a MoRI-IO instance."""

    ttl: float
    clock: Callable[[], float] = time.monotonic
    mode: str = ""
    by_url: dict[str, Peer] = field(default_factory=dict)
    refused: dict[str, str] = field(default_factory=dict)

    def note(self, peer: Peer) -> bool:
        """Record an announcement; True when it changes who is in the pool."""
        if self.mode and peer.transfer_mode != self.mode:
            why = f"transfer_mode {peer.transfer_mode}, the others announced {self.mode}"
            if self.refused.get(peer.url) != why:
                log.warning("not adding %s: %s", peer.url, why)
            self.refused[peer.url] = why
            return False
        self.mode = self.mode or peer.transfer_mode
        old = self.by_url.get(peer.url)
        self.by_url[peer.url] = peer
        return old is None or old.role != peer.role

    def expire(self) -> bool:
        """Forget those silent for longer than the ttl; True if any went."""
        cutoff = self.clock() - self.ttl
        gone = [url for url, p in self.by_url.items() if p.last_seen < cutoff]
        for url in gone:
            log.info("dropping %s instance %s: no announcement for %ss", "MoRI-IO", url, self.ttl)
            del self.by_url[url]
        return bool(gone)

    def urls(self, role: Role) -> tuple[str, ...]:
        return tuple(p.url for p in self.by_url.values() if p.role == role)

    def of(self, url: str) -> Peer | None:
        return self.by_url.get(url)

    def status(self) -> list[dict[str, Any]]:
        now = self.clock()
        return [{**asdict(p), "age_s": round(now - p.last_seen, 3)} for p in self.by_url.values()]


async def listen(endpoint: str, peers: Peers, changed: Callable[[], Awaitable[None]]) -> None:
    """Receive announcements on a bound ROUTER socket until cancelled; `changed` re-syncs."""
    import zmq
    import zmq.asyncio

    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    log.info("MoRI-IO registration listening on %s", endpoint)
    sweeper = asyncio.create_task(_sweep(peers, changed))
    try:
        while True:
            frames = await sock.recv_multipart()
            await _received(frames[-1], peers, changed)
    finally:
        sweeper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await sweeper
        sock.close()


async def _received(raw: bytes, peers: Peers, changed: Callable[[], Awaitable[None]]) -> None:
    try:
        msg = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        log.warning("MoRI-IO registration: a message that is not msgpack")
        return
    peer = parse(msg, peers.clock())
    if isinstance(peer, str):
        if isinstance(msg, dict) and msg.get("type") != "HELLO":
            log.warning("MoRI-IO registration refused: %s", peer)
        return
    if peers.note(peer):
        log.info("MoRI-IO %s instance %s announced (%s)", peer.role, peer.url, peer.transfer_mode)
        await changed()


async def _sweep(peers: Peers, changed: Callable[[], Awaitable[None]]) -> None:
    while True:
        await asyncio.sleep(max(peers.ttl / 4, 0.05))
        if peers.expire():
            await changed()
