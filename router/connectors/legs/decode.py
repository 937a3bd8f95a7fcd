"""The D leg: sent with P's params (or none), its status checked before our response starts,
then relayed (streamed or whole) with D's handle captured and the turn committed at its end."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any

from starlette.responses import Response
from starlette.types import Send

from router.connectors.legs.calls import parse_answer
from router.engines.client import EngineStream
from router.engines.pool import Instance
from router.engines.versions import engine_paused
from router.errors import (
    EngineReply,
    MalformedAnswer,
    UpstreamError,
    UpstreamFailure,
    error_bytes,
    sse_error_event,
)
from router.relay import RelayResponse
from router.services import Services
from router.tracing import span
from router.turn.capture import TERMINAL_NAMES
from router.turn.commit import abort, finish
from router.turn.decide import asks
from router.turn.rewrite import PATHS, decode_body
from router.turn.sse import SseRelay, capture_body
from router.turn.state import Turn
from sessions.vocabulary import AbortReason, LegOutcome

log = logging.getLogger("kvbaton.turn")
JSON = "application/json"


async def open_decode(turn: Turn, d_inst: Instance, params: dict[str, Any] | None) -> EngineStream:
    """Send the D leg (P's params, or none: D computes what its cache lacks) and check its
    status before our response starts."""
    svc, inc = turn.svc, turn.inc
    kv = svc.connector.decode_params(params)
    body = decode_body(inc.body, kv, return_token_ids=turn.want_token_ids, api=inc.api)
    headers = turn.leg_headers(d_inst)
    if turn.ahead is not None and not turn.leg_id:
        # The same request sent beside the claim (router/turn/ahead.py): its answer, if so.
        sent = await turn.ahead.take(d_inst, headers, body)
        if sent is not None:
            return sent
    try:
        return await send(svc, d_inst, inc.api, body, turn.leg_id or turn.request_id, headers)
    except EngineReply:
        # D refused before reading P's blocks: P would keep them for its kv_lease_duration; a
        # D request that reads them frees them now. (A request D got and the client cancels
        # is D's to give back: vLLM notifies P of a request aborted before its load.)
        if svc.releaser is not None and turn.prefill is not None:
            svc.releaser.submit_prefilled(params, turn.prefill.url)
        raise


async def send(
    svc: Services,
    d_inst: Instance,
    api: str,
    body: dict[str, Any],
    request_id: str,
    headers: dict[str, str],
) -> EngineStream:
    """D's request, its status checked: an open answer, or EngineReply (D's 4xx) or
    UpstreamFailure (anything else)."""
    url = d_inst.url + PATHS[api]
    started = time.monotonic()
    outcome = LegOutcome.ERROR
    try:
        # In flight on D from the request on: a JSON answer comes whole, so for it the
        # open is the whole decode.
        stream = bool(body.get("stream"))
        with span("kvbaton.decode", instance=d_inst.url, stream=stream), svc.pool.busy(d_inst):
            resp = await svc.engines.open_stream(
                url, body, request_id=request_id, extra_headers=headers
            )
        if resp.status >= 500:
            text = await _read_error(resp)
            raise UpstreamFailure(
                f"{url} answered {resp.status}: {text[:200]!r}",
                busy=engine_paused(resp.status, parse_answer(text.encode())),
            )
        if resp.status != 200:
            raw = await resp.read()
            outcome = LegOutcome.CLIENT_ERROR
            raise EngineReply(resp.status, raw)
        outcome = LegOutcome.OK
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


async def decode(turn: Turn, d_inst: Instance, params: dict[str, Any] | None) -> Response:
    turn.decode = d_inst
    turn.want_token_ids = asks.token_ids(turn.svc.settings, turn.inc, d_inst.ident.streams_handles)
    return await respond(turn, d_inst, await open_decode(turn, d_inst, params))


async def respond(turn: Turn, d_inst: Instance, resp: EngineStream) -> Response:
    """Relay D's answer (streamed or whole) and commit at its end."""
    svc, inc = turn.svc, turn.inc
    svc.pool.record_success(d_inst)
    strip = not inc.wants_token_ids and turn.want_token_ids
    if inc.stream:
        relay = functools.partial(_relay, turn, d_inst, resp, strip)
        # D's content type is not trusted: a stream is relayed as one whatever D labelled it.
        kind = resp.content_type
        kind = kind if kind.startswith("text/event-stream") else "text/event-stream"
        return RelayResponse(relay, turn.final_headers(), kind)
    try:
        with svc.pool.busy(d_inst):
            chunks = [c async for c in resp.chunks(svc.settings.decode_idle_timeout)]
    except BaseException:
        resp.close()  # the client left or D broke: D cancels the request
        raise
    resp.release()
    try:
        client_bytes, captured = capture_body(b"".join(chunks), strip_token_ids=strip)
    except MalformedAnswer as exc:
        await _malformed(turn, d_inst, exc)
        error = UpstreamError(f"the decode engine's answer was malformed: {exc}", code="malformed")
        return Response(error_bytes(error), 502, headers=turn.final_headers(), media_type=JSON)
    turn.mark_first_byte()
    await finish(turn, captured)
    return Response(client_bytes, 200, headers=turn.final_headers(), media_type=JSON)


