"""`previous_response_id`: the stored chain expanded into the whole input before P and D see
it, and the chain's conversation as the turn's session, so KV reuse follows the chain."""

from __future__ import annotations

import logging
import uuid
from dataclasses import replace
from typing import Any

import msgspec

from router.errors import Unavailable, UnknownResponse
from router.services import Services
from router.turn.incoming import Incoming
from router.turn.tenant import conversation_hash
from sessions.keys import response_key
from sessions.responses_store import StoredResponse, unseal
from sessions.store import StoreError

log = logging.getLogger("kvbaton.responses")
_encode = msgspec.json.Encoder().encode


def input_items(raw: str | list[Any]) -> list[Any]:
    """A request's `input` as items (a string is one user message)."""
    return [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)


async def load(svc: Services, tenant: str, response_id: str) -> StoredResponse | None:
    """The tenant's stored response; None when there is none (never stored, expired, deleted,
    another tenant's, or a record that fails its HMAC). Raises Unavailable when the store
    does not answer."""
    try:
        key = response_key(tenant, response_id)
    except ValueError:
        return None
    try:
        value = await svc.guard.call(lambda: svc.responses.get(key))
    except StoreError as exc:
        raise Unavailable(f"the session store is unavailable: {exc}") from None
    if value is None:
        return None
    record = unseal(svc.settings.session_secrets, key, value)
    if record is None:
        log.warning(
            "stored response %s is not used: it does not decode, or no --session-secret made "
            "its HMAC",
            conversation_hash(key),
        )
    return record


async def expand(svc: Services, inc: Incoming) -> Incoming:
    """The request P and D get: after `previous_response_id`, the chain's input items, its
    output items, then the new input; the chain's conversation unless the client named one.
    A stored response without an id to chain on (no history sessions) gets a session now."""
    if inc.previous_response_id is None:
        if inc.store and inc.conversation_id is None and not svc.settings.history_sessions:
            return replace(inc, conversation_id=f"r-{uuid.uuid4().hex}")
        return inc
    prev = await load(svc, inc.tenant, inc.previous_response_id)
    if prev is None:
        raise UnknownResponse(
            f"Previous response with id '{inc.previous_response_id}' not found.",
            code="previous_response_not_found",
            param="previous_response_id",
        )
    earlier = [*prev.input, *output_items(prev.response)]
    body = {**inc.body, "input": [*earlier, *input_items(inc.body["input"])]}
    conversation_id, named = inc.conversation_id, inc.named
    if conversation_id is None and prev.conversation:
        conversation_id, named = prev.conversation, prev.named
    return replace(
        inc,
        body=body,
        conversation_id=conversation_id,
        named=named,
        size=inc.size + len(_encode(earlier)),  # fits.py's byte bound of the whole prompt
    )


def output_items(response: dict[str, Any]) -> list[Any]:
    """A response's output items, as the next request's input takes them (the SDK's way of
    sending an answer back: each item as it came)."""
    output = response.get("output")
    return [item for item in output if isinstance(item, dict)] if isinstance(output, list) else []
