"""What a Responses API request asks of the router's state: `store`, `previous_response_id`,
and the `conversation` (or, for any API, OpenAI's `prompt_cache_key`) that names a session.
Pure: the arguments are never mutated."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from router.errors import BadRequest

# Read here and not forwarded: the router keeps the history, so the engines get the whole
# conversation and must keep nothing themselves (vLLM's own store never expires).
_CONSUMED = ("previous_response_id", "conversation")
# vLLM's and OpenAI's response ids (`resp_<hex>`), and whatever else a client may have kept:
# the characters a Redis key may hold between our braces.
_RESPONSE_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


@dataclass(frozen=True)
class Asked:
    """A Responses request's state fields: whether the router keeps the finished response,
    the response it continues, and the session it names (raw, validated by the caller)."""

    store: bool = False
    previous_response_id: str | None = None
    conversation: Any = None


def check_input(body: Mapping[str, Any]) -> None:
    raw = body.get("input")
    if not (isinstance(raw, str) and raw) and not (isinstance(raw, list) and raw):
        raise BadRequest("'input' must be a non-empty string or list of items", param="input")
    if isinstance(raw, list) and not all(isinstance(item, dict) for item in raw):
        raise BadRequest("every 'input' item must be an object", param="input")


def response_id(value: object, param: str = "previous_response_id") -> str:
    """A response id as a client may send it, or BadRequest naming `param`."""
    if not isinstance(value, str) or not _RESPONSE_ID.fullmatch(value):
        raise BadRequest(
            f"'{param}' must be a response id: 1 to 128 characters from "
            "A-Z a-z 0-9 . _ : @ / + = -",
            param=param,
        )
    return value


def asked(body: Mapping[str, Any], *, keeping: bool) -> Asked:
    """The state fields of a Responses body. `keeping`: the router stores responses
    (--response-ttl > 0); without it `store` is accepted and ignored, as vLLM does without
    VLLM_ENABLE_RESPONSES_API_STORE, and `previous_response_id` cannot be served."""
    store = body.get("store")
    if store is not None and not isinstance(store, bool):
        raise BadRequest("'store' must be a boolean", param="store")
    previous = body.get("previous_response_id")
    if previous is not None:
        previous = response_id(previous)
        if not keeping:
            raise BadRequest(
                "previous_response_id needs the router's response store, which is off "
                "(--response-ttl 0): send the whole conversation in 'input'",
                param="previous_response_id",
            )
    conversation = body.get("conversation")
    if isinstance(conversation, Mapping):
        conversation = conversation.get("id")
        if conversation is None:
            raise BadRequest(
                "'conversation' must be an id or an object with an 'id'", param="conversation"
            )
    if conversation is not None and previous is not None:
        # OpenAI's rule: a conversation keeps its own history, a chain its own.
        raise BadRequest(
            "'previous_response_id' and 'conversation' cannot be used together",
            param="conversation",
        )
    return Asked(keeping and store is not False, previous, conversation)


def engine_body(body: Mapping[str, Any]) -> dict[str, Any]:
    """The body the engines get: the router's state fields out, and `store: false`."""
    out = {k: v for k, v in body.items() if k not in _CONSUMED}
    out["store"] = False
    return out


def cache_key(body: Mapping[str, Any]) -> Any:
    """OpenAI's `prompt_cache_key` (chat and Responses): a client's name for requests that
    share a prefix, kept per conversation by most clients; it names a session here too, and
    is forwarded untouched."""
    return body.get("prompt_cache_key")
