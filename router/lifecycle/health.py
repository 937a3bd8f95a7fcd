"""Health probing: every interval, re-admit ejected instances whose /health answers again, and
read each D's process start time so that a restart is seen within one interval, and its
scheduler's request count (the decode plan's load limit counts other routers' requests too);
each engine's vLLM version (`GET /version`) while it is not known (at start, after a restart,
and every interval for a P, whose restarts nothing else shows)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import msgspec

from router.engines.client import EngineClient
from router.engines.metrics_read import read_started
from router.engines.pool import Instance, Pool
from router.engines.versions import READY_PATH, parse
from router.errors import UpstreamFailure

log = logging.getLogger("kvbaton.backends")


async def read_version(engines: EngineClient, inst: Instance, timeout: float) -> None:
    """The engine's vLLM version from GET /version; unchanged when it does not answer (an
    engine without the route, or down: its version stays as known)."""
    try:
        status, raw = await engines.get(inst.url + "/version", timeout=timeout)
        body = msgspec.json.decode(raw) if status == 200 else None
    except (UpstreamFailure, msgspec.DecodeError):
        return
    version = parse(body)
    if version:
        inst.ident.note_version(version)
    if inst.role == "decode" and inst.ident.parks is None:
        await read_parks(engines, inst, timeout)


async def read_parks(engines: EngineClient, inst: Instance, timeout: float) -> None:
    """Whether a D serves vllm#51919's /v1/pd_kv_ready: an empty body is refused (400, 422)
    where it does, 404 or 405 where the route is unknown; anything else (no answer, a 5xx, a
    401 from an API key the router lacks) says neither, and is asked again later."""
    try:
        status, _ = await engines.post_json(
            inst.url + READY_PATH, {}, request_id="kvbaton-probe", timeout=timeout
        )
    except UpstreamFailure:
        return
    if status in (400, 422, 404, 405):
        inst.ident.note_parks(status in (400, 422))


async def probe(engines: EngineClient, inst: Instance, timeout: float) -> bool:
    try:
        status, _ = await engines.get(inst.url + "/health", timeout=timeout)
    except UpstreamFailure as exc:
        inst.last_error = str(exc)
        return False
    return status == 200


# An instance never inspected (it did not answer at start) is inspected before it serves:
# False keeps it out (discovery.learn_late).
Learn = Callable[[Instance], Awaitable[bool]]


async def health_loop(
    pool: Pool, engines: EngineClient, interval: float, learn: Learn | None = None
) -> None:
    while True:
        await asyncio.sleep(interval)
        await asyncio.gather(*(check(engines, inst, interval, learn) for inst in pool.instances()))


async def check(
    engines: EngineClient, inst: Instance, timeout: float, learn: Learn | None = None
) -> None:
    if not inst.healthy and await probe(engines, inst, timeout=timeout):
        if learn is not None and not inst.model and not await learn(inst):
            return
        if inst.role == "decode":  # a D back from a restart: no old handle once it is usable
            await read_started(engines, inst, timeout)
        await read_version(engines, inst, timeout)  # it may be another vLLM now
        inst.healthy = True
        inst.failures = 0
        log.info("re-admitted %s instance %s", inst.role, inst.url)
    elif inst.role == "decode" and inst.healthy:
        await read_started(engines, inst, timeout)
        if not inst.ident.version.version or inst.ident.parks is None:  # a restart forgot
            await read_version(engines, inst, timeout)
    elif inst.healthy:
        await read_version(engines, inst, timeout)
