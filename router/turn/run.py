"""One conversation turn, top to bottom: claim, verify, place, prefill on P, decode on D,
relay, commit. The decisions are `decide`'s; this module applies them."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.responses import Response, StreamingResponse

from router.engines.client import EngineStream
from router.engines.pool import Instance, Role
from router.errors import EngineReply, Unavailable, UpstreamError, UpstreamFailure, sse_error_event
from router.services import Services
from router.tracing import span
from router.turn import decide, early, kv_aware, moriio, plan, push, store_mode
from router.turn.claim import claim, verify
from router.turn.commit import abort, finish
from router.turn.incoming import Incoming
from router.turn.outcomes import Reason
from router.turn.prefill import Prefilled, prefill
from router.turn.rewrite import PATHS, decode_body
from router.turn.sse import SseRelay, capture_body
from router.turn.state import Turn

log = logging.getLogger("kvbaton.turn")


def new_request_id() -> str:
    return uuid.uuid4().hex


async def run_turn(svc: Services, inc: Incoming, request_id: str) -> Response:
    """Serve one client request through P and D; the response may still be streaming."""
    started = time.monotonic()
    tokens = early.start(svc, inc, request_id)  # overlaps the claim's wait
    try:
        found = await claim(svc, inc, request_id)
    except BaseException:
        if tokens is not None:
            tokens.cancel()
        raise
    turn = Turn(svc, inc, request_id, found, started)
    try:
        return await _serve(turn, tokens)
    except EngineReply as reply:
        await abort(turn, f"engine-{reply.status}")
        return Response(
            reply.body, reply.status, headers=final_headers(turn), media_type="application/json"
        )
    except asyncio.CancelledError:
        await asyncio.shield(abort(turn, "client-disconnected"))
        raise
    except BaseException as exc:
        await abort(turn, type(exc).__name__)
        raise
    finally:
        if tokens is not None:
            tokens.cancel()  # a turn that did not need them (done: nothing happens)


def final_headers(turn: Turn) -> dict[str, str]:
    """The response's headers: the reuse verdict is final now, so it is counted (once)."""
    if not turn.reuse_counted:
        turn.reuse_counted = True
        reuse, metrics = turn.claim.reuse, turn.svc.metrics
        metrics.reuse.labels(*reuse.labels()).inc()
        if reuse.is_hit:
            metrics.reused_tokens.labels(reuse.source).inc(reuse.tokens)
    return turn.headers()


async def _serve(turn: Turn, tokens: early.EarlyTokens | None = None) -> Response:
    svc = turn.svc
    if svc.connector.name == "nixl-push":  # P and D concurrently: router/turn/push.py
        return await push.serve(turn, _open_decode, _respond)
    if svc.connector.name == "moriio":  # request-id addressing: router/turn/moriio.py
        return await moriio.serve(turn, _open_decode, _respond)
    state = turn.claim.state
    p_inst = svc.pool.pick("prefill", prefer=state.prefill if state else "")
    source = svc.pool.find("decode", state.decode) if state is not None else None
    if source is not None and turn.claim.params is not None:
        p_inst = _reader(turn, source, p_inst)
    turn.claim = await verify(svc, turn.inc, turn.claim, p_inst.url, turn.request_id, tokens)
    kv_aware.check_handle(turn, p_inst, source)
    failed: list[str] = []
    local = await plan.decode_here(turn, source, p_inst)
    if local is not None:
        try:
            return await _decode(turn, local, None)
        except UpstreamFailure as exc:  # before its first byte: an ordinary P/D turn
            svc.pool.record_failure(local, str(exc))
            failed.append(local.url)
            log.warning("decode plan on %s failed before the first byte: %s", local.url, exc)
            turn.claim = turn.claim.miss(Reason.DECODE_LOCAL_FAILED)
    p_inst = await kv_aware.place_prefill(turn, p_inst)
    while True:
        sent = source if turn.claim.params is not None else None  # the handle's D, if sent
        prefilled = await prefill(turn, p_inst)
        _note_handle_result(turn, sent, prefilled)
        store_mode.note_prefill(turn, prefilled)
        d_inst = _pick_decode(svc, state.decode if state else "", failed)
        try:
            return await _decode(turn, d_inst, prefilled.params)
        except UpstreamFailure as exc:
            # D failed before its first byte: redo the whole turn with a new P leg, since
            # P's params are single use (never send them to a second D).
            svc.pool.record_failure(d_inst, str(exc))
            failed.append(d_inst.url)
            log.warning("decode on %s failed before the first byte: %s", d_inst.url, exc)
            if not decide.redo_decode(len(failed)):
                raise UpstreamError(f"decode failed twice; last: {exc}") from None
            if turn.claim.params is not None:
                turn.claim = turn.claim.miss(Reason.DECODE_RETRIED)
            # P's params may be what D failed on (forged or stale): another P if there is one.
            p_inst = _pick_other(svc, "prefill", prefilled.instance)