async def _malformed(turn: Turn, d_inst: Instance, exc: MalformedAnswer) -> None:
    """D answered 200 with what the API does not promise (its content type is not trusted):
    one WARNING with what came, counted against D, and nothing stored."""
    log.warning("decode answer from %s refused: %s: %r", d_inst.url, exc, exc.sample)
    turn.svc.metrics.malformed.labels(d_inst.url).inc()
    turn.svc.pool.record_failure(d_inst, f"malformed answer: {exc}")
    await abort(turn, AbortReason.DECODE_MALFORMED)


async def _relay(turn: Turn, d_inst: Instance, resp: EngineStream, strip: bool, send: Send) -> None:
    """Send D's SSE bytes on as they come; capture D's handle; commit before `[DONE]` goes
    out. Cancelled (the client left): D's request is cancelled and the turn aborted. An
    event that is not JSON or a stream cut without its terminator ends with
    one error event, as a stall does."""
    relay = SseRelay(strip_token_ids=strip, responses=turn.inc.api == "responses")
    # A response the router stores is stored before its last event goes out, so that a client
    # that continues it on that event finds it (router/turn/responses_keep.py).
    hold = turn.inc.store
    ended = False
    d_inst.outstanding += 1
    try:
        async for chunk in resp.chunks(turn.svc.settings.decode_idle_timeout):
            out = relay.feed(chunk)
            if relay.bad or (not ended and (relay.done or (hold and _ends_responses(relay, out)))):
                relay.check(at_end=False)  # an event that is not JSON: not passed on
                ended = True
                await finish(turn, relay.captured)
            if out:
                turn.mark_first_byte()
                await send({"type": "http.response.body", "body": out, "more_body": True})
        tail = relay.flush()
        if not ended:
            relay.check(at_end=True, sample=tail)
            ended = True
            await finish(turn, relay.captured)
        if tail:
            await send(_body(tail))
    except (MalformedAnswer, UpstreamFailure) as exc:
        ended = True
        await send(_body(await _broke(turn, d_inst, exc)))
    except Exception as exc:
        # Design rule 8: after the first byte every failure ends the stream with one error
        # event, never a cut 200; one log line, the traceback at debug level.
        log.error("turn %s failed mid-stream: %s: %.200s", turn.request_id, type(exc).__name__, exc)
        log.debug("traceback of the error above", exc_info=exc)
        ended = True
        await abort(turn, AbortReason.raised(exc))
        await send(_body(sse_error_event("internal router error", "internal_error")))
    finally:
        d_inst.outstanding -= 1
        if relay.done:
            resp.release()
        else:
            resp.close()  # cancels D's request: the client left or D broke
        if not ended:
            await asyncio.shield(abort(turn, AbortReason.CLIENT_DISCONNECTED))


async def _broke(turn: Turn, d_inst: Instance, exc: MalformedAnswer | UpstreamFailure) -> bytes:
    """After the first byte the status is sent: the turn aborted (no commit), and the one SSE
    error event that ends the stream."""
    if isinstance(exc, MalformedAnswer):
        await _malformed(turn, d_inst, exc)
        return sse_error_event(f"the decode engine's stream was malformed: {exc}")
    log.warning("decode stream from %s broke: %s", d_inst.url, exc)
    turn.svc.pool.record_failure(d_inst, str(exc), stalled=exc.stalled)
    await abort(turn, AbortReason.DECODE_BROKE)
    return sse_error_event(f"the decode engine failed mid-stream: {exc}")


def _ends_responses(relay: SseRelay, out: bytes) -> bool:
    """Whether `out` holds a Responses stream's last event (which sets its finish or error):
    the events held are decoded only when one of those events' names is in the bytes."""
    if not any(out.find(name) >= 0 for name in TERMINAL_NAMES):
        return False
    captured = relay.captured
    return captured.finish_reason is not None or captured.error is not None


def _body(chunk: bytes) -> dict[str, Any]:
    return {"type": "http.response.body", "body": chunk, "more_body": True}
