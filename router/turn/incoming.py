"""The client's request, read once and validated: what the router routes on, and nothing more."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Literal

import msgspec

from router.errors import BadRequest, NotFound, PayloadTooLarge, UnsupportedMediaType
from router.turn import responses_input
from router.turn.rewrite import client_wants_token_ids, split_client_body
from router.turn.tenant import tenant_of_headers, validate_conversation_id
from sessions import digests

Api = Literal["chat", "completions", "responses"]

_decoder = msgspec.json.Decoder()
# The deepest JSON the router accepts. Digests and rewrites walk the client's values; Python
# recursion stops near 1000 levels, and no OpenAI request needs more than a few dozen.
MAX_JSON_DEPTH = 64
# Each API's output-token limits (vLLM: an int >= 1 that leaves room for a prompt).
_TOKEN_LIMITS: dict[str, tuple[str, ...]] = {
    "chat": ("max_tokens", "max_completion_tokens"),
    "completions": ("max_tokens",),
    "responses": ("max_output_tokens",),
}


@dataclass(frozen=True)
class Incoming:
    """A validated client request. `body` is what the engines get (router fields stripped)."""

    api: Api
    body: dict[str, Any]
    stream: bool
    conversation_id: str | None
    tenant: str
    wants_token_ids: bool
    forward_headers: Mapping[str, str] = field(default_factory=dict)
    size: int = 0  # the body's bytes, as the client sent them (router/turn/fits.py)
    # Responses API state (router/turn/responses_chain.py): the router keeps the finished
    # response; the one it continues; whether the client named the conversation.
    store: bool = False
    previous_response_id: str | None = None
    named: bool = False

    @cached_property
    def heads(self) -> list[str]:
        """`conversation_heads` of the canonical items (chat, Responses): computed once per
        turn for the history lookup, the claim's prefix check and the commit (a frozen
        dataclass's cached_property writes the instance's __dict__, not a field)."""
        return digests.conversation_heads(self.api, canonical_items(self))

    @property
    def messages(self) -> list[Any]:
        messages: list[Any] = self.body["messages"]
        return messages

    @property
    def items(self) -> list[Any]:
        """The conversation as items: chat messages, or a Responses request's input with its
        instructions as a leading system item."""
        if self.api == "chat":
            return self.messages
        raw = self.body["input"]
        items = [{"role": "user", "content": raw}] if isinstance(raw, str) else list(raw)
        instructions = self.body.get("instructions")
        if instructions:
            items.insert(0, {"role": "system", "content": instructions})
        return items

    @property
    def prompt(self) -> str | list[int]:
        """The single completions prompt: text, or token ids."""
        prompt = self.body["prompt"]
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            prompt = prompt[0]
        return prompt  # type: ignore[no-any-return]


def check_content_type(content_type: str | None) -> None:
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json":
        raise UnsupportedMediaType(
            "Unsupported Media Type: only 'application/json' is allowed",
            code="unsupported_media_type",
        )


def decode_json(raw: bytes, max_bytes: int) -> dict[str, Any]:
    if len(raw) > max_bytes:
        raise PayloadTooLarge(f"request body is {len(raw)} bytes; the limit is {max_bytes}")
    try:
        body = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequest("request body is nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    check_depth(body, MAX_JSON_DEPTH)
    return body


def check_depth(value: Any, limit: int) -> None:
    """BadRequest when objects and arrays nest more than `limit` levels (walked without
    recursion, so that the check itself cannot overflow the stack). `value` is decoded JSON:
    its containers are exactly dict and list (a loop with `type(...) is` checks: a third of
    the time of a generator with isinstance for a 40-message chat, 9 against 29 us)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise BadRequest(f"request body is nested more than {limit} levels deep")
        for child in node.values() if type(node) is dict else node:
            if type(child) is dict or type(child) is list:
                stack.append((child, depth + 1))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_limits(body: Mapping[str, Any], api: Api, stream: bool, max_model_len: int) -> None:
    """What D would refuse, refused before P prefills (and pins KV blocks for D to read)."""
    limits = [_token_limit(body, key, max_model_len) for key in _TOKEN_LIMITS[api]]
    smallest = min((limit for limit in limits if limit is not None), default=None)
    if api == "responses":
        return
    min_tokens = body.get("min_tokens")
    if min_tokens is not None:
        if not _is_int(min_tokens) or min_tokens < 0:
            raise BadRequest("'min_tokens' must be an integer >= 0", param="min_tokens")
        if smallest is not None and min_tokens > smallest:
            raise BadRequest(
                f"'min_tokens' must not be above the token limit {smallest}", param="min_tokens"
            )
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", param="stream_options")
    if options is not None and not stream:
        raise BadRequest(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )


def _token_limit(body: Mapping[str, Any], key: str, max_model_len: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not _is_int(value):
        raise BadRequest(f"'{key}' must be an integer", param=key)
    if value < 1:
        raise BadRequest(f"'{key}' must be at least 1, got {value}", param=key)
    if max_model_len and value >= max_model_len:
        raise BadRequest(
            f"'{key}' is too large: {value}. This model's maximum context length is "
            f"{max_model_len} tokens, which leaves no room for the prompt",
            param=key,
        )
    return int(value)


def _check_messages(body: Mapping[str, Any]) -> None:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty list", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRequest(
                f"messages[{index}] must be an object with a string 'role'", param="messages"
            )


