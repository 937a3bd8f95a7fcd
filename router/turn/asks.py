"""What a turn asks the engines for beyond its two legs, decided from data: D's token ids
(`return_token_ids`, to verify the next turn) and P's `/tokenize` sent early (during the claim)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from router.config import Settings
from router.connectors.base import Capabilities
from router.turn.incoming import Incoming


def token_ids(settings: Settings, inc: Incoming, d_streams_params: bool) -> bool:
    """D's token ids verify the next turn: a pull, or the decode plan (what D's cache holds).
    On a stream they are worth asking when a handle may come (D's vLLM version streams
    kv_transfer_params (0.33), it was seen doing so, or --stream-kv-params says so) or when
    the decode plan is on."""
    streamed_use = (
        settings.stream_kv_params or d_streams_params or settings.decode_local_max_tokens > 0
    )
    return (
        settings.verify_prefix == "tokens"
        and inc.api != "responses"  # vLLM's /tokenize cannot render Responses input: digest
        and (not inc.stream or streamed_use)
    )


def _has_answer(messages: Sequence[Any]) -> bool:
    return any(isinstance(m, dict) and m.get("role") == "assistant" for m in reversed(messages))


def early_tokens(settings: Settings, caps: Capabilities, inc: Incoming) -> bool:
    """Whether P's /tokenize is worth sending before the claim answers: a chat turn with a
    conversation id and an earlier answer, verified by tokens, over a connector whose turns
    verify a handle (router/turn/early.py then sends it only after a turn that left one)."""
    return (
        inc.conversation_id is not None
        and inc.api == "chat"
        and settings.reuse
        and settings.verify_prefix == "tokens"
        and caps.reuses_d_to_p
        and _has_answer(inc.messages)
    )
