"""Client body -> prefill (P) body and decode (D) body. Pure: the arguments are never mutated."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# Consumed by the router and never forwarded (as vLLM's disagg_proxy_multiturn.py does).
ROUTER_FIELDS = ("conversation_id",)
KV_FIELD = "kv_transfer_params"
_APIS = ("chat", "completions", "responses")
# Each API's route, on the router and on the engines alike.
PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
}
# vLLM rejects these on a max_tokens=1, stream=false request ("not supported for P"):
# stream_options without stream=true is a 400, min_tokens > max_tokens too.
_NOT_FOR_PREFILL = ("stream_options", "min_tokens", "min_completion_tokens")


def split_client_body(body: Mapping[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The body to forward, and the raw (unvalidated) conversation_id or None.

    A client's own kv_transfer_params are dropped: they name blocks on our engines, so
    trusting them would let a client read or pin another tenant's KV.
    """
    forward = {k: v for k, v in body.items() if k not in ROUTER_FIELDS and k != KV_FIELD}
    return forward, body.get("conversation_id")


def prefill_body(
    body: Mapping[str, Any], kv_params: Mapping[str, Any], *, api: str
) -> dict[str, Any]:
    """The P leg: one token, not streamed, carrying `kv_params` (a D handle or the null handoff)."""
    if api not in _APIS:
        raise ValueError(f"unknown api {api!r}; expected one of {_APIS}")
    out = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    out["stream"] = False
    if api == "responses":
        out["max_output_tokens"] = 1
    else:
        out["max_tokens"] = 1
        if "max_completion_tokens" in out:
            out["max_completion_tokens"] = 1
    if kv_params:  # a connector with no fields (store) sends none
        out[KV_FIELD] = dict(kv_params)
    return out


# A P leg sent as token ids (/v1/completions) keeps only what changes P's KV: the model
# (and LoRA), the cache salt (part of every block hash) and the scheduling priority. The
# rest shapes sampling or output, and P's one token is discarded.
# vLLM's session identity (`session_id`, 0.32) is forwarded untouched, on this leg too.
_IDS_LEG_FIELDS = ("model", "cache_salt", "priority", "session_id")
# Fields that change the prompt P's own route would build from the body but that /tokenize
# does not take (or that carry more than token ids): with any of them P gets the body.
_NOT_RENDERED_BY_TOKENIZE = (
    "truncate_prompt_tokens",
    "reasoning_effort",
    "mm_processor_kwargs",
    "prompt_embeds",
    "multi_modal_data",
)


def ids_leg_allowed(api: str, body: Mapping[str, Any]) -> bool:
    """Whether /tokenize's token ids are the whole prompt P would build from `body`: text
    only (an image's placeholder tokens do not carry the image), nothing /tokenize ignores."""
    if api not in ("chat", "completions"):
        return False
    if any(k in body for k in _NOT_RENDERED_BY_TOKENIZE):
        return False
    if api == "completions":
        return True
    messages = body.get("messages")
    return isinstance(messages, list) and all(_text_only(m) for m in messages)


def _text_only(message: object) -> bool:
    if not isinstance(message, Mapping):
        return False
    content = message.get("content")
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(part, Mapping) and part.get("type") == "text" for part in content
    )


def ids_prefill_body(
    body: Mapping[str, Any], prompt_ids: list[int], kv_params: Mapping[str, Any]
) -> dict[str, Any]:
    """The P leg as /v1/completions on the prompt's token ids (from P's own /tokenize), so P
    does not render and tokenize the whole conversation a second time."""
    out = {k: body[k] for k in _IDS_LEG_FIELDS if k in body}
    out["prompt"] = prompt_ids
    out["max_tokens"] = 1
    out["stream"] = False
    if kv_params:
        out[KV_FIELD] = dict(kv_params)
    return out


# How each API asks the engine for the prompt's and the output's token ids: chat and
# completions by `return_token_ids`; Responses by `enable_response_messages` (the response's
# `input_messages`/`output_messages` then carry them as `raw_message_tokens`).
TOKEN_IDS_FIELD = {
    "chat": "return_token_ids",
    "completions": "return_token_ids",
    "responses": "enable_response_messages",
}


def decode_body(
    body: Mapping[str, Any],
    kv_params: Mapping[str, Any] | None,
    *,
    return_token_ids: bool,
    api: str = "chat",
) -> dict[str, Any]:
    """The D leg: the client's own body (stream, limits) plus P's params when P returned any."""
    out = dict(body)
    if kv_params is None:
        # No params from P: D prefills locally. Never forward a P-leg dict (vLLM's
        # disagg_proxy_multiturn.py does, and D then reads D's own blocks).
        out.pop(KV_FIELD, None)
    else:
        out[KV_FIELD] = dict(kv_params)
    if return_token_ids:
        out[TOKEN_IDS_FIELD[api]] = True
    return out


def client_wants_token_ids(body: Mapping[str, Any], api: str = "chat") -> bool:
    return body.get(TOKEN_IDS_FIELD[api]) is True
