"""The aiohttp app: OpenAI routes, /metrics, /tokenize, admin routes, and the lifespan.

The lifespan starts the KV side channel, the KV-events publisher and the pin sweeper.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from aiohttp import web

from vllm_sim import api, dp, handover, metrics, pause_api, push, render, shapes
from vllm_sim.blocks import CacheEvent, Cleared, Removed, Stored
from vllm_sim.clock import SimClock
from vllm_sim.config import SimSettings
from vllm_sim.engine import Engine
from vllm_sim.errors import ApiError
from vllm_sim.events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventPublisher
from vllm_sim.faults import Faults
from vllm_sim.kvchannel import side_channel_app
from vllm_sim.responses import ResponsesRoute
from vllm_sim.serving import GenerationRoutes, json_response, require_json

logger = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class Sim:
    """Everything one simulated instance owns; held by the app, no module globals."""

    def __init__(self, settings: SimSettings, clock: SimClock | None = None) -> None:
        self.settings = settings
        self.clock = clock or SimClock()
        self.faults = Faults()
        self.publisher = KVEventPublisher(
            port=settings.kv_events_port,
            replay_port=settings.kv_events_replay_port,
            topic=settings.kv_events_topic,
            host=settings.host if settings.host not in ("", "0.0.0.0", "::") else "127.0.0.1",
        )
        self.ranks = dp.Ranks(
            [
                Engine(r, kv_port=r.kv_port, clock=self.clock, on_events=self._publish)
                for r in (
                    dp.rank_settings(settings, rank)
                    for rank in range(max(1, settings.data_parallel_size))
                )
            ]
        )
        self.engine = self.ranks.engines[0]  # rank 0: /sim/state's engine fields
        self.routes = GenerationRoutes(self.ranks, self.faults)
        self.responses = ResponsesRoute(self.ranks, self.faults)
        self.started = time.time()  # process_start_time_seconds
        self.created = int(self.started)
        # vLLM's session identity as the last generation requests carried it (/sim/state).
        self.sessions: collections.deque[dict[str, Any]] = collections.deque(maxlen=64)

    def _publish(self, events: list[CacheEvent]) -> None:
        bs = self.settings.block_size
        out: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        for e in events:
            if isinstance(e, Stored):
                out.append(BlockStored(e.block_hashes, e.parent_block_hash, e.token_ids, bs))
            elif isinstance(e, Removed):
                out.append(BlockRemoved(e.block_hashes))
            elif isinstance(e, Cleared):
                out.append(AllBlocksCleared())
        self.publisher.publish(out)

    async def lifespan(self, _: web.Application) -> AsyncIterator[None]:
        s = self.settings
        async with contextlib.AsyncExitStack() as stack:
            for engine in self.ranks.engines:
                await self._side_channel(stack, engine, s.host)
            self.publisher.start()
            stack.callback(self.publisher.close)
            if self.engine.store is not None:
                stack.callback(self.engine.store.close)
            sweeper = asyncio.create_task(self._sweep_forever())
            stack.push_async_callback(_cancel, sweeper)
            yield

    @staticmethod
    async def _side_channel(stack: contextlib.AsyncExitStack, engine: Engine, host: str) -> None:
        """One rank's side channel (with push mode's routes when it pushes)."""
        await engine.channel.start()
        stack.push_async_callback(engine.channel.close)
        side_push = engine.push
        extra = (lambda app: push.add_routes(app, side_push)) if side_push is not None else None
        side = web.AppRunner(side_channel_app(engine, extra), access_log=None, shutdown_timeout=0.5)
        await side.setup()
        stack.push_async_callback(side.cleanup)
        await web.TCPSite(side, host, engine.kv_port, backlog=1024).start()
        engine.kv_port = int(side.addresses[0][1])

    def _sweep(self) -> int:
        return sum(engine.sweep() for engine in self.ranks.engines)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.settings.sweep_interval)
            self._sweep()

    # -- routes ---------------------------------------------------------------------------

    async def health(self, _: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, _: web.Request) -> web.Response:
        s = self.settings
        return json_response(shapes.models_list(s.model, s.max_model_len, self.created))

    async def metrics(self, _: web.Request) -> web.Response:
        s = self.settings
        labels = {
            "block_size": str(s.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "num_gpu_blocks": str(s.num_blocks),
            "prefix_caching_hash_algo": "sim64",
        }
        text = metrics.render(
            self.ranks.counters(),
            self.ranks.gauges(),
            s.model,
            labels,
            self.started,
            [e.running for e in self.ranks.engines] if self.ranks.size > 1 else (),
        )
        pushing = [e.push.counters for e in self.ranks.engines if e.push is not None]
        if pushing:
            text += metrics.push_text(metrics.push_summed(pushing))
        return web.Response(text=text, content_type="text/plain", charset="utf-8")

    async def tokenize(self, request: web.Request) -> web.Response:
        require_json(request)
        body = api.decode_body(await request.read())
        tok = self.engine.tok
        ids = api.tokenize(tok, body, self.settings.model)
        strs = [tok.piece(t) for t in ids] if body.get("return_token_strs") is True else None
        return json_response(
            {
                "count": len(ids),
                "max_model_len": self.settings.max_model_len,
                "tokens": ids,
                "token_strs": strs,
            }
        )

    async def version(self, _: web.Request) -> web.Response:
        return json_response({"version": self.settings.version.version})

    async def reset_prefix_cache(self, _: web.Request) -> web.Response:
        for engine in self.ranks.engines:
            engine.reset_prefix_cache()
        return web.Response(status=200)

    async def set_faults(self, request: web.Request) -> web.Response:
        body = api.decode_body(await request.read())
        self.faults.update(body)
        return json_response(self.faults.state())

    async def get_faults(self, _: web.Request) -> web.Response:
        return json_response(self.faults.state())

    async def clear_faults(self, _: web.Request) -> web.Response:
        self.faults.clear()
        return json_response(self.faults.state())

    async def advance_clock(self, request: web.Request) -> web.Response:
        body = api.decode_body(await request.read())
        seconds = body.get("advance_s")
        if not isinstance(seconds, int | float) or isinstance(seconds, bool) or seconds < 0:
            raise ApiError("'advance_s' must be a non-negative number", param="advance_s")
        self.clock.advance(float(seconds))
        expired = self._sweep()
        return json_response({"now": self.clock(), "expired_requests": expired})

    async def state(self, _: web.Request) -> web.Response:
        e = self.engine
        s = self.settings
        body: dict[str, Any] = {
            "role": s.role,
            "vllm_version": s.version.version,
            "connector_version": e.connector_version,
            "registration_generation": e.kv.generation,
            "paused": self.ranks.pause.paused,
            "sleeping": self.ranks.pause.sleeping,
            "engine_id": e.engine_id,
            "model": s.model,
            "kv_port": e.kv_port,
            "kv_events_port": self.publisher.port,
            "kv_events_replay_port": self.publisher.replay_port,
            "now": e.now(),
            "block_size": s.block_size,
            "blocks": {
                "total": s.num_blocks,
                "free": e.pool.num_free,
                "cached": e.pool.num_cached,
                "usage": e.pool.usage,
            },
            "pins": e.pins.snapshot(),
            "running": e.running,
            "waiting": e.waiting,
            "faults": self.faults.state(),
            "parked": self.ranks.parking.ids() if self.ranks.parking is not None else [],
            "sessions": list(self.sessions),
            "settings": {k: getattr(s, k) for k in s.__struct_fields__ if k != "api_key"},
            # --data-parallel-size: each rank's engine id, side channel and prefix cache.
            "ranks": [
                {
                    "rank": rank,
                    "engine_id": r.engine_id,
                    "kv_port": r.kv_port,
                    "cached_blocks": r.pool.num_cached,
                    "prefix_cache_hits": r.counters.prefix_cache_hits,
                    "prompt_tokens": r.counters.prompt_tokens,
                    "reads_served": r.counters.sim_reads_served,
                }
                for rank, r in enumerate(self.ranks.engines)
            ],
        }
        return json_response(body)


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


# vLLM's instrumentator leaves these out of http_requests_total.
_NOT_INSTRUMENTED = frozenset(("/metrics", "/health", "/load", "/ping", "/version", "/server_info"))


def _middlewares(sim: Sim) -> list[Any]:
    api_key = sim.settings.api_key

    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        if (
            api_key is not None
            and request.path.startswith("/v1")
            and request.headers.get("Authorization") != f"Bearer {api_key}"
        ):
            return json_response({"error": "Unauthorized"}, status=401)
        try:
            return await handler(request)
        except ApiError as exc:
            return json_response(exc.body(), status=exc.status)

    counts = sim.engine.counters.http_requests

    @web.middleware
    async def count(request: web.Request, handler: Handler) -> web.StreamResponse:
        # As vLLM's instrumentator: per route template, method and status class.
        if request.path in _NOT_INSTRUMENTED:
            return await handler(request)
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        finally:
            route = request.match_info.route.resource
            path = route.canonical if route is not None else "none"
            key = (path, request.method, f"{status // 100}xx")
            counts[key] = counts.get(key, 0) + 1

    @web.middleware
    async def sessions(request: web.Request, handler: Handler) -> web.StreamResponse:
        # What a proxy forwarded of vLLM's session identity: the X-Session-ID header and
        # the `session_id` body field (read here; aiohttp keeps the body for the handler).
        if request.method == "POST" and request.path.startswith("/v1/"):
            raw = await request.read()
            field: Any = None
            if b"session_id" in raw:
                with contextlib.suppress(ApiError):
                    field = api.decode_body(raw).get("session_id")
            sim.sessions.append(
                {
                    "path": request.path,
                    "header": request.headers.get("X-Session-ID"),
                    "body": field,
                }
            )
        return await handler(request)

    return [count, errors, sessions]


def build_app(sim: Sim) -> web.Application:
    app = web.Application(middlewares=_middlewares(sim), client_max_size=64 * 1024 * 1024)
    app.cleanup_ctx.append(sim.lifespan)
    r = app.router
    r.add_post("/v1/chat/completions", sim.routes.chat)
    r.add_post("/v1/completions", sim.routes.completions)
    r.add_post("/v1/responses", sim.responses.create)
    r.add_get("/v1/models", sim.models)
    r.add_get("/health", sim.health)
    r.add_get("/metrics", sim.metrics)
    r.add_post("/tokenize", sim.tokenize)
    r.add_post("/reset_prefix_cache", sim.reset_prefix_cache)
    r.add_get("/version", sim.version)
    render.add_routes(app, sim.ranks)  # both versions (403 without --enable-scale-out)
    if sim.ranks.parking is not None:  # vllm#51919's concurrent dispatch (--pd-kv-ready)
        handover.add_route(app, sim.ranks.parking, sim.faults)
    if sim.settings.version.pause_rejects:  # vLLM 0.33 (with VLLM_SERVER_DEV_MODE=1)
        pause_api.add_routes(app, sim.ranks)
    r.add_post("/sim/faults", sim.set_faults)
    r.add_get("/sim/faults", sim.get_faults)
    r.add_delete("/sim/faults", sim.clear_faults)
    r.add_post("/sim/clock", sim.advance_clock)
    r.add_get("/sim/state", sim.state)
    return app
