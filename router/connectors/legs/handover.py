"""The handover from P to D where the engines offer vllm#51919 (open upstream; reference §10):
D's request sent beside P's and parked until its ready notification (concurrent dispatch,
learned per D), and P's token 1 passed on in its params (seeding, where P ships it). Both
ride on every turn's P leg, so D->P reuse keeps its handle; the handover is timed from P's
answer to D's first byte (kvbaton_handover_seconds, span kvbaton.handover)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from typing import Any

from starlette.responses import Response

from router.config import Settings
from router.connectors.legs.calls import pick_decode
from router.connectors.legs.decode import decode, open_decode, respond
from router.connectors.legs.prefill import Prefilled, prefill
from router.engines.client import EngineStream
from router.engines.pool import Instance
from router.engines.versions import READY_PATH
from router.errors import Unavailable, UpstreamFailure
from router.turn.decide import asks
from router.turn.state import Turn

log = logging.getLogger("kvbaton.turn")

# vllm-router#207's early D request: parse, tokenize and admit it, and wait for P's params.
PARKED: dict[str, Any] = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_ready": False,
}
READY_TRIES = 3  # vllm-router#207 retries the notification 3 times
READY_BACKOFF_S = 0.05
SEED_KEY = "first_token_ids"


class Mode(StrEnum):
    """How P's answer reached D (the metric's label): after P or beside it, with P's token 1
    offered to D or not."""

    SEQUENTIAL = "sequential"
    SEEDED = "seeded"
    CONCURRENT = "concurrent"
    CONCURRENT_SEEDED = "concurrent-seeded"


class Fallback(StrEnum):
    """Why a D request sent beside P did not get P's params (kvbaton_handover_fallbacks)."""

    PREFILL_FAILED = "prefill-failed"  # P failed or the client left: D's request aborted
    NO_PARAMS = "no-params"  # P answered without params (or a D it cannot pair with): aborted
    PARK_ENDED = "park-ended"  # D answered 404: its park timed out, it prefills locally
    UNDELIVERED = "undelivered"  # no 2xx in READY_TRIES: D's request aborted, turn redone
    DECODE_FAILED = "decode-failed"  # D's request failed before P answered


def handoff(settings: Settings, params: dict[str, Any] | None) -> dict[str, Any] | None:
    """P's params as D gets them: without P's token 1 under --no-first-token-seeding."""
    if params is None or settings.first_token_seeding or SEED_KEY not in params:
        return params
    return {k: v for k, v in params.items() if k != SEED_KEY}


def began(turn: Turn, params: Mapping[str, Any] | None, concurrent: bool) -> None:
    """P answered: the handover starts now."""
    seeded = params is not None and SEED_KEY in params
    if concurrent:
        mode = Mode.CONCURRENT_SEEDED if seeded else Mode.CONCURRENT
    else:
        mode = Mode.SEEDED if seeded else Mode.SEQUENTIAL
    turn.handover_at, turn.handover_mode = time.monotonic(), mode.value


@dataclass
class Early:
    """The D picked before P answered, and its request parked there (None: that D does not
    park, and is called after P)."""

    instance: Instance
    task: asyncio.Task[EngineStream] | None


def dispatch(turn: Turn, p_inst: Instance, prefer: str, failed: list[str]) -> Early | None:
    """Pick D and send its parked request now, where the connector and the picked D allow it
    (None: no D parks; D is picked after P, exactly as without vllm#51919)."""
    svc = turn.svc
    if not (svc.settings.concurrent_dispatch and svc.connector.caps.ready_notify):
        return None
    if not any(d.ident.parks for d in svc.pool.instances("decode")):
        return None
    try:
        d_inst = pick_decode(svc, prefer, failed, p_inst)
    except Unavailable:
        return None  # the sequential path says so, after P
    if not d_inst.ident.parks:
        return Early(d_inst, None)  # picked once: the placement's rotation is not skewed
    turn.decode = d_inst
    turn.want_token_ids = asks.token_ids(svc.settings, turn.inc, d_inst.ident.streams_handles)
    return Early(d_inst, asyncio.create_task(open_decode(turn, d_inst, dict(PARKED))))