def _wants_token_ids(turn: Turn, d_inst: Instance) -> bool:
    """D's token ids verify the next turn: a pull, or the decode plan (what D's cache holds).
    On a stream they are worth asking when a handle may come (D is known to stream
    kv_transfer_params, or --stream-kv-params says so) or when the decode plan is on."""
    settings, inc = turn.svc.settings, turn.inc
    streamed_use = (
        settings.stream_kv_params
        or d_inst.ident.streams_params
        or settings.decode_local_max_tokens > 0
    )
    return (
        settings.verify_prefix == "tokens"
        and inc.api != "responses"  # vLLM's /tokenize cannot render Responses input: digest
        and (not inc.stream or streamed_use)
    )


def _note_handle_result(turn: Turn, sent: Instance | None, prefilled: Prefilled) -> None:
    """Record who prefilled, and whether P read or refused the handle's D."""
    turn.prefill = prefilled.instance
    turn.prefill_ids = prefilled.prompt_ids
    if prefilled.refused_by:
        turn.claim = turn.claim.miss(Reason.HANDLE_REJECTED)
        if sent is not None:
            sent.ident.note_refused(prefilled.refused_by, time.monotonic())
    elif sent is not None:
        sent.ident.note_read(prefilled.instance.url)


def _reader(turn: Turn, source: Instance, p_inst: Instance) -> Instance:
    """A P that has not been refusing the handle's D (`source`); with none left, the turn's
    claim becomes a miss (reads-paused) and p_inst serves it."""
    now = time.monotonic()
    if not source.ident.reads_paused(p_inst.url, now):
        return p_inst
    paused = list(source.ident.paused_for(now))
    try:
        return turn.svc.pool.pick("prefill", exclude=paused)
    except Unavailable:
        turn.claim = turn.claim.miss(Reason.READS_PAUSED)
        return p_inst


def _pick_other(svc: Services, role: Role, inst: Instance) -> Instance:
    try:
        return svc.pool.pick(role, exclude=[inst.url])
    except Unavailable:
        return svc.pool.pick(role, prefer=inst.url)


def _pick_decode(svc: Services, prefer: str, failed: list[str]) -> Instance:
    """Another D than the ones that failed this turn, or the same one again if it is alone."""
    try:
        return svc.pool.pick("decode", prefer=prefer, exclude=failed)
    except Unavailable:
        if not failed:
            raise
        return svc.pool.pick("decode", prefer=prefer)


