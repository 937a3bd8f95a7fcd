"""One conversation turn: claim, verify, place, prefill on P, decode on D, capture, commit."""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
from starlette.responses import Response, StreamingResponse

from router import handoff
from router.backends import Instance
from router.errors import Unavailable, UpstreamError, sse_error_event
from router.incoming import Incoming
from router.legs import PATHS, EngineReply, Prefilled, prefill
from router.reuse import Claim, claim, verify
from router.rewrite import decode_body
from router.services import Services
from router.sse import Captured, SseRelay, capture_body
from router.upstream import UpstreamFailure, iter_chunks
from sessions import model as sm
from sessions.store import StoreError

log = logging.getLogger("kvbaton.turn")

NORMAL_FINISH = ("stop", "length")


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
    want_token_ids: bool = False

    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id, "X-KV-Reuse": self.claim.reuse.header()}


def new_request_id() -> str:
    return uuid.uuid4().hex


async def run_turn(svc: Services, inc: Incoming) -> Response:
    """Serve one client request through P and D; the response may still be streaming."""
    request_id = new_request_id()
    turn = Turn(svc, inc, request_id, await claim(svc, inc, request_id), time.monotonic())
    try:
        return await _route(turn)
    except EngineReply as reply:
        await _release(turn)
        return Response(
            reply.body, reply.status, headers=turn.headers(), media_type="application/json"
        )
    except BaseException:
        await _release(turn)
        raise


async def _route(turn: Turn) -> Response:
    svc, inc = turn.svc, turn.inc
    state = turn.claim.state
    p_inst = svc.pool.pick("prefill", prefer=state.prefill if state else "")
    turn.claim = await verify(svc, inc, turn.claim, p_inst.url, turn.request_id)
    turn.want_token_ids = svc.settings.verify_prefix == "tokens" and (
        not inc.stream or svc.settings.stream_kv_params
    )
    tried: list[str] = []
    while True:
        prefilled = await prefill(turn, p_inst)
        turn.prefill = prefilled.instance
        if prefilled.rejected_handle:
            turn.claim = turn.claim.miss("handle-rejected")
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


def _pick_decode(svc: Services, prefer: str, tried: list[str]) -> Instance:
    """Another D than the ones that failed this turn, or the same one again if it is alone."""
    try:
        return svc.pool.pick("decode", prefer=prefer, exclude=tried)
    except Unavailable:
        if not tried:
            raise
        return svc.pool.pick("decode", prefer=prefer)


async def _decode(turn: Turn, d_inst: Instance, prefilled: Prefilled) -> Response:
    svc, inc = turn.svc, turn.inc
    turn.decode = d_inst
    body = decode_body(inc.body, prefilled.params, return_token_ids=turn.want_token_ids)
    url = d_inst.url + PATHS[inc.api]
    resp = await svc.upstream.open_stream(
        url, body, request_id=turn.request_id, extra_headers=inc.forward_headers
    )
    if resp.status >= 500:
        text = await _read_error(resp)
        raise UpstreamFailure(f"{url} answered {resp.status}: {text[:200]!r}")
    if resp.status != 200:
        raw = await resp.read()
        resp.release()
        raise EngineReply(resp.status, raw)
    svc.pool.record_success(d_inst)
    strip = not inc.wants_token_ids and turn.want_token_ids
    if inc.stream:
        return StreamingResponse(
            _relay(turn, resp, strip),
            200,
            headers=turn.headers(),
            media_type=resp.headers.get("Content-Type", "text/event-stream"),
        )
    try:
        with svc.pool.busy(d_inst):
            chunks = [c async for c in iter_chunks(resp, svc.settings.decode_idle_timeout)]
    finally:
        resp.release()
    raw = b"".join(chunks)
    client_bytes, captured = capture_body(raw, strip_token_ids=strip)
    await _finish(turn, captured)
    return Response(client_bytes, 200, headers=turn.headers(), media_type="application/json")


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
    committed = False
    if turn.decode is not None:
        turn.decode.outstanding += 1
    try:
        async for chunk in iter_chunks(resp, turn.svc.settings.decode_idle_timeout):
            out = relay.feed(chunk)
            if relay.captured.done and not committed:
                committed = True
                await _finish(turn, relay.captured)
            if out:
                yield out
        tail = relay.flush()
        if not committed:
            committed = True
            await _finish(turn, relay.captured)
        if tail:
            yield tail
    except UpstreamFailure as exc:
        log.warning("decode stream from %s broke: %s", resp.url, exc)
        if turn.decode is not None:
            turn.svc.pool.record_failure(turn.decode, str(exc))
        yield sse_error_event(f"the decode engine failed mid-stream: {exc}")
    finally:
        if turn.decode is not None:
            turn.decode.outstanding -= 1
        if relay.captured.done:
            resp.release()
        else:
            resp.close()  # cancels D's request: the client left or D broke
        if not committed:
            await _release(turn)


