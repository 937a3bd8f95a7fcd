"""The sweep that keeps every D's pinned share bounded, pressure first. Each second, per D,
the handles left unread past the release delay (--handle-ttl unless --release-after is set:
while D has room a handle costs nothing, and a slow human's next turn still hits); and every
tenth of a second, a D whose KV usage is past its low-water mark is read again (its /metrics)
and, while over the high-water mark, the handles least likely to be read (idle longest
relative to their own conversation's cadence, release_order.py) are released until it falls
below the low-water mark.
Handles are taken from the store first (one replica takes each, never one a turn holds)."""

from __future__ import annotations

import asyncio
import logging
import math

from router.engines.metrics_read import read_started
from router.engines.pool import Instance
from router.engines.release import Releaser
from router.lifecycle import release_order
from router.services import Services
from router.turn.aim import aims_at_its_d
from sessions.model import SessionState
from sessions.store import StoreError

log = logging.getLogger("kvbaton.pins")

TICK_S = 0.1  # the pressure check on a D near its high-water mark
IDLE_EVERY = 10  # ticks between idle sweeps (one a second)
IDLE_BATCH = 64  # idle handles taken per D and sweep
MAX_PRESSURE_BATCH = 256
# The oldest entries of a pressured D's index whose conversations' cadences are read (one
# round trip) to choose the batch from: this many per handle to release, within these bounds.
WINDOW_PER_HANDLE = 4
MIN_WINDOW, MAX_WINDOW = 64, 1024


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
        prefilled_request=connector.release_prefilled,
        clock=svc.clock,
        keep_for=svc.settings.handle_ttl,
        spent=svc.spent,
    )


async def sweep_loop(svc: Services) -> None:
    tick = 0
    while True:
        await asyncio.sleep(TICK_S)
        tick += 1
        try:
            await relieve(svc, every_d=tick % IDLE_EVERY == 0)
            if tick % IDLE_EVERY == 0:
                await sweep(svc)
        except StoreError as exc:  # the store is down: D's own TTL frees what is due
            log.debug("pin sweep skipped: %s", exc)


def release_delay(svc: Services) -> float:
    """How long a handle may sit unread on a D under no pressure: --release-after when set,
    else --handle-ttl (past it no turn reads the handle, so it only costs D memory), never
    more than --handle-ttl."""
    s = svc.settings
    return min(s.release_after, s.handle_ttl) if s.release_after > 0 else s.handle_ttl


async def sweep(svc: Services) -> int:
    """Every D's idle handles (unread past the release delay); the number taken."""
    if svc.releaser is None or svc.guard.is_open:
        return 0
    before = svc.clock() - release_delay(svc)
    taken = 0
    for inst in svc.pool.instances("decode"):
        await _count(svc, inst)
        taken += await _release_due(svc, inst, "idle", before, IDLE_BATCH)
    return taken


async def relieve(svc: Services, *, every_d: bool = True) -> int:
    """Read the KV usage of every D past its low-water mark (of every D with `every_d`, once
    a second), and while one is over its high-water mark, release the handles on it least
    likely to be read, whatever their age; the number taken. D's usage is read here, not
    only by the health loop, because one-turn conversations can fill a D within seconds."""
    if svc.releaser is None or svc.guard.is_open:
        return 0
    taken = 0
    for inst in svc.pool.instances("decode"):
        if not (every_d or inst.pressured or inst.kv_usage >= inst.low_water):
            continue
        await read_started(svc.engines, inst, 1.0)  # the health loop's read of /metrics
        if inst.pressured:
            await _count(svc, inst)
            taken += await _relieve_decode(svc, inst, pressure_batch(inst))
    return taken


async def _relieve_decode(svc: Services, inst: Instance, batch: int) -> int:
    """`batch` handles of D's oldest (WINDOW_PER_HANDLE times as many), those least likely to
    be read first: idle for the most of their own conversation's cadences (a scripted
    conversation quiet for a minute before one of a human who types for a minute; a D full
    of young one-turn pins still drains, oldest first)."""
    now = svc.clock()
    window = min(MAX_WINDOW, max(MIN_WINDOW, WINDOW_PER_HANDLE * batch))
    due = await svc.guard.call(lambda: svc.store.pins_due(inst.url, math.inf, window))
    keys = [key for key, _ in due]
    times = await svc.guard.call(lambda: svc.store.turn_times(keys))
    ranked = release_order.least_likely_first(
        due,
        times,
        now=now,
        prior=release_order.prior(svc.gaps.p95()),
        ttl=svc.settings.handle_ttl,
    )
    # Taken only if not committed again since this pass began (a newer handle is younger).
    return await _release(svc, inst, "pressure", ranked[:batch], now)


def pressure_batch(inst: Instance) -> int:
    """The oldest handles to release so that D falls under its low-water mark, taking its
    pinned handles as what fills it: their share above the mark, and at least one."""
    pins = max(inst.pins, 0)
    if inst.kv_usage <= 0:
        return 1
    over = (inst.kv_usage - inst.low_water) / inst.kv_usage
    return max(1, min(MAX_PRESSURE_BATCH, math.ceil(pins * over)))


async def _count(svc: Services, inst: Instance) -> None:
    totals = await svc.guard.call(lambda: svc.store.pin_totals(inst.url))
    inst.pins, inst.pinned_blocks, inst.pinned_tokens = totals.handles, totals.blocks, totals.tokens
    inst.pinned_handle_blocks = totals.handle_blocks


async def _release_due(
    svc: Services, inst: Instance, reason: str, before: float, limit: int
) -> int:
    due = await svc.guard.call(lambda: svc.store.pins_due(inst.url, before, limit))
    return await _release(svc, inst, reason, due, before)


async def _release(
    svc: Services, inst: Instance, reason: str, due: list[tuple[str, float]], before: float
) -> int:
    """Take and release the handles of these index entries that are still unread since
    `before`; the number taken."""
    taken = 0
    for key, at in due:
        state = await _take(svc, inst, key, before, at)
        if state is None or state.kv_transfer_params is None or svc.releaser is None:
            continue  # read, replaced or in flight since: nothing of it is pinned for nobody
        if not aims_at_its_d(svc, key, state):
            continue  # it could send P anywhere: D's own TTL frees it
        svc.releaser.submit(state.kv_transfer_params, state.decode, reason)
        taken += 1
    if due:
        inst.pins = max(inst.pins - len(due), 0)
    if taken:
        log.info("releasing %d %s handle(s) on %s", taken, reason, inst.url)
    return taken


async def _take(
    svc: Services, inst: Instance, key: str, before: float, at: float
) -> SessionState | None:
    """The conversation's handle if it is still unread since `before` (atomic: one replica,
    never a handle a turn holds), and its entry (made at `at`) out of D's index either way,
    unless a commit noted a newer one meanwhile."""
    store = svc.store
    state = await svc.guard.call(lambda: store.take_handle(key, before))
    await svc.guard.call(lambda: store.forget_pin(inst.url, key, at))
    return state
