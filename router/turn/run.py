"""One conversation turn: claim, verify, place, prefill on P, decode on D, capture, commit."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from starlette.responses import Response, StreamingResponse

from router.engines.client import UpstreamFailure, iter_chunks
from router.engines.pool import Instance
from router.errors import Unavailable, UpstreamError, sse_error_event
from router.services import Services
from router.tracing import span
from router.turn.commit import abort, finish
from router.turn.incoming import Incoming
from router.turn.prefill import PATHS, EngineReply, Prefilled, prefill
from router.turn.reuse import Claim, claim, verify
from router.turn.rewrite import decode_body
from router.turn.sse import SseRelay, capture_body

log = logging.getLogger("kvbaton.turn")


@dataclass
class Turn:
    """One turn in flight: what was decided so far."""

    svc: Services
    inc: Incoming
    request_id: str
    claim: Claim
    started: float
    prefill: Instance | None = None
    decode: Instance | None = None
    prefill_ids: list[int] | None = None  # the prompt P got as token ids, if it did
    want_token_ids: bool = False
    first_byte: float = 0.0
    _reuse_counted: bool = False

    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id, "X-KV-Reuse": self.claim.reuse.header()}

    def response_headers(self) -> dict[str, str]:
        """The headers of the response; the reuse verdict is final now, so count it."""
        if not self._reuse_counted:
            self._reuse_counted = True
            reuse = self.claim.reuse
            self.svc.metrics.reuse.labels(reuse.outcome, reuse.reason).inc()
            if reuse.outcome == "hit":
                self.svc.metrics.reused_tokens.inc(reuse.tokens)
        return self.headers()

    def mark_first_byte(self) -> None:
        if not self.first_byte:
            self.first_byte = time.monotonic()
            self.svc.metrics.ttft.labels(self.inc.api).observe(self.first_byte - self.started)


def new_request_id() -> str:
    return uuid.uuid4().hex


async def run_turn(svc: Services, inc: Incoming) -> Response:
    """Serve one client request through P and D; the response may still be streaming."""
    request_id = new_request_id()
    turn = Turn(svc, inc, request_id, await claim(svc, inc, request_id), time.monotonic())
    try:
        return await _route(turn)
    except EngineReply as reply:
        await abort(turn, f"engine-{reply.status}")
        return Response(
            reply.body,
            reply.status,
            headers=turn.response_headers(),
            media_type="application/json",
        )
    except asyncio.CancelledError:
        await asyncio.shield(abort(turn, "client-disconnected"))
        raise
    except BaseException as exc:
        await abort(turn, type(exc).__name__)
        raise


async def _route(turn: Turn) -> Response:
    svc, inc = turn.svc, turn.inc
    state = turn.claim.state
    p_inst = svc.pool.pick("prefill", prefer=state.prefill if state else "")
    source = _handle_source(turn)
    if source is not None and turn.claim.params is not None:
        p_inst = _reader(turn, source, p_inst)
    turn.claim = await verify(svc, inc, turn.claim, p_inst.url, turn.request_id)
    turn.want_token_ids = (
        svc.settings.verify_prefix == "tokens"
        and inc.api != "responses"  # vLLM's /tokenize cannot render Responses input: digest
        and (not inc.stream or svc.settings.stream_kv_params)
    )
    tried: list[str] = []
    while True:
        sent = source if turn.claim.params is not None else None  # the handle's D, if sent
        prefilled = await prefill(turn, p_inst)
        turn.prefill = prefilled.instance
        turn.prefill_ids = prefilled.prompt_ids
        if prefilled.refused_by:
            turn.claim = turn.claim.miss("handle-rejected")
            if sent is not None:
                sent.note_refused(prefilled.refused_by, time.monotonic())
        elif sent is not None:
            sent.note_read(prefilled.instance.url)
        d_inst = _pick_decode(svc, state.decode if state else "", tried)
        try:
            return await _decode(turn, d_inst, prefilled)
        except UpstreamFailure as exc:
            # D failed before its first byte: redo the whole turn with a new P leg, since
            # P's params are single use (never send them to a second D).
            svc.pool.record_failure(d_inst, str(exc))
            tried.append(d_inst.url)
            log.warning("decode on %s failed before the first byte: %s", d_inst.url, exc)
            if len(tried) >= 2:
                raise UpstreamError(f"decode failed twice; last: {exc}") from None
            if turn.claim.params is not None:
                turn.claim = turn.claim.miss("decode-retried")
            p_inst = svc.pool.pick("prefill", prefer=turn.prefill.url)


def _handle_source(turn: Turn) -> Instance | None:
    """The D of the conversation's last turn (the one that made a claimed handle), if the
    router still routes to it."""
    state = turn.claim.state
    return turn.svc.pool.find("decode", state.decode) if state is not None else None


def _reader(turn: Turn, source: Instance, p_inst: Instance) -> Instance:
    """A P that has not been refusing the handle's D (`source`); with none left, the turn's
    claim becomes a miss (reads-paused) and p_inst serves it."""
    now = time.monotonic()
    if not source.reads_paused(p_inst.url, now):
        return p_inst
    paused = [url for url in source.refused_by if source.reads_paused(url, now)]
    try:
        return turn.svc.pool.pick("prefill", exclude=paused)
    except Unavailable:
        turn.claim = turn.claim.miss("reads-paused")
        return p_inst


def _pick_decode(svc: Services, prefer: str, tried: list[str]) -> Instance:
    """Another D than the ones that failed this turn, or the same one again if it is alone."""
    try:
        return svc.pool.pick("decode", prefer=prefer, exclude=tried)
    except Unavailable:
        if not tried:
            raise
        return svc.pool.pick("decode", prefer=prefer)


async def _open_decode(
    turn: Turn, d_inst: Instance, prefilled: Prefilled
) -> aiohttp.ClientResponse:
    """Send the D leg and check its status before our response starts."""
    svc, inc = turn.svc, turn.inc
    body = decode_body(inc.body, prefilled.params, return_token_ids=turn.want_token_ids)
    url = d_inst.url + PATHS[inc.api]
    started = time.monotonic()
    outcome = "error"
    try:
        with span("kvbaton.decode", instance=d_inst.url, stream=inc.stream):
            resp = await svc.upstream.open_stream(
                url, body, request_id=turn.request_id, extra_headers=inc.forward_headers
            )
        if resp.status >= 500:
            text = await _read_error(resp)
            raise UpstreamFailure(f"{url} answered {resp.status}: {text[:200]!r}")
        if resp.status != 200:
            raw = await resp.read()
            resp.release()
            outcome = "client-error"
            raise EngineReply(resp.status, raw)
        outcome = "ok"
        return resp
    finally:
        svc.metrics.upstream.labels("decode", d_inst.url, outcome).observe(
            time.monotonic() - started
        )


async def _decode(turn: Turn, d_inst: Instance, prefilled: Prefilled) -> Response:
    svc, inc = turn.svc, turn.inc
    turn.decode = d_inst
    resp = await _open_decode(turn, d_inst, prefilled)
    svc.pool.record_success(d_inst)
    strip = not inc.wants_token_ids and turn.want_token_ids
    if inc.stream:
        return StreamingResponse(
            _relay(turn, resp, strip),
            200,
            headers=turn.response_headers(),
            media_type=resp.headers.get("Content-Type", "text/event-stream"),
        )
    try:
        with svc.pool.busy(d_inst):
            chunks = [c async for c in iter_chunks(resp, svc.settings.decode_idle_timeout)]
    finally:
        resp.release()
    client_bytes, captured = capture_body(b"".join(chunks), strip_token_ids=strip)
    turn.mark_first_byte()
    await finish(turn, captured)
    return Response(
        client_bytes, 200, headers=turn.response_headers(), media_type="application/json"
    )


async def _read_error(resp: aiohttp.ClientResponse) -> str:
    try:
        return (await resp.read()).decode("utf-8", "replace")
    except aiohttp.ClientError:
        return ""
    finally:
        resp.release()


async def _relay(turn: Turn, resp: aiohttp.ClientResponse, strip: bool) -> AsyncIterator[bytes]:
    """Relay D's SSE bytes as they come; capture D's handle; commit before `[DONE]` goes out."""
    relay = SseRelay(strip_token_ids=strip)
    ended = False
    assert turn.decode is not None
    turn.decode.outstanding += 1
    try:
        async for chunk in iter_chunks(resp, turn.svc.settings.decode_idle_timeout):
            out = relay.feed(chunk)
            if relay.captured.done and not ended:
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
        log.warning("decode stream from %s broke: %s", turn.decode.url, exc)
        turn.svc.pool.record_failure(turn.decode, str(exc))
        ended = True
        await abort(turn, "decode-broke")
        yield sse_error_event(f"the decode engine failed mid-stream: {exc}")
    finally:
        turn.decode.outstanding -= 1
        if relay.captured.done:
            resp.release()
        else:
            resp.close()  # cancels D's request: the client left or D broke
        if not ended:
            await asyncio.shield(abort(turn, "client-disconnected"))
