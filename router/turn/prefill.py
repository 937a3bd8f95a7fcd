"""The prefill leg: P with the claimed handle or the null handoff, with retries that never
send one P's params twice. `decide.after_prefill` says what each attempt leads to."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import msgspec

from router.engines.pool import Instance
from router.errors import EngineReply, RouterError, UpstreamError, UpstreamFailure
from router.tracing import span
from router.turn import decide
from router.turn.decide import Attempt, Next
from router.turn.rewrite import PATHS, ids_prefill_body, prefill_body
from router.turn.state import Turn
from sessions.vocabulary import LegOutcome

log = logging.getLogger("kvbaton.legs")


@dataclass(frozen=True)
class Prefilled:
    instance: Instance
    params: dict[str, Any] | None  # P's kv_transfer_params for D (None: D recomputes)
    refused_by: str  # the P that refused the claimed handle ("" if none did)
    prompt_ids: list[int] | None = None  # the prompt as token ids, when P got it that way
    body: dict[str, Any] | None = None  # P's answer (its usage: what it found cached)


def parse_answer(raw: bytes) -> dict[str, Any] | None:
    """An engine's JSON answer as a dict (None: not JSON, or not an object)."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    return body if isinstance(body, dict) else None


def _request(
    turn: Turn, handle: dict[str, Any] | None, ids: list[int] | None
) -> tuple[dict[str, Any], str]:
    """P's body and path: the client's request, or its prompt as token ids on completions."""
    inc = turn.inc
    kv = turn.svc.connector.prefill_params(handle)
    if ids is not None:
        return ids_prefill_body(inc.body, ids, kv), PATHS["completions"]
    body = prefill_body(inc.body, kv, api=inc.api)
    if inc.api == "responses":
        body["store"] = False  # P's one-token response is never worth keeping
    return body, PATHS[inc.api]


def _outcome(status: int) -> LegOutcome:
    """The upstream metric's outcome of a P call (status 0: no answer)."""
    if status == 200:
        return LegOutcome.OK
    return LegOutcome.ERROR if status == 0 or status >= 500 else LegOutcome.REJECTED


async def _attempt(
    turn: Turn, inst: Instance, handle: dict[str, Any] | None, ids: list[int] | None
) -> tuple[Attempt, bytes, dict[str, Any] | None, str]:
    """One P call: what it sent and got, the raw body, the parsed body, a failure text."""
    svc = turn.svc
    body, path = _request(turn, handle, ids)
    started = time.monotonic()
    reached = True
    with svc.pool.busy(inst), span("kvbaton.prefill", instance=inst.url, hit=bool(handle)):
        try:
            status, raw = await svc.engines.post_json(
                inst.url + path,
                body,
                request_id=turn.request_id,
                extra_headers=turn.leg_headers(inst),
                timeout=svc.settings.prefill_timeout,
            )
            failure = f"HTTP {status}"
        except UpstreamFailure as exc:
            status, raw, failure = 0, b"", str(exc)
            reached = exc.reached
    parsed = parse_answer(raw) if status else None
    outcome = _outcome(status)
    svc.metrics.upstream.labels("prefill", inst.url, outcome).observe(time.monotonic() - started)
    ok = status == 200 and parsed is not None and not svc.connector.prefill_failed(status, parsed)
    attempt = Attempt(status, ok, reached, with_handle=handle is not None, with_ids=ids is not None)
    return attempt, raw, parsed, failure


async def prefill(turn: Turn, inst: Instance) -> Prefilled:
    """Run the P leg; a rejected handle is retried once as a miss, a failed P on another P."""
    svc = turn.svc
    handle = turn.claim.params
    ids = turn.claim.prompt_ids if svc.ids_leg_on() else None
    refused_by = ""
    refused_ids = 0
    tried: list[str] = []
    while True:
        attempt, raw, parsed, failure = await _attempt(turn, inst, handle, ids)
        step = decide.after_prefill(attempt)
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
            if refused_ids:
                svc.switch_ids_leg_off(
                    f"{inst.url} answered {refused_ids} to /v1/completions with token ids "
                    "and 200 to the same prompt as the client sent it"
                )
            return Prefilled(inst, _handoff(turn, inst, parsed), refused_by, ids, parsed)
        elif step.next is Next.RELAY:
            raise EngineReply(attempt.status, raw)
        elif step.next is Next.ANOTHER_P:
            tried.append(inst.url)
            inst = _another(turn, inst, tried, step.failed, (attempt.status, raw, failure))


def _another(
    turn: Turn, inst: Instance, tried: list[str], failed: bool, reply: tuple[int, bytes, str]
) -> Instance:
    """The next P after `inst` did not serve (failed: counted against it; else it was busy)."""
    status, raw, failure = reply
    if failed:
        turn.svc.pool.record_failure(inst, failure)
    log.warning("prefill on %s failed (%s); trying another instance", inst.url, failure)
    try:
        return turn.svc.pool.pick("prefill", exclude=tried)
    except RouterError:
        if not failed:  # every P is busy: the client gets the 429 to back off
            raise EngineReply(status, raw) from None
        raise UpstreamError(f"every prefill instance failed; last: {failure}") from None


def _handoff(turn: Turn, inst: Instance, parsed: dict[str, Any]) -> dict[str, Any] | None:
    params = parsed.get("kv_transfer_params")
    if turn.svc.connector.is_handle(params):
        assert isinstance(params, dict)
        return params
    # P answered without a handoff: D prefills locally (never the P-leg dict).
    if turn.svc.connector.name != "store":  # in store mode D loads P's blocks by hash
        log.info("prefill %s returned no kv_transfer_params; D recomputes", inst.url)
    return None
