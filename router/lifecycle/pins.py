"""The sweep that keeps every D's pinned share bounded: each second, per D, the handles left
unread past the release delay (idle conversations, ended ones), and on a D above the pin
high-water mark the oldest handles whatever their age, are taken from the store (one replica
takes each) and released."""

from __future__ import annotations

import asyncio
import logging
import math

from router.engines.pool import Instance
from router.engines.release import Releaser
from router.services import Services
from sessions.model import SessionState
from sessions.store import StoreError

log = logging.getLogger("kvbaton.pins")

SWEEP_EVERY_S = 1.0
# Handles taken per D and sweep: idle ones, and on a D under pressure.
IDLE_BATCH = 64
PRESSURE_BATCH = 32


def releaser(svc: Services) -> Releaser | None:
    """The releaser, when the connector pins on D and --release-pins is on."""
    connector = svc.connector
    if not (svc.settings.release_pins and connector.caps.pins_on_d):
        return None
    return Releaser(
        svc.pool,
        svc.engines,
        connector.release_request,
        lambda: svc.model or svc.settings.model,
        lambda reason, outcome: svc.metrics.releases.labels(reason, outcome).inc(),
        timeout=svc.settings.prefill_timeout,
    )


async def sweep_loop(svc: Services, every: float = SWEEP_EVERY_S) -> None:
    while True:
        await asyncio.sleep(every)
        try:
            await sweep(svc)
        except StoreError as exc:  # the store is down: D's own TTL frees what is due
            log.debug("pin sweep skipped: %s", exc)


async def sweep(svc: Services) -> int:
    """One pass over every D; the handles taken for release."""
    if svc.releaser is None or svc.guard.is_open:
        return 0
    delay = release_delay(svc)
    taken = 0
    for inst in svc.pool.instances("decode"):
        taken += await _sweep_decode(svc, inst, svc.clock() - delay)
    return taken


def release_delay(svc: Services) -> float:
    s = svc.settings
    return svc.gaps.delay(s.release_after, s.handle_ttl)


async def _sweep_decode(svc: Services, inst: Instance, idle_since: float) -> int:
    store = svc.store
    inst.pins = await svc.guard.call(lambda: store.count_pins(inst.url))
    if inst.pressured:
        reason, before, limit = "pressure", math.inf, PRESSURE_BATCH
    else:
        reason, before, limit = "idle", idle_since, IDLE_BATCH
    due = await svc.guard.call(lambda: store.pins_due(inst.url, before, limit))
    taken = 0
    for key, _ in due:
        state = await _take(svc, inst, key, before)
        if state is None or state.kv_transfer_params is None or svc.releaser is None:
            continue  # read, replaced or in flight since: nothing of it is pinned for nobody
        svc.releaser.submit(state.kv_transfer_params, state.decode, reason)
        taken += 1
    if taken:
        log.info("releasing %d %s handle(s) on %s", taken, reason, inst.url)
    return taken


async def _take(svc: Services, inst: Instance, key: str, before: float) -> SessionState | None:
    """The conversation's handle if it is still unread since `before` (atomic: one replica,
    never a handle a turn holds), and its entry out of D's index either way."""
    store = svc.store
    state = await svc.guard.call(lambda: store.take_handle(key, before))
    await svc.guard.call(lambda: store.forget_pin(inst.url, key))
    return state
