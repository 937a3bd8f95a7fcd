"""`kvbaton serve`: the router app on Hypercorn, with graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hypercorn.asyncio import serve
from hypercorn.config import Config

from router.config import Settings, WorkerSlot, load_settings, worker_slot
from router.connectors.select import select
from router.errors import ConfigError, StartupError
from router.http import framing, idle
from router.http.app import create_app
from router.http.workers import supervise
from router.lifecycle.discovery import preflight
from router.logs import setup_logging
from router.relay import SERVER_SEND
from router.signing import signed
from router.tracing import setup_tracing

log = logging.getLogger("kvbaton.server")

# Seconds between a worker's checks that its supervisor is still there.
ORPHAN_CHECK_INTERVAL = 1.0


def hypercorn_config(settings: Settings, slot: WorkerSlot | None = None) -> Config:
    config = Config()
    # A worker serves the socket its supervisor opened (router/http/workers.py).
    config.bind = [f"fd://{slot.listen_fd}" if slot else f"{settings.host}:{settings.port}"]
    config.graceful_timeout = settings.shutdown_grace
    # Hypercorn's idle timer runs from a connection's opening (or the end of its previous
    # response) until a request head is complete: a header timeout and the keep-alive alike.
    config.keep_alive_timeout = settings.header_timeout
    config.accesslog = None
    # Hypercorn's messages go through the root handler, in the chosen --log-format.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.loglevel = settings.log_level.upper()
    return config


class Requests:
    """ASGI wrapper that counts the HTTP requests in progress, streamed bodies included, and
    calls `on_started` once the app's start-up (the lifespan) has completed."""

    def __init__(self, app: Any, on_started: Callable[[], None] = lambda: None) -> None:
        self.app = app
        self.active = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.on_started = on_started

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":

            async def send_lifespan(message: Any) -> None:
                await send(message)
                if message["type"] == "lifespan.startup.complete":
                    self.on_started()

            await self.app(scope, receive, send_lifespan)
            return
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        self.active += 1
        self.idle.clear()
        scope[SERVER_SEND] = send
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
            if not self.active:
                self.idle.set()


async def drain(requests: Requests, grace: float) -> float:
    """Wait until no request is in progress, at most `grace` seconds; the seconds left."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(grace):
            await requests.idle.wait()
    return max(deadline - loop.time(), 0.0)


def report_ready(slot: WorkerSlot | None) -> Callable[[], None]:
    """What a worker does once started: tell its supervisor (one byte on its pipe)."""

    def ready() -> None:
        if slot is not None:
            with contextlib.suppress(OSError):
                os.write(slot.ready_fd, b"1")
                os.close(slot.ready_fd)

    return ready


async def orphaned(parent: int) -> None:
    """Return when this worker's supervisor has gone (it was killed: nobody will stop us)."""
    while os.getppid() == parent:  # noqa: ASYNC110 (no event tells us the parent is gone)
        await asyncio.sleep(ORPHAN_CHECK_INTERVAL)


async def run(settings: Settings, slot: WorkerSlot | None = None) -> None:
    stop = asyncio.Event()
    parent = os.getppid()
    await preflight(settings)
    framing.install()  # unparseable requests get an OpenAI-format 400
    idle.install()  # a connection's idle watch on a timer, not a task per request
    app = create_app(settings)
    requests = Requests(app, report_ready(slot))
    config = hypercorn_config(settings, slot)
    draining: set[asyncio.Task[None]] = set()

    async def shut_down() -> None:
        # The listener stays open while requests in flight finish, so that a new request
        # gets a clear 503 rather than a refused connection; then Hypercorn closes, giving
        # what is left of --shutdown-grace to anything still running.
        left = await drain(requests, settings.shutdown_grace)
        config.graceful_timeout = max(left, 1.0)
        stop.set()

    def on_signal() -> None:
        svc = getattr(app.state, "services", None)
        if svc is None:  # still starting: nothing in flight
            stop.set()
            return
        if svc.stopping:  # a second signal: stop waiting, cut what is still in flight
            log.warning("second signal: closing now, %d requests cut", requests.active)
            for task in draining:
                task.cancel()
            config.graceful_timeout = 0.0
            stop.set()
            return
        svc.stopping = True  # new turns get 503 at once
        log.info(
            "shutting down: %d requests in flight, up to %.0f s (a second signal stops now)",
            requests.active,
            settings.shutdown_grace,
        )
        task = asyncio.create_task(shut_down())
        draining.add(task)
        task.add_done_callback(draining.discard)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    watch: asyncio.Task[None] | None = None
    if slot is not None:
        watch = asyncio.create_task(orphaned(parent))
        watch.add_done_callback(lambda t: None if t.cancelled() else on_signal())
    stop_tracing = setup_tracing(settings.otel_endpoint)
    try:
        await serve(requests, config, shutdown_trigger=stop.wait)
    finally:
        if watch is not None:
            watch.cancel()
        stop_tracing()


def event_loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """The loop each process runs on; None is the standard library's."""
    if name == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        raise ConfigError(
            "--event-loop uvloop needs the uvloop package (pip install uvloop), "
            "or pass --event-loop asyncio"
        ) from exc
    return uvloop.new_event_loop


def serve_main(argv: Sequence[str]) -> int:
    try:
        settings = signed(load_settings(argv))
        select(settings)  # a connector refuses settings it cannot work with, before any bind
    except ConfigError as exc:
        print(f"kvbaton serve: {exc}", file=sys.stderr)
        return 2
    try:
        slot = worker_slot()
    except ConfigError as exc:
        print(f"kvbaton serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format, slot.index if slot else None)
    if not settings.session_secrets and slot is None:  # one line, not one per worker
        log.warning(
            "sessions are unsigned (--unsigned-sessions): anyone who can write to the session "
            "store can change a stored handle and make P read wrong KV; set "
            "KVBATON_SESSION_SECRET to sign them"
        )
    if settings.workers > 1 and slot is None:
        return supervise(settings, argv)
    try:
        loop_factory = event_loop_factory(settings.event_loop)
    except ConfigError as exc:
        print(f"kvbaton serve: {exc}", file=sys.stderr)
        return 2
    try:
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(run(settings, slot))
    except StartupError as exc:
        print(f"kvbaton serve: {exc}", file=sys.stderr)
        return 1
    return 0
