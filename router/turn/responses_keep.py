"""The router's response store, written at the end of a Responses turn that asked for `store`:
the finished response (completed, or incomplete at its token limit) with the input it was made
from, signed, for `--response-ttl`; a failed or cancelled one is never stored."""

from __future__ import annotations

import logging

import msgspec

from router.turn.capture import Captured
from router.turn.responses_chain import input_items
from router.turn.state import Turn
from router.turn.strip import strip_fields
from sessions.keys import response_key
from sessions.responses_store import StoredResponse, seal
from sessions.store import StoreError

log = logging.getLogger("kvbaton.responses")
_decode = msgspec.json.Decoder().decode
KEPT_STATUSES = ("completed", "incomplete")


def record(turn: Turn, captured: Captured) -> StoredResponse | None:
    """What is kept of this turn's response; None when there is nothing to keep."""
    if captured.response is None:
        return None
    try:
        obj = _decode(captured.response)
    except msgspec.DecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("id"), str):
        return None
    if obj.get("status") not in KEPT_STATUSES:
        return None
    inc = turn.inc
    strip_fields(obj, not inc.wants_token_ids)  # D's handle, and token ids nobody asked for
    # What the engines were not told (the router keeps the chain), as OpenAI answers it.
    obj["store"] = True
    obj["previous_response_id"] = inc.previous_response_id
    conversation = inc.conversation_id or turn.claim.history_id
    return StoredResponse(
        id=obj["id"],
        response=obj,
        input=input_items(inc.body["input"]),
        conversation=conversation or "",
        named=inc.named,
        turn=turn.committed.turn if turn.committed is not None else 0,
        created_at=turn.svc.clock(),
    )


async def keep(turn: Turn, captured: Captured) -> None:
    """Store the response; a record over --response-max-bytes, or a store that does not
    answer, keeps nothing (one warning: its id answers 404)."""
    svc = turn.svc
    kept = record(turn, captured)
    if kept is None:
        return
    try:
        key = response_key(turn.inc.tenant, kept.id)
    except ValueError:
        log.warning("turn %s: response id %.64r is no key: not stored", turn.request_id, kept.id)
        return
    value = seal(svc.settings.session_secrets, key, kept)
    limit = svc.settings.response_max_bytes
    if len(value) > limit:
        log.warning(
            "turn %s: response %s not stored: its record is %d bytes, over --response-max-bytes "
            "%d (its id answers 404)",
            turn.request_id,
            kept.id,
            len(value),
            limit,
        )
        return
    ttl = svc.settings.response_ttl
    try:
        await svc.guard.call(lambda: svc.responses.put(key, value, ttl))
    except StoreError as exc:
        log.warning("turn %s: response %s not stored: %s", turn.request_id, kept.id, exc)
