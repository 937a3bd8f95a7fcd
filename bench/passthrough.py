"""The floor of the stack the design names, for one turn: Hypercorn + Starlette + aiohttp
passing a request through P and D with nothing else: no Redis, no session, no verification,
no parsing of D's answer, no metrics or logs.

Run as `python -m bench.passthrough PORT P_URL D_URL [uvloop|asyncio]`. A chat request goes to P
(`stream: false`, `max_tokens: 1`, the null handoff), then to D with P's
`kv_transfer_params`; D's JSON body is returned as it came, D's SSE bytes relayed as they
arrive (Starlette's StreamingResponse). kvbaton's added latency minus this one's is what
the router's own work costs; this one's is what any router on this stack pays.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
from hypercorn.asyncio import serve
from hypercorn.config import Config
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from router.connectors.nixl.params import miss_params
from router.http.server import event_loop_factory

JSON = {"Content-Type": "application/json"}


def build_app(p_url: str, d_url: str) -> Starlette:
    session: aiohttp.ClientSession | None = None

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        nonlocal session
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0)
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        async with session:
            yield

    async def health(_: Request) -> Response:
        return Response(b"", 200)

    async def chat(request: Request) -> Response:
        assert session is not None
        body: dict[str, Any] = msgspec.json.decode(await request.body())
        body.pop("conversation_id", None)
        p_body = {k: v for k, v in body.items() if k != "stream_options"}
        p_body.update(stream=False, max_tokens=1, kv_transfer_params=miss_params())
        async with session.post(
            p_url + "/v1/chat/completions", data=msgspec.json.encode(p_body), headers=JSON
        ) as p_resp:
            params = msgspec.json.decode(await p_resp.read()).get("kv_transfer_params")
        body["kv_transfer_params"] = params
        d_resp = await session.post(
            d_url + "/v1/chat/completions", data=msgspec.json.encode(body), headers=JSON
        )
        if not body.get("stream"):
            async with d_resp:
                raw = await d_resp.read()
            return Response(raw, d_resp.status, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            async with d_resp:
                while chunk := await d_resp.content.readany():
                    yield chunk

        return StreamingResponse(relay(), d_resp.status, media_type="text/event-stream")

    return Starlette(
        routes=[
            Route("/health", health),
            Route("/v1/chat/completions", chat, methods=["POST"]),
        ],
        lifespan=lifespan,
    )


async def main(port: int, p_url: str, d_url: str) -> None:
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.keep_alive_timeout = 75.0
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(build_app(p_url, d_url), config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]


if __name__ == "__main__":
    # The same event loop as kvbaton's (--event-loop, uvloop by default), so that the floor
    # and the router differ only by what the router does.
    loop = event_loop_factory(sys.argv[4] if len(sys.argv) > 4 else "uvloop")
    with asyncio.Runner(loop_factory=loop) as runner:
        runner.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
