"""P, then D: the legs of the connectors that call them in turn (NIXL pull, store). Verify the
claimed handle, place the turn (the decode plan, the P holding the prompt), prefill on P with
the handle or the null handoff, decode on D with P's params; D failing before its first byte
redoes the turn with a new P leg."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.responses import Response

from router.connectors.legs import handover, moved
from router.connectors.legs.decode import decode
from router.connectors.legs.prefill import Prefilled
from router.engines.pool import Instance, Role
from router.errors import Unavailable, UpstreamError, UpstreamFailure
from router.services import Services
from router.turn import decode_plan, fits, kv_aware, worth
from router.turn.claim import verify
from router.turn.decide import asks, attempts
from router.turn.outcomes import Reason
from router.turn.state import Turn

log = logging.getLogger("kvbaton.turn")

# What a connector does with P's answer before D's leg (store: its reuse verdict). Not
# attempts.AfterPrefill, which is what the P leg does after one attempt.
OnPrefilled = Callable[[Turn, Prefilled], None]


async def serve(turn: Turn, on_prefilled: OnPrefilled | None = None) -> Response:
    svc = turn.svc
    state = turn.claim.state
    p_inst = svc.pool.pick("prefill", prefer=state.prefill if state else "")
    source = svc.pool.find("decode", state.decode) if state is not None else None
    p_inst, local = await _place(turn, source, p_inst)
    if local is None and turn.ahead is not None:
        turn.ahead.cancel()  # D's leg sent beside the claim: this turn is not on D alone
    failed: list[str] = []
    if local is not None:
        try:
            return await decode(turn, local, alone_params(turn, local))
        except UpstreamFailure as exc:  # before its first byte: an ordinary P/D turn
            svc.pool.record_failure(local, str(exc), stalled=exc.stalled)
            failed.append(local.url)
            log.warning("decode plan on %s failed before the first byte: %s", local.url, exc)
            turn.miss(Reason.DECODE_LOCAL_FAILED)
    # What D would refuse, before P pins blocks for it (a turn on D alone pins nothing on P,
    # and D refuses it itself).
    await fits.check(turn, p_inst.url)
    p_inst = await kv_aware.place_prefill(turn, p_inst)
    prefer = state.decode if state else ""
    while True:
        sent = source if turn.claim.params is not None else None  # the handle's D, if sent
        early = handover.dispatch(turn, p_inst, prefer, failed)  # D beside P, if it parks
        prefilled = await handover.prefill_beside(turn, p_inst, early)
        _note_handle_result(turn, sent, prefilled)
        moved.note_moved(turn, prefilled)
        if on_prefilled is not None:
            on_prefilled(turn, prefilled)
        try:
            return await handover.decode_leg(turn, early, prefilled, prefer, failed)
        except UpstreamFailure as exc:
            d_inst = turn.decode
            assert d_inst is not None  # the D that failed
            # D failed before its first byte: redo the whole turn with a new P leg, since
            # P's params are single use (never send them to a second D). A paused D (vLLM
            # 0.33's 503) is busy, not broken: not counted against it.
            if not exc.busy:
                svc.pool.record_failure(d_inst, str(exc), stalled=exc.stalled)
            failed.append(d_inst.url)
            log.warning("decode on %s failed before the first byte: %s", d_inst.url, exc)
            if not attempts.redo_decode(len(failed)):
                raise UpstreamError(f"decode failed twice; last: {exc}") from None
            if turn.claim.params is not None:
                turn.miss(Reason.DECODE_RETRIED)
            # P's params may be what D failed on (forged or stale): another P if there is one.
            p_inst = _pick_other(svc, "prefill", prefilled.instance)


def alone_params(turn: Turn, d_inst: Instance) -> dict[str, Any] | None:
    """P's params for a turn on D alone: D keeps its blocks for P when the router will see
    its handle (asks.handle_seen), else D gets none."""
    svc = turn.svc
    if not asks.handle_seen(svc.settings, turn.inc, d_inst.ident.streams_handles):
        return None
    return svc.connector.alone_params()


async def _place(
    turn: Turn, source: Instance | None, p_inst: Instance
) -> tuple[Instance, Instance | None]:
    """The turn's P, and the previous D when the turn runs there alone (the decode plan:
    chosen first, from the state alone, so that such a turn pays for nothing else; else
    after the verification, when the state could not bound what D lacks)."""
    if source is not None and turn.claim.params is not None:
        p_inst = _reader(turn, source, p_inst)
    local, decided = decode_plan.by_state(turn, source, p_inst)
    if local is not None:
        return p_inst, local
    if source is not None and turn.claim.params is not None:
        worth.judge(turn, p_inst)  # before P's /tokenize: a pull P would skip is not made
    svc = turn.svc
    turn.claim = await verify(svc, turn.inc, turn.claim, p_inst.url, turn.request_id, turn.early)
    kv_aware.check_handle(turn, p_inst, source)
    if not decided:
        local = await decode_plan.decode_here(turn, source, p_inst)
    return p_inst, local


def _note_handle_result(turn: Turn, sent: Instance | None, prefilled: Prefilled) -> None:
    """Record who prefilled, and whether P read or refused the handle's D."""
    turn.prefill = prefilled.instance
    turn.prefill_ids = prefilled.prompt_ids
    if prefilled.refused_by:
        turn.miss(Reason.HANDLE_REJECTED)
        if sent is not None:
            sent.ident.note_refused(prefilled.refused_by, time.monotonic())
    elif sent is not None:
        sent.ident.note_read(prefilled.instance.url)


def _reader(turn: Turn, source: Instance, p_inst: Instance) -> Instance:
    """A P that has not been refusing the handle's D (`source`) and speaks its connector
    version; with none left, the turn's claim becomes a miss (reads-paused, or
    connector-mismatch) and p_inst serves it."""
    now = time.monotonic()
    pairs = p_inst.ident.version.pairs_with(source.ident.version)
    if pairs and not source.ident.reads_paused(p_inst.url, now):
        return p_inst
    paused = list(source.ident.paused_for(now))
    try:
        return turn.svc.pool.pick("prefill", exclude=paused, peer=source)
    except Unavailable:
        turn.miss(Reason.READS_PAUSED if pairs or paused else Reason.CONNECTOR_MISMATCH)
        return p_inst


def _pick_other(svc: Services, role: Role, inst: Instance) -> Instance:
    try:
        return svc.pool.pick(role, exclude=[inst.url])
    except Unavailable:
        return svc.pool.pick(role, prefer=inst.url)
