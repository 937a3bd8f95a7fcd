"""The Starlette app factory: routes, the lifespan that opens and closes every connection,
and the one place where errors become OpenAI-format responses."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
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
from router.connectors.legs.decode import send as send_decode
from router.connectors.select import select
from router.engines.client import Upstream
from router.engines.dns import DnsExpander, Resolver, SystemResolver
from router.engines.kv_watch import KvEvents, parse_sources
from router.engines.pool import Pool
from router.errors import (
    ClientGone,
    RouterError,
    Unavailable,
    UpstreamFailure,
    error_body,
    error_bytes,
)
from router.http import conversations, responses
from router.http.admin import Operations, admin_app
from router.http.body import read_body
from router.http.disconnect import CLIENT_CLOSED, until_disconnect
from router.http.seeds import add_instance as seeds_add_instance
from router.http.status import status
from router.lifecycle import pin_sweep, registry
from router.lifecycle.advice import store_guard
from router.lifecycle.discovery import discover, learn_late
from router.lifecycle.health import health_loop
from router.metrics import CONTENT_TYPE, Metrics
from router.services import Services
from router.tracing import span
from router.turn import responses_chain
from router.turn.incoming import Accepts, Api, read_incoming
from router.turn.outcomes import Reason, Reuse
from router.turn.rewrite import PATHS
from router.turn.run import new_request_id, run_turn
from sessions.backend import open_backend
from sessions.store import StoreError, StoreRefused

log = logging.getLogger("kvbaton.app")

# With several workers, how often each one writes its in-flight counts for the others' scrapes.
PUBLISH_INTERVAL = 1.0

# At shutdown, how long the releases still queued may take (each is one P request).
RELEASE_DRAIN_S = 5.0


def services(request: Request) -> Services:
    svc: Services = request.app.state.services
    return svc


def error_response(exc: RouterError, request_id: str = "") -> Response:
    """The one place a RouterError becomes a response: OpenAI's error body, and the request id
    the turn sent to the engines and logged (a fresh one when no turn had begun)."""
    headers = {
        "X-Request-Id": request_id or new_request_id(),
        "X-KV-Reuse": Reuse.miss(Reason.ERROR).header(),
    }
    return Response(error_bytes(exc), exc.status, headers=headers, media_type="application/json")


def turn_endpoint(api: Api) -> Callable[[Request], Any]:
    route = request_route(api)

    async def endpoint(request: Request) -> Response:
        svc = services(request)
        # One id for the whole request: P, D, the turn's log line and the response, errors too.
        # (already set when the request's framing failed: router/http/framing.py answered)
        request_id = getattr(request.state, "request_id", "") or new_request_id()
        request.state.request_id = request_id
        try:
            if svc.stopping:
                raise Unavailable("the router is shutting down")
            settings = svc.settings
            raw = await read_body(request, settings.max_body_bytes, settings.body_timeout)
            accepts = Accepts(
                model=svc.model,
                max_bytes=settings.max_body_bytes,
                tenant_header=settings.tenant_header,
                max_model_len=svc.max_model_len,
                keep_responses=settings.response_ttl > 0,
            )
            inc = read_incoming(raw, request.headers, api, accepts)
            if api == "responses":
                inc = await responses_chain.expand(svc, inc)
            with span("kvbaton.request", route=route):
                response = await until_disconnect(request, run_turn(svc, inc, request_id))
        except RouterError as exc:
            svc.metrics.requests.labels(route, str(exc.status)).inc()
            return error_response(exc, request_id)
        except ClientGone as exc:  # nobody to answer: one line, no traceback
            log.info("request %s: body not read: %s", request_id, exc)
            svc.metrics.requests.labels(route, str(CLIENT_CLOSED)).inc()
            return Response(status_code=CLIENT_CLOSED)
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
            status, raw = await svc.engines.get(
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
    """Ready while each role has a usable instance: turns are served. A store that does not
    answer leaves the router ready but degraded (turns run without reuse; docs/operations.md).
    The ping goes past the store breaker and closes it when the store answers."""
    svc = services(request)
    checks: dict[str, Any] = {}
    try:
        await svc.guard.ping(svc.store)
        checks["store"] = "ok"
    except StoreRefused as exc:  # it answers, but not to the router's scripts: reuse is off
        checks["store"] = f"refused: {exc}"
    except StoreError as exc:
        checks["store"] = f"unavailable: {exc}"
    for role in ("prefill", "decode"):
        usable = [i.url for i in svc.pool.instances(role) if i.usable]
        checks[role] = {"usable": len(usable), "total": len(svc.pool.instances(role))}
    ok = checks["prefill"]["usable"] > 0 and checks["decode"]["usable"] > 0 and not svc.stopping
    checks["degraded"] = checks["store"] != "ok"
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
    return error_response(exc, _request_id(request))


async def on_unexpected(request: Request, exc: Exception) -> Response:
    # The one place an unexpected error becomes a 500, and only before a response started:
    # one line per failed request; the traceback at debug level only (a RecursionError's
    # would be thousands of lines).
    log.error(
        "unexpected error on %s %s (request %s): %s: %.200s",
        request.method,
        request.url.path,
        _request_id(request) or "-",
        type(exc).__name__,
        exc,
    )
    log.debug("traceback of the error above", exc_info=exc)
    return Response(
        error_body("internal router error", "internal_error", 500),
        500,
        headers={"X-Request-Id": _request_id(request) or new_request_id()},
        media_type="application/json",
    )


def _request_id(request: Request) -> str:
    """The id the endpoint gave this request, if it got that far."""
    return str(getattr(request.state, "request_id", ""))


def create_app(settings: Settings, *, resolver: Resolver | None = None) -> Starlette:
    """The router app. The lifespan checks the engines, opens Redis (one client for the
    session store, the instance registry and the conversation index) and the HTTP pool.
    `resolver` answers --resolve-dns look-ups (the system's by default)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        upstream = Upstream(settings)
        await upstream.open()
        backend = open_backend(
            settings.session_store, settings.redis_url, store_timeout=settings.store_timeout
        )
        pool = Pool(
            settings.prefill,
            settings.decode,
            settings.unhealthy_after,
            settings.pin_high_water,
            settings.pin_low_water,
        )
        guard = store_guard(settings)  # names Redis by its URL and flag when it is down
        metrics = Metrics(pool, lambda: guard.is_open, shared=settings.workers > 1)
        guard.on_failure = metrics.store_errors.inc
        connector = select(settings)
        svc = Services(settings, upstream, pool, backend.store, guard, metrics, connector)
        svc.responses = backend.responses
        svc.open_decode = send_decode  # the turn sends D's leg beside the claim with it
        engine_urls = (*settings.prefill, *settings.decode)
        svc.kv_events = KvEvents(
            parse_sources(
                settings.kv_events, settings.kv_events_port, engine_urls, settings.kv_events_topic
            ),
            settings.kv_index_max_blocks,
            clock=svc.clock,
        )
        metrics.watch_kv_events(svc.kv_events)
        prober: asyncio.Task[None] | None = None
        publisher: asyncio.Task[None] | None = None
        watcher: asyncio.Task[None] | None = None
        dns = DnsExpander(resolver or SystemResolver()) if settings.resolve_dns else None
        syncer = registry.Syncer(svc, backend.registry, dns)
        ops = Operations(syncer, backend.conversations)
        syncing: asyncio.Task[None] | None = None
        background: list[asyncio.Task[None]] = []  # the connector's (registration), the sweep
        svc.releaser = pin_sweep.releaser(svc)
        try:
            await guard.check(backend.store)  # Redis down: said once, now, with the flag
            await discover(svc)
            app.state.services = svc
            app.state.operations = ops
            syncing = await registry.start(ops.syncer, settings.health_interval)
            background = [asyncio.create_task(c) for c in connector.start(syncer.resync)]
            if svc.releaser is not None:
                svc.releaser.start()
                background.append(asyncio.create_task(pin_sweep.sweep_loop(svc)))
            svc.kv_events.start()
            # Engines that did not answer at start: their model and block size when they do.
            learn = functools.partial(learn_late, svc) if settings.check_models else None
            prober = asyncio.create_task(
                health_loop(pool, upstream, settings.health_interval, learn)
            )
            # While the store breaker is open, ping the store so reuse resumes when it is back.
            watcher = asyncio.create_task(guard.watch(backend.store, settings.health_interval))
            if metrics.published is not None:
                publisher = asyncio.create_task(metrics.published.every(PUBLISH_INTERVAL))
            # What start-up made lives as long as the process: moved out of the collector's
            # sight, so that its collections walk only what turns made since (1.5% fewer
            # instructions per turn on hits, python -m tools.instructions).
            gc.collect()
            gc.freeze()
            yield
        finally:
            svc.stopping = True
            for task in (prober, publisher, watcher, *background):
                if task is not None:
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            if syncing is not None:
                await registry.stop(syncing)
            # The turns' commits and pin-index writes still in flight finish before Redis
            # closes; then the releases they queued go out (a handle dropped here stays
            # pinned on D for its whole TTL), within RELEASE_DRAIN_S.
            await asyncio.gather(*svc.background, return_exceptions=True)
            if svc.releaser is not None:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(RELEASE_DRAIN_S):
                        await svc.releaser.drain()
                await svc.releaser.stop()
            await svc.kv_events.stop()
            await backend.close()
            await upstream.close()

    routes = [
        Route("/v1/chat/completions", turn_endpoint("chat"), methods=["POST"]),
        Route("/v1/completions", turn_endpoint("completions"), methods=["POST"]),
        Route("/v1/responses", turn_endpoint("responses"), methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/conversations/{conversation_id:path}", conversations.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}", responses.get, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/input_items", responses.input_items, methods=["GET"]),
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
