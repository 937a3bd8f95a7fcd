"""The Starlette app factory: routes, the lifespan that opens and closes every connection,
and the one place where errors become OpenAI-format responses."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Mount, Route

from router.config import Settings
from router.engines import registry as registry
from router.engines.client import Upstream, UpstreamFailure
from router.engines.discovery import discover
from router.engines.dns import Resolver
from router.engines.pool import Pool, health_loop
from router.errors import RouterError, Unavailable, error_body, error_bytes
from router.http.admin import admin_app, open_operations
from router.http.disconnect import until_disconnect
from router.http.seeds import add_instance as seeds_add_instance
from router.http.status import status
from router.metrics import CONTENT_TYPE, Metrics
from router.services import Services, StoreGuard
from router.tracing import span
from router.turn.incoming import Api, read_incoming
from router.turn.prefill import PATHS
from router.turn.run import new_request_id, run_turn
from sessions.memory_store import MemorySessionStore
from sessions.redis_store import RedisSessionStore
from sessions.store import SessionStore, StoreError

log = logging.getLogger("kvbaton.app")

# With several workers, how often each one writes its in-flight counts for the others' scrapes.
PUBLISH_INTERVAL = 1.0


def make_store(settings: Settings) -> SessionStore:
    if settings.session_store == "memory":
        return MemorySessionStore()
    return RedisSessionStore(
        settings.redis_url,
        socket_timeout=settings.store_timeout,
        connect_timeout=settings.store_timeout,
    )


def services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


def error_response(exc: RouterError, request_id: str = "") -> Response:
    headers = {"X-Request-Id": request_id or new_request_id(), "X-KV-Reuse": "skip;reason=error"}
    return Response(error_bytes(exc), exc.status, headers=headers, media_type="application/json")


def turn_endpoint(api: Api) -> Callable[[Request], Any]:
    route = request_route(api)

    async def endpoint(request: Request) -> Response:
        svc = services(request)
        try:
            if svc.stopping:
                raise Unavailable("the router is shutting down")
            raw = await request.body()
            inc = read_incoming(
                raw,
                request.headers,
                api=api,
                model=svc.model,
                max_bytes=svc.settings.max_body_bytes,
                tenant_header=svc.settings.tenant_header,
            )
            with span("kvbaton.request", route=route):
                response = await until_disconnect(request, run_turn(svc, inc))
        except RouterError as exc:
            svc.metrics.requests.labels(route, str(exc.status)).inc()
            return error_response(exc, new_request_id())
        svc.metrics.requests.labels(route, str(response.status_code)).inc()
        return response

    return endpoint


def request_route(api: Api) -> str:
    return PATHS[api]


async def metrics_endpoint(request: Request) -> Response:
    return Response(services(request).metrics.render(), 200, media_type=CONTENT_TYPE)


async def models(request: Request) -> Response:
    svc = services(request)
    if svc.stopping:
        return error_response(Unavailable("the router is shutting down"))
    last = "no instance is healthy"
    for inst in svc.pool.instances("decode") + svc.pool.instances("prefill"):
        if not inst.usable:
            continue
        try:
            status, raw = await svc.upstream.get(
                inst.url + "/v1/models", timeout=svc.settings.connect_timeout + 5
            )
        except UpstreamFailure as exc:
            last = str(exc)
            continue
        if status == 200:
            return Response(raw, 200, media_type="application/json")
        last = f"{inst.url} answered {status}"
    raise Unavailable(f"cannot list models: {last}")


async def health(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


async def ready(request: Request) -> Response:
    """Ready when the store answers (or is not needed) and each role has a usable instance."""
    svc = services(request)
    checks: dict[str, Any] = {}
    try:
        await svc.store.ping()
        checks["store"] = "ok"
    except StoreError as exc:
        checks["store"] = f"unavailable: {exc}"
    for role in ("prefill", "decode"):
        usable = [i.url for i in svc.pool.instances(role) if i.usable]
        checks[role] = {"usable": len(usable), "total": len(svc.pool.instances(role))}
    ok = (
        checks["store"] == "ok"
        and checks["prefill"]["usable"] > 0
        and checks["decode"]["usable"] > 0
        and not svc.stopping
    )
    checks["status"] = "ready" if ok else "not ready"
    return Response(msgspec.json.encode(checks), 200 if ok else 503, media_type="application/json")


async def on_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own 404/405 (unknown path, wrong method), in the OpenAI error format."""
    assert isinstance(exc, HTTPException)
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    body = error_body(f"{request.method} {request.url.path}: {exc.detail}", kind, exc.status_code)
    return Response(body, exc.status_code, headers=exc.headers, media_type="application/json")


async def on_router_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RouterError)
    return error_response(exc)


async def on_unexpected(request: Request, exc: Exception) -> Response:
    # The one place an unexpected error becomes a 500, and only before a response started.
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return Response(
        error_body("internal router error", "internal_error", 500),
        500,
        headers={"X-Request-Id": new_request_id()},
        media_type="application/json",
    )


def create_app(
    settings: Settings, *, store: SessionStore | None = None, resolver: Resolver | None = None
) -> Starlette:
    """The router app. The lifespan checks the engines, opens Redis and the HTTP pool.
    `resolver` answers --resolve-dns look-ups (the system's by default)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        upstream = Upstream(settings)
        await upstream.open()
        session_store = store or make_store(settings)
        pool = Pool(settings.prefill, settings.decode, settings.unhealthy_after)
        guard = StoreGuard(settings.store_retry_after)
        metrics = Metrics(pool, lambda: guard.is_open, shared=settings.workers > 1)
        guard.on_failure = metrics.store_errors.inc
        svc = Services(settings, upstream, pool, session_store, guard, metrics)
        prober: asyncio.Task[None] | None = None
        publisher: asyncio.Task[None] | None = None
        ops = open_operations(svc, resolver)
        syncing: asyncio.Task[None] | None = None
        try:
            await discover(svc)
            app.state.services = svc
            app.state.operations = ops
            syncing = await registry.start(ops.syncer, settings.health_interval)
            prober = asyncio.create_task(health_loop(pool, upstream, settings.health_interval))
            if metrics.published is not None:
                publisher = asyncio.create_task(metrics.published.every(PUBLISH_INTERVAL))
            yield
        finally:
            svc.stopping = True
            for task in (prober, publisher):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if syncing is not None:
                await registry.stop(syncing)
            await ops.close()
            await session_store.close()
            await upstream.close()

    routes = [
        Route("/v1/chat/completions", turn_endpoint("chat"), methods=["POST"]),
        Route("/v1/completions", turn_endpoint("completions"), methods=["POST"]),
        Route("/v1/responses", turn_endpoint("responses"), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/ready", ready, methods=["GET"]),
        Route("/metrics", metrics_endpoint, methods=["GET"]),
        Route("/status", status, methods=["GET"]),
        Route("/instances/add", seeds_add_instance, methods=["POST"]),
        Mount("/admin", app=admin_app(settings.admin_key)),
    ]
    return Starlette(
        routes=routes,
        lifespan=lifespan,
        exception_handlers={
            RouterError: on_router_error,
            HTTPException: on_http_error,
            Exception: on_unexpected,
        },
    )
