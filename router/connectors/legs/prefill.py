"""The prefill leg: P with the claimed handle or the null handoff, with retries that never
send one P's params twice. `attempts.after_prefill` says what each attempt leads to."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Any

from router.connectors.legs.calls import Answer, call_prefill, prefill_request
from router.engines.pool import Instance
from router.errors import EngineReply, RouterError, UpstreamError
from router.turn.decide import attempts
from router.turn.decide.attempts import Attempt, Next
from router.turn.outcomes import Reason
from router.turn.state import Turn

log = logging.getLogger("kvbaton.legs")


@dataclass(frozen=True)
class Prefilled:
    instance: Instance
    params: dict[str, Any] | None  # P's kv_transfer_params for D (None: D recomputes)
    refused_by: str  # the P that refused the claimed handle ("" if none did)
    prompt_ids: list[int] | None = None  # the prompt as token ids, when P got it that way
    body: dict[str, Any] | None = None  # P's answer (its usage: what it found cached)


async def _attempt(
    turn: Turn, inst: Instance, handle: dict[str, Any] | None, ids: list[int] | None
) -> tuple[Attempt, Answer]:
    """One P call: what it sent (as the decision core sees it) and what it got."""
    kv = turn.svc.connector.prefill_params(handle)
    request = prefill_request(turn, kv, ids)
    answer = await call_prefill(turn, inst, request, turn.leg_headers(inst), hit=bool(handle))
    paused = answer.paused  # refused before the engine took it: the handle was not read
    if handle is not None and (answer.status is not None or answer.reached) and not paused:
        turn.handle_sent = True  # P may have read it (or notified D): never released after
    attempt = Attempt(
        answer.status,
        answer.ok,
        answer.reached,
        with_handle=handle is not None,
        with_ids=ids is not None,
        paused=paused,
    )
    return attempt, answer


async def prefill(turn: Turn, inst: Instance) -> Prefilled:
    """Run the P leg; a rejected handle is retried once as a miss, a failed P on another P."""
    svc = turn.svc
    handle = turn.claim.params
    ids = turn.claim.prompt_ids if svc.ids_leg_on() else None
    refused_by = ""
    refused_ids: int | None = None  # the status of P's refusal of the prompt as ids
    tried: list[str] = []
    while True:
        attempt, answer = await _attempt(turn, inst, handle, ids)
        raw, parsed, failure = answer.raw, answer.parsed, answer.failure
        step = attempts.after_prefill(attempt)
        if step.handle_used:
            log.warning(
                "prefill %s rejected the handle (%s); retrying as a miss", inst.url, failure
            )
            handle, refused_by = None, inst.url
        if step.next is Next.AS_BODY:
            log.warning("prefill %s refused the prompt as token ids (HTTP %s)", inst.url, failure)
            ids, refused_ids = None, attempt.status
        elif step.next is Next.DONE:
            assert parsed is not None
            svc.pool.record_success(inst)
            if refused_ids is not None:
                svc.switch_ids_leg_off(
                    f"{inst.url} answered {refused_ids} to /v1/completions with token ids "
                    "and 200 to the same prompt as the client sent it"
                )
            return Prefilled(inst, _handoff(turn, inst, parsed), refused_by, ids, parsed)
        elif step.next is Next.RELAY:
            assert attempt.status is not None  # P's own 4xx
            raise EngineReply(attempt.status, raw)
        elif step.next is Next.ANOTHER_P:
            tried.append(inst.url)
            peer = _handle_source(turn) if handle is not None else None
            inst = _another(turn, inst, tried, step.failed, answer, peer)
            if peer is not None and not inst.ident.version.pairs_with(peer.ident.version):
                handle = None  # no P left that can read it: the turn goes on as a miss
                turn.miss(Reason.CONNECTOR_MISMATCH)


def _handle_source(turn: Turn) -> Instance | None:
    state = turn.claim.state
    return turn.svc.pool.find("decode", state.decode) if state is not None else None


# What a client told that every P is paused waits before it retries (vLLM gives no hint).
PAUSED_RETRY_AFTER_S = 1


def _another(
    turn: Turn,
    inst: Instance,
    tried: list[str],
    failed: bool,
    answer: Answer,
    peer: Instance | None,
) -> Instance:
    """The next P after `inst` did not serve (failed: counted against it, and a P that stalled
    is ejected at once; else it was busy or paused); one that can read the handle's D
    (`peer`) while there is one."""
    failure = answer.failure
    if failed:
        turn.svc.pool.record_failure(inst, failure, stalled=answer.stalled)
    log.warning("prefill on %s failed (%s); trying another instance", inst.url, failure)
    pool = turn.svc.pool
    try:
        if peer is not None:
            with contextlib.suppress(RouterError):
                return pool.pick("prefill", exclude=tried, peer=peer)
        return pool.pick("prefill", exclude=tried)
    except RouterError:
        if not failed:  # every P is busy or paused: the client gets the 429/503 to back off
            assert answer.status is not None  # P answered: 429 busy, or 503 paused
            retry = PAUSED_RETRY_AFTER_S if answer.status == 503 else None
            raise EngineReply(answer.status, answer.raw, retry_after=retry) from None
        raise UpstreamError(f"every prefill instance failed; last: {failure}") from None


def _handoff(turn: Turn, inst: Instance, parsed: dict[str, Any]) -> dict[str, Any] | None:
    params = parsed.get("kv_transfer_params")
    if turn.svc.connector.is_handle(params):
        assert isinstance(params, dict)
        return params
    # P answered without a handoff: D prefills locally (never the P-leg dict).
    if turn.svc.connector.caps.p_hands_off:  # else D loads P's blocks some other way
        log.info("prefill %s returned no kv_transfer_params; D recomputes", inst.url)
    return None