async def _finish(turn: Turn, captured: Captured) -> None:
    """Commit the conversation's new state after a normal finish; otherwise release it."""
    if captured.error is not None or captured.finish_reason not in NORMAL_FINISH:
        await _release(turn)
        return
    if turn.claim.key is None or turn.prefill is None or turn.decode is None:
        return
    state = next_state(turn, captured)
    expected = turn.claim.state.turn if turn.claim.state else 0
    svc = turn.svc
    try:
        ok = await svc.guard.call(
            lambda: svc.store.commit(
                turn.claim.key or "", state, expected, svc.settings.session_ttl
            )
        )
    except StoreError:
        return
    if not ok:
        log.info("turn %s lost the commit race for %s", turn.request_id, turn.claim.key)


def next_state(turn: Turn, captured: Captured) -> sm.SessionState:
    svc, inc = turn.svc, turn.inc
    params = captured.kv_transfer_params if handoff.is_handle(captured.kv_transfer_params) else None
    reason = ""
    if not svc.settings.reuse:
        params, reason = None, "reuse-disabled"
    elif captured.tool_calls:
        params, reason = None, "tool-calls"
    elif params is None:
        reason = "stream-no-kv-params" if inc.stream else "no-kv-params"
    prompt_digest, prompt_len, prefix_digest, prefix_len = _digests(inc, captured)
    token_ids: list[int] | None = None
    if turn.want_token_ids and captured.prompt_token_ids is not None:
        token_ids = [*captured.prompt_token_ids, *captured.output_token_ids]
    elif params is not None and svc.settings.verify_prefix == "tokens":
        params, reason = None, "no-token-ids"
    assert turn.prefill is not None and turn.decode is not None
    return sm.next_state(
        turn.claim.state,
        api=inc.api,
        prefill=turn.prefill.url,
        decode=turn.decode.url,
        kv_transfer_params=params,
        no_handle_reason=reason,
        prefix_digest=prefix_digest,
        prefix_len=prefix_len,
        prompt_digest=prompt_digest,
        prompt_len=prompt_len,
        token_ids=token_ids,
        block_size=svc.block_size or turn.decode.block_size,
        now=svc.clock(),
        handle_ttl=svc.settings.handle_ttl,
    )


def _digests(inc: Incoming, captured: Captured) -> tuple[str, int, str, int]:
    """Digests of the conversation as sent (prompt) and as D holds it (prompt + answer)."""
    if inc.api == "chat":
        answer: dict[str, Any] = {"role": "assistant", "content": captured.output_text}
        items = [*inc.messages, answer]
        return (
            sm.conversation_digest(inc.api, inc.messages),
            len(inc.messages),
            sm.conversation_digest(inc.api, items),
            len(items),
        )
    prompt = inc.prompt
    if not isinstance(prompt, str):
        return "", 0, "", 0
    text = prompt + captured.output_text
    return (sm.text_digest(inc.api, prompt), len(prompt), sm.text_digest(inc.api, text), len(text))


async def _release(turn: Turn) -> None:
    """A failed or cancelled turn commits nothing; it only gives back its claim."""
    svc, key = turn.svc, turn.claim.key
    if key is None or not turn.claim.claimed:
        return
    with contextlib.suppress(StoreError):
        await svc.guard.call(lambda: svc.store.release(key, turn.request_id))


def decode_json(raw: bytes) -> Any:
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