async def prefill_beside(turn: Turn, p_inst: Instance, early: Early | None) -> Prefilled:
    """P's leg; a P that fails (or a client that leaves) aborts D's parked request. P's params
    as D gets them (`handoff`)."""
    try:
        prefilled = await prefill(turn, p_inst)
    except BaseException:
        if early is not None and early.task is not None:
            await asyncio.shield(_abort(turn, early.task, Fallback.PREFILL_FAILED))
        raise
    params = handoff(turn.svc.settings, prefilled.params)
    return prefilled if params is prefilled.params else replace(prefilled, params=params)


async def decode_leg(
    turn: Turn, early: Early | None, prefilled: Prefilled, prefer: str, failed: list[str]
) -> Response:
    """D's leg: the parked request when one was sent, else (or withdrawn) a D after P."""
    if early is not None and early.task is not None:
        answer = await decode_beside(turn, early.instance, early.task, prefilled)
        if answer is not None:
            return answer
    else:
        began(turn, prefilled.params, concurrent=False)
    peer = prefilled.instance
    if (
        early is not None
        and early.task is None
        and early.instance.ident.version.pairs_with(peer.ident.version)
    ):
        d_inst = early.instance  # picked before P
    else:
        d_inst = pick_decode(turn.svc, prefer, failed, peer)
    return await decode(turn, d_inst, prefilled.params)


async def decode_beside(
    turn: Turn, d_inst: Instance, task: asyncio.Task[EngineStream], prefilled: Prefilled
) -> Response | None:
    """Hand P's params to the parked D and relay its answer; None when D's request was
    withdrawn and D is to be called after P instead."""
    params = prefilled.params
    if params is None or not d_inst.ident.version.pairs_with(prefilled.instance.ident.version):
        await _abort(turn, task, Fallback.NO_PARAMS)
        began(turn, params, concurrent=False)
        return None
    began(turn, params, concurrent=True)
    handed = False
    try:
        if task.done() and task.exception() is not None:
            _fell_back(turn, Fallback.DECODE_FAILED, params)  # P's blocks: never read
            await task  # raises D's failure: the turn is redone
        delivered = await _notify(turn, d_inst, params)
        if delivered is None:
            _fell_back(turn, Fallback.UNDELIVERED)
            raise UpstreamFailure(f"{d_inst.url}{READY_PATH} failed {READY_TRIES} times")
        if not delivered:
            # D's park ended (its timeout) and it prefills locally: its answer stands, and
            # P's blocks are never read.
            log.warning("decode %s answered 404 to the ready notification", d_inst.url)
            _fell_back(turn, Fallback.PARK_ENDED, params)
        resp = await task
        handed = True
    finally:
        if not handed:
            await asyncio.shield(_abort(turn, task, None))
    return await respond(turn, d_inst, resp)


async def _notify(turn: Turn, d_inst: Instance, params: dict[str, Any]) -> bool | None:
    """POST P's params to D's /v1/pd_kv_ready: True on a 2xx, False on a 404 (none parked
    under the id), None when no try got an answer that says."""
    svc = turn.svc
    body = {"request_id": turn.leg_id or turn.request_id, "kv_transfer_params": params}
    for attempt in range(READY_TRIES):
        if attempt:
            await asyncio.sleep(READY_BACKOFF_S * attempt)
        try:
            status, _ = await svc.engines.post_json(
                d_inst.url + READY_PATH,
                body,
                request_id=turn.leg_id or turn.request_id,
                timeout=svc.settings.connect_timeout,
            )
        except UpstreamFailure as exc:
            log.warning("ready notification to %s failed: %s", d_inst.url, exc)
            continue
        if 200 <= status < 300 or status == 404:
            return status != 404
        log.warning("ready notification to %s answered %d", d_inst.url, status)
        if status < 500:
            return None  # D refused the params: retrying would not change it
    return None


def _fell_back(turn: Turn, why: Fallback, unread: dict[str, Any] | None = None) -> None:
    """Count the fallback; P's params that no D will read are released (P frees its pin)."""
    turn.svc.metrics.handover_fallbacks.labels(why.value).inc()
    releaser, p_inst = turn.svc.releaser, turn.prefill
    if unread is not None and releaser is not None and p_inst is not None:
        releaser.submit_prefilled(unread, p_inst.url)


async def _abort(turn: Turn, task: asyncio.Task[EngineStream], why: Fallback | None) -> None:
    """Close D's parked request (D aborts it, as on a client hang-up)."""
    if why is not None:
        turn.svc.metrics.handover_fallbacks.labels(why.value).inc()
    if not task.done():
        task.cancel()
    try:
        resp = await task
    except (asyncio.CancelledError, Exception):
        return
    resp.close()
