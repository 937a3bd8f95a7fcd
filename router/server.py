"""`kvbaton serve`: the router app on Hypercorn, with graceful shutdown on SIGTERM/SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from hypercorn.asyncio import serve
from hypercorn.config import Config

from router.app import create_app
from router.config import ConfigError, Settings, load_settings
from router.discovery import StartupError, preflight
from router.logs import setup_logging
from router.tracing import setup_tracing


def hypercorn_config(settings: Settings) -> Config:
    config = Config()
    config.bind = [f"{settings.host}:{settings.port}"]
    config.graceful_timeout = settings.shutdown_grace
    config.keep_alive_timeout = 75.0
    config.accesslog = None
    # Hypercorn's messages go through the root handler, in the chosen --log-format.
    config.errorlog = logging.getLogger("hypercorn.error")
    config.loglevel = settings.log_level.upper()
    return config


async def run(settings: Settings) -> None:
    stop = asyncio.Event()
    await preflight(settings)
    app = create_app(settings)

    def on_signal() -> None:
        # Refuse new turns with 503 at once; Hypercorn lets in-flight streams finish within
        # --shutdown-grace seconds, then closes.
        svc = getattr(app.state, "services", None)
        if svc is not None:
            svc.stopping = True
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal)
    stop_tracing = setup_tracing(settings.otel_endpoint)
    try:
        await serve(app, hypercorn_config(settings), shutdown_trigger=stop.wait)  # type: ignore[arg-type]
    finally:
        stop_tracing()


def serve_main(argv: Sequence[str]) -> int:
    try:
        settings = load_settings(argv)
    except ConfigError as exc:
        print(f"kvbaton serve: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    try:
        asyncio.run(run(settings))
    except StartupError as exc:
        print(f"kvbaton serve: {exc}", file=sys.stderr)
        return 1
    return 0
