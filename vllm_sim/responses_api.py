"""Responses API request bodies -> a validated generation request (pure; errors are ApiError).

`input` becomes chat messages as vLLM 0.32's construct_input_messages does, and is rendered
with the chat template plus one more BOS: vLLM tokenizes the rendered Responses prompt with
add_special_tokens=True (ResponsesRequest.build_tok_params keeps TokenizeParams' default).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_sim.api import check_model, stop_strings, typed
from vllm_sim.errors import ApiError
from vllm_sim.template import TemplateError, render
from vllm_sim.tokenizer import BOS_ID, Tokenizer

_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass(frozen=True)
class ResponsesParsed:
    prompt: list[int]
    max_tokens: int
    stop: tuple[str, ...]
    include_stop_str_in_output: bool
    stream: bool
    kv_transfer_params: dict[str, Any] | None
    request_id: str | None  # vLLM's `request_id` body field (the response id)
    # vLLM's `enable_response_messages`: the response carries the prompt's and the output's
    # token ids (`input_messages`, `output_messages`)
    response_messages: bool
    echo: dict[str, Any]  # request fields the response object repeats


def _part_texts(content: list[Any]) -> list[str]:
    texts: list[str] = []
    for part in content:
        if not isinstance(part, Mapping) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ApiError(f"Unsupported content part type: {kind}", param="input")
        text = part.get("text")
        if not isinstance(text, str):
            raise ApiError("a text content part needs a string 'text'", param="input")
        texts.append(text)
    return texts


def _message(item: Mapping[str, Any]) -> dict[str, Any]:
    role = item.get("role")
    if not isinstance(role, str) or not role:
        raise ApiError("every message item needs a string 'role'", param="input")
    content = item.get("content")
    if isinstance(content, list):
        texts = _part_texts(content)
        # vLLM keeps only the first part of an assistant item; other roles' parts are
        # joined by the chat template's string content format.
        text = (texts[0] if texts else "") if role == "assistant" else "\n".join(texts)
    elif isinstance(content, str):
        text = content
    else:
        raise ApiError("message content must be a string or a list of parts", param="input")
    return {"role": role, "content": text}


def _reasoning_text(item: Mapping[str, Any]) -> str:
    for key in ("content", "summary"):
        parts = item.get(key)
        if isinstance(parts, list) and parts and isinstance(parts[0], Mapping):
            text = parts[0].get("text")
            return text if isinstance(text, str) else ""
    return ""


def input_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """`instructions` (a system message) and `input` as chat messages."""
    messages: list[dict[str, Any]] = []
    instructions = typed(body, "instructions", str, None)
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*messages, {"role": "user", "content": items}]
    if not isinstance(items, list):
        raise ApiError("'input' must be a string or a list of items", param="input")
    for item in items:
        if not isinstance(item, Mapping):
            raise ApiError("every input item must be an object", param="input")
        prev = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        kind = item.get("type", "message")
        if kind == "reasoning":
            # Merged into the assistant message it belongs to; the template drops it.
            if prev is not None and prev.get("reasoning") is None:
                prev["reasoning"] = _reasoning_text(item)
            else:
                messages.append({"role": "assistant", "reasoning": _reasoning_text(item)})
        elif kind == "message":
            msg = _message(item)
            if msg["role"] == "assistant" and prev is not None and prev.get("content") is None:
                prev["content"] = msg["content"]
            else:
                messages.append(msg)
        else:
            raise ApiError(f"Unsupported input item type: {kind}", param="input")
    return messages


def render_input(tok: Tokenizer, messages: list[dict[str, Any]]) -> list[int]:
    """The chat template's ids with one more BOS in front (see the module docstring)."""
    try:
        return [BOS_ID, *render(tok, messages, add_generation_prompt=True)]
    except TemplateError as exc:
        raise ApiError(str(exc), param="input") from exc


def _number(body: Mapping[str, Any], key: str, default: float) -> float:
    value = typed(body, key, (int, float), None)
    return default if value is None else float(value)


def _echo(body: Mapping[str, Any]) -> dict[str, Any]:
    tools = typed(body, "tools", list, [])
    tool_choice = body.get("tool_choice", "auto")
    if not tools and tool_choice in ("auto", "none"):
        tool_choice = "none"  # vLLM's check_tool_usage
    return {
        "instructions": typed(body, "instructions", str, None),
        "metadata": typed(body, "metadata", dict, None),
        "parallel_tool_calls": typed(body, "parallel_tool_calls", bool, True),
        "temperature": _number(body, "temperature", 1.0),
        "tool_choice": tool_choice,
        "tools": tools,
        "top_p": _number(body, "top_p", 1.0),
        "reasoning": typed(body, "reasoning", dict, None),
        "service_tier": typed(body, "service_tier", str, "auto"),
        "text": typed(body, "text", dict, None),
        "truncation": typed(body, "truncation", str, "disabled"),
        "user": typed(body, "user", str, None),
        "presence_penalty": _number(body, "presence_penalty", 0.0),
        "frequency_penalty": _number(body, "frequency_penalty", 0.0),
    }


def _check_unsupported(body: Mapping[str, Any]) -> None:
    if body.get("previous_response_id") is not None:
        raise ApiError(
            "previous_response_id is not supported by the simulator: it stores no responses; "
            "send the whole conversation in 'input'",
            param="previous_response_id",
        )
    typed(body, "store", bool, True)  # accepted and ignored, as vLLM without a store
    if typed(body, "background", bool, False):
        raise ApiError("background mode is not supported by the simulator", param="background")


def parse(
    tok: Tokenizer,
    body: Mapping[str, Any],
    *,
    served_model: str,
    max_model_len: int,
    default_max_tokens: int,
) -> ResponsesParsed:
    check_model(body, served_model)
    if "input" not in body:
        raise ApiError("Field required: 'input'", param="input")
    _check_unsupported(body)
    echo = _echo(body)
    prompt = render_input(tok, input_messages(body))
    if len(prompt) >= max_model_len:
        raise ApiError(
            f"The engine prompt length {len(prompt)} exceeds the max_model_len "
            f"{max_model_len}. Please reduce prompt.",
            err_type="invalid_request_error",
            param="input",
        )
    room = max_model_len - len(prompt)
    requested = typed(body, "max_output_tokens", int, None)
    if requested is not None and requested < 1:
        raise ApiError(
            f"max_output_tokens must be at least 1, got {requested}.", param="max_output_tokens"
        )
    # vLLM clamps an oversized max_output_tokens to the room left (get_max_tokens).
    max_tokens = min(room, requested if requested is not None else default_max_tokens)
    request_id = typed(body, "request_id", str, None)
    return ResponsesParsed(
        prompt=prompt,
        max_tokens=max_tokens,
        stop=stop_strings(body),
        include_stop_str_in_output=typed(body, "include_stop_str_in_output", bool, False),
        stream=typed(body, "stream", bool, False),
        kv_transfer_params=typed(body, "kv_transfer_params", dict, None),
        request_id=request_id or None,
        response_messages=typed(body, "enable_response_messages", bool, False),
        echo=echo,
    )
