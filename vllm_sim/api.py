"""OpenAI request bodies -> validated generation requests (pure; errors are ApiError 4xx).

Only what the simulator acts on is checked; other fields are accepted and ignored, as
vLLM's OpenAIBaseModel (extra="allow") does.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from vllm_sim.errors import ApiError
from vllm_sim.template import TemplateError, render
from vllm_sim.tokenizer import BOS_ID, Tokenizer

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # vLLM's CompletionRequest.max_tokens default


@dataclass(frozen=True)
class Parsed:
    chat: bool
    prompt: list[int]
    max_tokens: int
    min_tokens: int
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    stream: bool
    include_usage: bool
    return_token_ids: bool
    kv_transfer_params: dict[str, Any] | None


def decode_body(raw: bytes) -> dict[str, Any]:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise ApiError(f"Invalid JSON body: {exc}") from exc
    if not isinstance(body, dict):
        raise ApiError("The request body must be a JSON object")
    return body


def typed(body: Mapping[str, Any], key: str, kinds: type | tuple[type, ...], default: Any) -> Any:
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (kinds if isinstance(kinds, tuple) else (kinds,)):
        raise ApiError(f"'{key}' has the wrong type", param=key)
    if not isinstance(value, kinds):
        raise ApiError(f"'{key}' has the wrong type", param=key)
    return value


def check_model(body: Mapping[str, Any], served: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise ApiError("'model' must be a string", param="model")
    if model != served:
        raise ApiError(f"The model `{model}` does not exist.", status=404, param="model")


def stop_strings(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        return (stop,)
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return tuple(stop)
    raise ApiError("'stop' must be a string or a list of strings", param="stop")


def chat_prompt(tok: Tokenizer, body: Mapping[str, Any]) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ApiError("'messages' must be a list of message objects", param="messages")
    add_gen = typed(body, "add_generation_prompt", bool, True)
    try:
        ids = render(tok, messages, add_generation_prompt=add_gen)
    except TemplateError as exc:
        raise ApiError(str(exc), param="messages") from exc
    if typed(body, "add_special_tokens", bool, False):
        ids = [BOS_ID, *ids]
    return ids


def completion_prompt(tok: Tokenizer, body: Mapping[str, Any]) -> list[int]:
    """One prompt: a string, a token-id list, or a one-element list of either."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError("The simulator serves one prompt per request", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        ids = tok.encode(prompt)
        return [BOS_ID, *ids] if typed(body, "add_special_tokens", bool, True) else ids
    if isinstance(prompt, list) and prompt:
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
            raise ApiError("token prompts must be non-negative integers", param="prompt")
        if max(prompt) >= tok.vocab_size:
            raise ApiError(f"Token id {max(prompt)} is out of vocabulary", param="prompt")
        return list(prompt)
    raise ApiError("Either prompt or prompt_embeds must be provided and non-empty.", param="prompt")


def _max_tokens(
    body: Mapping[str, Any], chat: bool, prompt_len: int, max_model_len: int, default_cap: int
) -> int:
    key = (
        "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else None
    )
    key = key or "max_tokens"
    requested = typed(body, key, int, None)
    room = max_model_len - prompt_len
    if requested is None:
        cap = default_cap if chat else COMPLETIONS_DEFAULT_MAX_TOKENS
        return max(1, min(room, cap))
    if requested < 1:
        raise ApiError(f"'{key}' must be at least 1, got {requested}.", param=key)
    if requested > room:
        raise ApiError(
            f"'{key}' is too large: {requested}. This model's maximum context length is "
            f"{max_model_len} tokens and your request has {prompt_len} input tokens "
            f"({requested} > {max_model_len} - {prompt_len}).",
            param=key,
        )
    return int(requested)


def parse(
    tok: Tokenizer,
    body: Mapping[str, Any],
    *,
    chat: bool,
    served_model: str,
    max_model_len: int,
    default_max_tokens: int,
) -> Parsed:
    check_model(body, served_model)
    stream = typed(body, "stream", bool, False)
    stream_options = typed(body, "stream_options", dict, None)
    if stream_options is not None and not stream:
        raise ApiError(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    n = typed(body, "n", int, 1)
    if n != 1:
        raise ApiError("The simulator supports n=1 only", param="n")
    prompt = chat_prompt(tok, body) if chat else completion_prompt(tok, body)
    if len(prompt) >= max_model_len:
        raise ApiError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"request has {len(prompt)} input tokens. Please reduce the length of the input.",
            param="messages" if chat else "prompt",
        )
    max_tokens = _max_tokens(body, chat, len(prompt), max_model_len, default_max_tokens)
    min_tokens = typed(body, "min_tokens", int, 0)
    if min_tokens < 0 or min_tokens > max_tokens:
        raise ApiError(
            f"min_tokens must be in [0, max_tokens={max_tokens}], got {min_tokens}.",
            param="min_tokens",
        )
    typed(body, "ignore_eos", bool, False)  # the toy model never emits EOS anyway
    params = typed(body, "kv_transfer_params", dict, None)
    include_usage = bool(stream_options and stream_options.get("include_usage"))
    return Parsed(
        chat=chat,
        prompt=prompt,
        max_tokens=max_tokens,
        min_tokens=min_tokens,
        stop=stop_strings(body),
        include_stop_str_in_output=typed(body, "include_stop_str_in_output", bool, False),
        stream=stream,
        include_usage=include_usage,
        return_token_ids=typed(body, "return_token_ids", bool, False),
        kv_transfer_params=params,
    )


def tokenize(tok: Tokenizer, body: Mapping[str, Any], served_model: str) -> list[int]:
    """vLLM's /tokenize: `messages` (chat template) or `prompt` (BOS added by default)."""
    check_model(body, served_model)
    if "messages" in body:
        return chat_prompt(tok, body)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise ApiError("'prompt' (a string) or 'messages' is required", param="prompt")
    ids = tok.encode(prompt)
    return [BOS_ID, *ids] if typed(body, "add_special_tokens", bool, True) else ids
