"""The floor: Hypercorn + Starlette + aiohttp passing a turn through P and D with nothing
else (no Redis, session, verification, parsing of D's answer, metrics or logs). P gets the
body with `max_tokens: 1` and the null handoff, D P's `kv_transfer_params`; D's answer is
relayed as it comes. What it adds is what any router on this stack pays.

With REDIS_URL, the *work floor*: also the I/O a hit makes kvbaton do, bare: kvbaton's claim
and commit scripts keyed by `conversation_id` (a state of kvbaton's size, computed from
nothing) and on a later turn P's `/tokenize` of the chat.

`python -m bench.passthrough PORT P_URL D_URL [uvloop|asyncio] [REDIS_URL]`
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
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
from router.turn.rewrite import prefill_body
from sessions import scripts

# kvbaton's state fields other than the handle and the block digests, at their usual sizes
# (a turn's count, engine URLs, digests, times, the MAC): ~600 bytes.
STATE_FIELDS = {f"field{i:02d}": "x" * 24 for i in range(24)}
TTL_MS = 3_600_000

JSON = {"Content-Type": "application/json"}


class WorkStore:
    """The work floor's I/O per turn (none without a Redis URL)."""

    def __init__(self, redis_url: str | None, p_url: str) -> None:
        self._p_url = p_url
        self.client: Any = None  # the plain floor: no Redis, no /tokenize
        if redis_url is not None:
            import redis.asyncio as aioredis  # only the work floor talks to Redis

            self.client = aioredis.Redis.from_url(redis_url)
            self._claim = self.client.register_script(scripts.CLAIM)
            self._commit = self.client.register_script(scripts.COMMIT)

    async def start(
        self, session: aiohttp.ClientSession, body: dict[str, Any], size: int, request_id: str
    ) -> tuple[str, int, int] | None:
        """(key, stored turn, prompt tokens) of a turn with a conversation id, else None."""
        conversation = body.get("conversation_id")
        if self.client is None or not conversation:
            return None
        key = f"floor:{conversation}"
        spent = f"floor-spent:{conversation}"  # the claim marks what it takes as spent
        fields = await self._claim(keys=[key, spent], args=[request_id, "", repr(time.time())])
        found = dict(zip(fields[::2], fields[1::2], strict=True)) if fields else {}
        turn = int(found.get(b"turn", 0))
        if not turn:
            return key, 0, size // 4
        tokenize = {"model": body.get("model"), "messages": body["messages"]}
        async with session.post(
            self._p_url + "/tokenize", data=msgspec.json.encode(tokenize), headers=JSON
        ) as resp:
            return key, turn, int(msgspec.json.decode(await resp.read()).get("count", 0))

    async def commit(self, started: tuple[str, int, int] | None, params: Any) -> None:
        if started is None:
            return
        key, turn, prompt_tokens = started
        fields = {**STATE_FIELDS, "turn": str(turn + 1)}
        fields["kv_transfer_params"] = msgspec.json.encode(params).decode()
        fields["block_digests"] = " ".join(["0123456789abcdef"] * (prompt_tokens // 16))
        flat = [x for item in fields.items() for x in item]
        await self._commit(keys=[key], args=[turn, TTL_MS, msgspec.json.encode(flat)])


def build_app(p_url: str, d_url: str, redis_url: str | None = None) -> Starlette:
    session: aiohttp.ClientSession | None = None
    store = WorkStore(redis_url, p_url)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        nonlocal session
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0)
        session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        async with session:
            yield
        if store.client is not None:
            await store.client.aclose()

    async def health(_: Request) -> Response:
        return Response(b"", 200)

    async def chat(request: Request) -> Response:
        assert session is not None
        raw_body = await request.body()
        body: dict[str, Any] = msgspec.json.decode(raw_body)
        rid = request.headers.get("x-request-id", "-")
        work = await store.start(session, body, len(raw_body), rid)  # the work floor's claim
        body.pop("conversation_id", None)
        # P's body as kvbaton builds it (one token, not streamed, what P refuses so left out).
        p_body = prefill_body(body, miss_params(), api="chat")
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
            await store.commit(work, params)
            return Response(raw, d_resp.status, media_type="application/json")

        async def relay() -> AsyncIterator[bytes]:
            async with d_resp:
                while chunk := await d_resp.content.readany():
                    yield chunk
            await store.commit(work, params)

        return StreamingResponse(relay(), d_resp.status, media_type="text/event-stream")

    routes = [Route("/health", health), Route("/v1/chat/completions", chat, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan)


async def main(port: int, p_url: str, d_url: str, redis_url: str | None = None) -> None:
    config = Config()
    config.bind, config.accesslog, config.keep_alive_timeout = [f"127.0.0.1:{port}"], None, 75.0
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(build_app(p_url, d_url, redis_url), config, shutdown_trigger=stop.wait)  # type: ignore[arg-type]


if __name__ == "__main__":
    # kvbaton's event loop (uvloop by default): the floor differs only by the router's work.
    loop = event_loop_factory(sys.argv[4] if len(sys.argv) > 4 else "uvloop")
    with asyncio.Runner(loop_factory=loop) as runner:
        redis_url = sys.argv[5] if len(sys.argv) > 5 else None
        runner.run(main(int(sys.argv[1]), sys.argv[2], sys.argv[3], redis_url))
