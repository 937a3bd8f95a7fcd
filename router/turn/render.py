"""A Responses prompt as the engine will compute it: vLLM's `/v1/responses/render` (the
token ids its Responses route would prefill), since `/tokenize` cannot render Responses input.

vLLM 0.32 and 0.33 serve the route only when started with `--enable-scale-out` (403
PermissionDeniedError otherwise; older releases have no route, 404): an engine that does not
serve it is learned from its first answer, and its turns keep the item-digest check.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import msgspec

from router.engines.pool import Instance
from router.errors import BadRequest, UpstreamFailure
from router.services import Services
from router.tracing import span
from router.turn.incoming import Incoming
from sessions.model import SessionState

log = logging.getLogger("kvbaton.reuse")

PATH = "/v1/responses/render"
# 403: vLLM without --enable-scale-out; 405: a server with another route there; 501: vLLM's
# "The model does not support Responses Render API". A 404 counts only from the framework
# (no such route): vLLM's own 404 (an unknown model) is an OpenAI error body.
_NOT_SERVED = (403, 405, 501)
# vLLM's words (and the simulator's) for a Responses prompt longer than the context.
_TOO_LONG = re.compile(r"prompt length (\d+) exceeds the max_model_len (\d+)")


def _instance(svc: Services, url: str) -> Instance | None:
    """The engine at `url`: the turn's P, or its D (whose render the decode plan reads)."""
    return svc.pool.find("prefill", url) or svc.pool.find("decode", url)


def may_render(svc: Services, url: str) -> bool:
    """Whether the engine at `url` may serve the route (not yet known counts as yes)."""
    inst = _instance(svc, url)
    return inst is None or inst.ident.renders is not False


def verifiable(svc: Services, state: SessionState, url: str) -> bool:
    """Whether a Responses turn can be verified by tokens on that P: the state records D's
    token ids, and the P may render the new prompt."""
    return bool(state.block_digests or state.seq_digest) and may_render(svc, url)


def not_served(status: int, body: Any) -> bool:
    """Whether an answer says the engine does not serve the route at all."""
    if status in _NOT_SERVED:
        return True
    return status == 404 and not (isinstance(body, dict) and isinstance(body.get("error"), dict))


def body(inc: Incoming, model: str) -> dict[str, Any]:
    """The client's request as the route gets it (the router's own fields are already
    stripped): everything that shapes the prompt (instructions, tools, reasoning) travels."""
    out = dict(inc.body)
    out["model"] = inc.body.get("model") or model
    out["stream"] = False
    return out


def _decode(raw: bytes) -> Any:
    try:
        return msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None


async def prompt_ids(svc: Services, inc: Incoming, url: str, request_id: str) -> list[int] | None:
    """The new Responses prompt's token ids as the engine at `url` renders it; None when it
    does not serve the route (learned, not asked again) or the call failed."""
    inst = _instance(svc, url)
    if inst is not None and inst.ident.renders is False:
        return None
    try:
        with span("kvbaton.verify", instance=url):
            status, raw = await svc.engines.post_json(
                url + PATH,
                body(inc, svc.model),
                request_id=request_id,
                timeout=svc.settings.prefill_timeout,
            )
    except UpstreamFailure as exc:
        log.warning("render on %s failed: %s", url, exc)
        return None
    parsed = _decode(raw)
    if status == 200 and isinstance(parsed, dict):
        try:
            ids = msgspec.convert(parsed.get("token_ids"), list[int])
        except msgspec.ValidationError:
            ids = None
        if ids:
            if inst is not None:
                inst.ident.note_renders(True)
            return ids
    elif not_served(status, parsed):
        if inst is not None:
            inst.ident.note_renders(False, f"HTTP {status}")
        return None
    elif status == 400 and (match := _TOO_LONG.search(raw.decode("utf-8", "replace"))):
        raise too_long(int(match[1]), int(match[2]))
    log.warning("render on %s answered %d: %r", url, status, raw[:200])
    return None


def too_long(tokens: int, limit: int) -> BadRequest:
    """A Responses prompt (a `previous_response_id` chain expanded) that leaves no room for
    output: vLLM clamps `max_output_tokens` to the room left, so only the prompt counts."""
    return BadRequest(
        f"This model's maximum context length is {limit} tokens and your input has {tokens} "
        "tokens (the conversation so far, previous responses included), which leaves no room "
        "for output. Start a new conversation or shorten the input.",
        param="input",
        code="context_length_exceeded",
    )