def _check_prompt(body: Mapping[str, Any]) -> None:
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return
    if isinstance(prompt, list) and prompt:
        with contextlib.suppress(msgspec.ValidationError):
            msgspec.convert(prompt, list[int])  # token ids (no bools), checked in C
            return
        if len(prompt) == 1 and isinstance(prompt[0], str | list):
            return
        raise BadRequest(
            "P/D routing serves one prompt per request: send a batch of prompts as separate "
            "requests",
            param="prompt",
        )
    raise BadRequest("'prompt' must be a string or a list of token ids", param="prompt")


def _check_common(body: Mapping[str, Any], model: str) -> bool:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", param="stream")
    n = body.get("n", 1)
    if n is not None and n != 1:
        # vLLM's P/D handoff carries one sequence's KV: n > 1 cannot be split over P and D.
        raise BadRequest("P/D routing serves n=1 only", param="n")
    requested = body.get("model")
    if requested is not None and not isinstance(requested, str):
        raise BadRequest("'model' must be a string", param="model")
    if requested and model and requested != model:
        raise NotFound(
            f"The model `{requested}` does not exist: the engines serve `{model}` "
            "(GET /v1/models lists it)",
            code="model_not_found",
            param="model",
        )
    return stream


@dataclass(frozen=True)
class Accepts:
    """What the router accepts of a request, from its settings and what its engines serve."""

    model: str  # the engines' model ("": not known, any name passes)
    max_bytes: int  # --max-body-bytes
    tenant_header: str = ""  # --tenant-header ("": the bearer token names the tenant)
    max_model_len: int = 0  # the engines' context length (0: not known)
    keep_responses: bool = False  # the router stores Responses API responses (--response-ttl)


def read_incoming(raw: bytes, headers: Mapping[str, str], api: Api, accepts: Accepts) -> Incoming:
    """Validate the client's request; raise a RouterError with the right status otherwise."""
    check_content_type(headers.get("content-type"))
    body, conversation_id = split_client_body(decode_json(raw, accepts.max_bytes))
    asked = responses_input.Asked()
    if api == "chat":
        _check_messages(body)
    elif api == "responses":
        responses_input.check_input(body)
        asked = responses_input.asked(body, keeping=accepts.keep_responses)
        body = responses_input.engine_body(body)
    else:
        _check_prompt(body)
    stream = _check_common(body, accepts.model)
    _check_limits(body, api, stream, accepts.max_model_len)
    conversation_id = _conversation_id(body, headers, conversation_id, asked.conversation)
    if conversation_id is not None:
        conversation_id = validate_conversation_id(conversation_id)
    tenant = tenant_of_headers(headers, accepts.tenant_header)
    return Incoming(
        api=api,
        body=body,
        stream=stream,
        conversation_id=conversation_id,
        tenant=tenant,
        wants_token_ids=client_wants_token_ids(body, api),
        forward_headers=_forwarded(headers),
        size=len(raw),
        store=asked.store,
        previous_response_id=asked.previous_response_id,
        named=conversation_id is not None,
    )


def _conversation_id(
    body: Mapping[str, Any], headers: Mapping[str, str], from_body: str | None, named: Any
) -> Any:
    """Our field, our header, the Responses API's `conversation` (`named`), OpenAI's
    `prompt_cache_key`, then vLLM's own session identity (vLLM #48048) in vLLM's order of
    reading it: the `session_id` field, the X-Session-ID header, `vllm_xargs.session_id`;
    all but ours and `conversation` forwarded as they came (docs/responses.md)."""
    xargs = body.get("vllm_xargs")
    for value in (
        from_body,
        headers.get("x-conversation-id"),
        named,
        responses_input.cache_key(body),
        body.get("session_id"),
        headers.get("x-session-id"),
        xargs.get("session_id") if isinstance(xargs, Mapping) else None,
    ):
        if value is not None:
            return value
    return None


def _forwarded(headers: Mapping[str, str]) -> dict[str, str]:
    """The client headers the engines get: vLLM's session identity, validated like a
    conversation id even when the body names the conversation (a control character in a
    header would make the engine client refuse the request: a 500)."""
    session = headers.get("x-session-id")
    if session is None:
        return {}
    return {"X-Session-ID": validate_conversation_id(session)}


_TEXT_PARTS = ("input_text", "output_text", "text")


def canonical_items(inc: Incoming) -> list[Any]:
    """The conversation items the prefix digest covers. A Responses output message sent back
    verbatim (`type: message`, an id, one `output_text` part) and the plain
    `{"role": "assistant", "content": text}` form render alike, so they digest alike."""
    if inc.api == "chat":
        return inc.messages
    return [_responses_item(item) for item in inc.items]


def _responses_item(item: Mapping[str, Any]) -> Any:
    if "role" not in item or item.get("type", "message") != "message":
        return {k: v for k, v in item.items() if k not in ("id", "status")}
    content = item.get("content")
    if (
        isinstance(content, list)
        and len(content) == 1
        and isinstance(content[0], dict)
        and content[0].get("type") in _TEXT_PARTS
    ):
        content = content[0].get("text")
    return {"role": item["role"], "content": content}
