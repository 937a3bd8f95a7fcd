"""What a turn asks the engines for beyond its two legs, decided from data: D's token ids
(`return_token_ids`, to verify the next turn) and P's `/tokenize` sent early (during the claim)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from router.config import Settings
from router.turn.incoming import Incoming


class Reuses(Protocol):
    """What early_tokens asks of the connector's capabilities (connectors/base.py's
    `Capabilities` is one)."""

    @property
    def reuses_d_to_p(self) -> bool: ...


def token_ids(settings: Settings, inc: Incoming, d_streams_params: bool) -> bool:
    """D's token ids verify the next turn: a pull, or the decode plan (what D's cache holds).
    On a stream they are worth asking when a handle may come (D's vLLM version streams
    kv_transfer_params (0.33), it was seen doing so, or --stream-kv-params says so; a
    Responses stream always brings it, in `response.completed`) or when the decode plan is
    on. A Responses turn's are checked against P's /v1/responses/render next turn."""
    used = handle_seen(settings, inc, d_streams_params) or settings.decode_local_max_tokens > 0
    return settings.verify_prefix == "tokens" and used


def handle_seen(settings: Settings, inc: Incoming, d_streams_params: bool) -> bool:
    """Whether D's handle reaches the router at the turn's end: a JSON answer, or a stream
    that carries it. A turn on D alone asks D to keep its blocks only then: a handle nobody
    sees would stay pinned on D until its TTL."""
    streamed = settings.stream_kv_params or d_streams_params or inc.api == "responses"
    return not inc.stream or streamed


def _has_answer(messages: Sequence[Any]) -> bool:
    return any(isinstance(m, dict) and m.get("role") == "assistant" for m in reversed(messages))


def early_tokens(settings: Settings, caps: Reuses, inc: Incoming) -> bool:
    """Whether P's /tokenize (a Responses turn: its render) is worth sending before the claim
    answers: a chat or Responses turn with a conversation id and an earlier answer, verified
    by tokens, over a connector whose turns verify a handle (router/turn/early.py then sends
    it only after a turn that left one, to a P not known to lack the render route)."""
    return (
        inc.conversation_id is not None
        and inc.api in ("chat", "responses")
        and settings.reuse
        and settings.verify_prefix == "tokens"
        and caps.reuses_d_to_p
        and _has_answer(inc.items)
    )