async def _open_decode(turn: Turn, d_inst: Instance, params: dict[str, Any] | None) -> EngineStream:
    """Send the D leg (P's params, or none: D computes what its cache lacks) and check its
    status before our response starts."""
    svc, inc = turn.svc, turn.inc
    kv = svc.connector.decode_params(params)
    body = decode_body(inc.body, kv, return_token_ids=turn.want_token_ids)
    url = d_inst.url + PATHS[inc.api]
    started = time.monotonic()
    outcome = "error"
    try:
        with span("kvbaton.decode", instance=d_inst.url, stream=inc.stream):
            resp = await svc.engines.open_stream(
                url,
                body,
                request_id=turn.leg_id or turn.request_id,
                extra_headers=turn.leg_headers(d_inst),
            )
        if resp.status >= 500:
            text = await _read_error(resp)
            raise UpstreamFailure(f"{url} answered {resp.status}: {text[:200]!r}")
        if resp.status != 200:
            raw = await resp.read()
            outcome = "client-error"
            raise EngineReply(resp.status, raw)
        outcome = "ok"
        return resp
    finally:
        svc.metrics.upstream.labels("decode", d_inst.url, outcome).observe(
            time.monotonic() - started
        )


async def _read_error(resp: EngineStream) -> str:
    try:
        return (await resp.read()).decode("utf-8", "replace")
    except UpstreamFailure:
        return ""


async def _decode(turn: Turn, d_inst: Instance, params: dict[str, Any] | None) -> Response:
    turn.decode = d_inst
    turn.want_token_ids = _wants_token_ids(turn, d_inst)
    return await _respond(turn, d_inst, await _open_decode(turn, d_inst, params))


async def _respond(turn: Turn, d_inst: Instance, resp: EngineStream) -> Response:
    """Relay D's answer (streamed or whole) and commit at its end."""
    svc, inc = turn.svc, turn.inc
    svc.pool.record_success(d_inst)
    strip = not inc.wants_token_ids and turn.want_token_ids
    if inc.stream:
        return StreamingResponse(
            _relay(turn, d_inst, resp, strip),
            200,
            headers=final_headers(turn),
            media_type=resp.content_type,
        )
    try:
        with svc.pool.busy(d_inst):
            chunks = [c async for c in resp.chunks(svc.settings.decode_idle_timeout)]
    finally:
        resp.release()
    client_bytes, captured = capture_body(b"".join(chunks), strip_token_ids=strip)
    turn.mark_first_byte()
    await finish(turn, captured)
    return Response(client_bytes, 200, headers=final_headers(turn), media_type="application/json")


async def _relay(
    turn: Turn, d_inst: Instance, resp: EngineStream, strip: bool
) -> AsyncIterator[bytes]:
    """Relay D's SSE bytes as they come; capture D's handle; commit before `[DONE]` goes out."""
    relay = SseRelay(strip_token_ids=strip)
    ended = False
    d_inst.outstanding += 1
    try:
        async for chunk in resp.chunks(turn.svc.settings.decode_idle_timeout):
            out = relay.feed(chunk)
            if relay.done and not ended:
                ended = True
                await finish(turn, relay.captured)
            if out:
                turn.mark_first_byte()
                yield out
        tail = relay.flush()
        if not ended:
            ended = True
            await finish(turn, relay.captured)
        if tail:
            yield tail
    except UpstreamFailure as exc:
        # After the first byte the status is sent: end with one SSE error event, no commit.
        log.warning("decode stream from %s broke: %s", d_inst.url, exc)
        turn.svc.pool.record_failure(d_inst, str(exc))
        ended = True
        await abort(turn, "decode-broke")
        yield sse_error_event(f"the decode engine failed mid-stream: {exc}")
    except Exception as exc:
        # Design rule 8: after the first byte every failure ends the stream with one error
        # event, never a cut 200; one log line, the traceback at debug level.
        log.error("turn %s failed mid-stream: %s: %.200s", turn.request_id, type(exc).__name__, exc)
        log.debug("traceback of the error above", exc_info=exc)
        ended = True
        await abort(turn, type(exc).__name__)
        yield sse_error_event("internal router error", "internal_error")
    finally:
        d_inst.outstanding -= 1
        if relay.done:
            resp.release()
        else:
            resp.close()  # cancels D's request: the client left or D broke
        if not ended:
            await asyncio.shield(abort(turn, "client-disconnected"))
