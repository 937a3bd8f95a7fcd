"""`kvbaton sim` / `python -m vllm_sim`: run one simulated instance until SIGTERM or SIGINT."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

import zmq
from aiohttp import web

from vllm_sim import moriio
from vllm_sim.config import SimSettings, parse_settings
from vllm_sim.server import Sim, build_app


async def serve(settings: SimSettings) -> None:
    sim = Sim(settings)
    # A short shutdown timeout: open streams are cut rather than holding SIGTERM for a minute.
    # handler_cancellation: a client that hangs up aborts its request, as vLLM's API server
    # does (its with_cancellation / disconnect checks), instead of running it to the end.
    runner = web.AppRunner(
        build_app(sim),
        access_log=None,
        handle_signals=False,
        shutdown_timeout=0.5,
        handler_cancellation=True,
    )
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port, backlog=1024)
        await site.start()
        port = int(runner.addresses[0][1])
        events = ""
        if sim.publisher.port is not None:
            events = f", kv events port {sim.publisher.port}"
        print(
            f"vllm_sim {settings.role} ready on http://{settings.host}:{port} "
            f"(kv side channel {sim.engine.kv_port}, engine id {settings.engine_id}, "
            f"model {settings.model}{events})",
            flush=True,
        )
        announcing = _announce(settings, sim, port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        if announcing is not None:
            announcing.cancel()
    finally:
        await runner.cleanup()


def _announce(settings: SimSettings, sim: Sim, port: int) -> asyncio.Task[None] | None:
    """MoRI-IO: announce this instance to the router (vllm_sim/moriio.py)."""
    if settings.kv_connector != "moriio" or not settings.moriio_proxy:
        return None
    host = settings.side_channel_host
    return asyncio.create_task(
        moriio.announce(
            settings.moriio_proxy,
            settings.role,
            f"{host}:{port}",
            moriio.zmq_address(host, sim.engine.kv_port),
            settings.data_parallel_size,
            settings.moriio_mode,
            settings.moriio_ping_interval,
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    settings = parse_settings(sys.argv[1:] if argv is None else list(argv))
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(message)s")
    if settings.log_requests:
        logging.getLogger("vllm_sim.serving").setLevel(logging.INFO)
    try:
        asyncio.run(serve(settings))
    except (OSError, zmq.ZMQError) as exc:  # a port already in use
        print(f"vllm_sim: {exc}", file=sys.stderr)
        return 1
    return 0
