"""Every engine's KV-events subscriber and index (`--kv-events`, `--kv-events-port`),
started and stopped by the app's lifespan; what the turn asks of them."""

from __future__ import annotations

import asyncio
import contextlib
import time
import urllib.parse
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import zmq.asyncio

from router.engines.kv_events import Source, Subscriber
from router.engines.kv_index import EngineIndex
from router.errors import ConfigError


def _next_port(endpoint: str) -> str:
    """The replay endpoint by default: the next TCP port (an ipc:// path has none: no replay
    unless given, and a gap then rebuilds the index)."""
    if not endpoint.startswith("tcp://"):
        return ""
    head, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise ConfigError(f"--kv-events {endpoint!r}: expected tcp://HOST:PORT")
    return f"{head}:{int(port) + 1}"


def parse_sources(
    specs: Sequence[str], port: int, urls: Iterable[str], topic: str
) -> dict[str, Source]:
    """The engines' event sources: `URL=ENDPOINT[,REPLAY]` each (replay: the next port), and
    with `port` every other engine's own host on that port (replay on the next one)."""
    out: dict[str, Source] = {}
    for spec in specs:
        url, sep, rest = spec.partition("=")
        if not sep or not rest.startswith(("tcp://", "ipc://")):
            raise ConfigError(f"--kv-events {spec!r}: expected URL=tcp://HOST:PORT[,REPLAY]")
        endpoint, _, replay = rest.partition(",")
        url = url.strip().rstrip("/")
        url = url if "://" in url else "http://" + url
        out[url] = Source(url, endpoint, replay or _next_port(endpoint), topic)
    if port:
        for url in urls:
            if url not in out:
                host = urllib.parse.urlsplit(url).hostname or "127.0.0.1"
                host = f"[{host}]" if ":" in host else host
                endpoint = f"tcp://{host}:{port}"
                out[url] = Source(url, endpoint, f"tcp://{host}:{port + 1}", topic)
    return out


class KvEvents:
    """The subscribers, one per engine that publishes; `index(url)` is None for the others."""

    def __init__(
        self,
        sources: dict[str, Source],
        max_blocks: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._ctx = zmq.asyncio.Context()
        self._max_blocks = max_blocks
        self._clock = clock
        self.subscribers: dict[str, Subscriber] = {}
        for src in sources.values():
            self._subscriber(src)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._started = False
        self._restarts: dict[str, int] = {}

    def _subscriber(self, src: Source) -> Subscriber:
        sub = Subscriber(
            src, EngineIndex(max_blocks=self._max_blocks), self._ctx, clock=self._clock
        )
        self.subscribers[src.url] = sub
        return sub

    @property
    def enabled(self) -> bool:
        return bool(self.subscribers)

    def start(self) -> None:
        self._started = True
        self._tasks = {url: asyncio.create_task(s.run()) for url, s in self.subscribers.items()}

    def follow(self, src: Source) -> bool:
        """Subscribe to an engine added at run time (True), or keep the one it has (False)."""
        if src.url in self.subscribers:
            return False
        sub = self._subscriber(src)
        if self._started:
            self._tasks[src.url] = asyncio.create_task(sub.run())
        return True

    async def forget(self, url: str) -> None:
        """Stop following an engine that left the pool; its index goes with it."""
        self.subscribers.pop(url, None)
        self._restarts.pop(url, None)
        task = self._tasks.pop(url, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._ctx.destroy(linger=0)

    def index(self, url: str, restarts: int = 0) -> EngineIndex | None:
        """The engine's index, cleared first if the router saw the engine restart since
        (a new process start time) and its events have not said so yet."""
        sub = self.subscribers.get(url)
        if sub is None:
            return None
        if self._restarts.setdefault(url, restarts) != restarts:
            self._restarts[url] = restarts
            sub.index.clear(self._clock())
            sub.index.stale = True  # until the restarted engine's stream is seen
        return sub.index

    def note_turn(self, *urls: str) -> None:
        """A turn ran on these engines (the silence check of each one's stream)."""
        for url in urls:
            sub = self.subscribers.get(url)
            if sub is not None:
                sub.note_turn()

    def view(self) -> dict[str, Any]:
        """For /status: per engine, the endpoints, the index and the stream's counters."""
        if not self.enabled:
            return {"on": False}
        engines = {}
        for url, sub in self.subscribers.items():
            c, idx = sub.counts, sub.index
            engines[url] = {
                "endpoint": sub.source.endpoint,
                "replay": sub.source.replay,
                "in_sync": not idx.stale,
                # Why the index may not follow the engine ("" when nothing is wrong): it
                # published nothing while turns ran on it, or its replay did not answer.
                "warning": sub.warning,
                "blocks": idx.blocks,
                "block_size": idx.block_size,
                "batches": c.batches,
                "events": c.events,
                "gaps": c.gaps,
                "replayed": c.replays,
                "rebuilds": c.rebuilds,
                "last_seq": c.last_seq,
                "lag_seconds": round(c.lag, 4),
            }
        return {"on": True, "engines": engines}
