"""vLLM 0.32's OpenAI response bodies and SSE chunks, as plain dicts (pure).

Streamed chunks mirror vLLM's `model_dump_json(exclude_unset=True)`: fields vLLM passes
explicitly appear (even as null), others are absent; the usage chunk drops nulls.
"""

from __future__ import annotations

from typing import Any

import msgspec

from vllm_sim.errors import INTERNAL_ERROR

_encode = msgspec.json.Encoder().encode
DONE = b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    # As with --enable-prompt-tokens-details (the simulator always reports cached tokens).
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": {
            "cached_tokens": cached_tokens,
            "created_cache_tokens": 0,
            "multimodal_tokens": None,
        },
    }


def usage_no_nulls(u: dict[str, Any]) -> dict[str, Any]:
    details = {k: v for k, v in u["prompt_tokens_details"].items() if v is not None}
    return {**u, "prompt_tokens_details": details}


def chat_message(content: str, reasoning: str | None) -> dict[str, Any]:
    msg: dict[str, Any] = {
        "role": "assistant",
        "content": content,
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": reasoning,
    }
    if reasoning is not None:
        msg["reasoning_content"] = reasoning  # the pre-rename name, for older clients
    return msg


def chat_response(
    *,
    response_id: str,
    created: int,
    model: str,
    content: str,
    reasoning: str | None,
    finish_reason: str | None,
    stop_reason: str | None,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None,
    usage_: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": chat_message(content, reasoning),
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "token_ids": token_ids,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt_token_ids,
        "kv_transfer_params": kv_transfer_params,
    }


def completion_response(
    *,
    response_id: str,
    created: int,
    model: str,
    text: str,
    finish_reason: str | None,
    stop_reason: str | None,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None,
    usage_: dict[str, Any],
    kv_transfer_params: dict[str, Any] | None,
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "token_ids": token_ids,
                "prompt_logprobs": None,
                "prompt_token_ids": prompt_token_ids,
            }
        ],
        "service_tier": None,
        "system_fingerprint": None,
        "usage": usage_,
        "kv_transfer_params": kv_transfer_params,
    }


class ChunkMaker:
    """Builds the SSE chunks of one streamed response."""

    def __init__(self, response_id: str, created: int, model: str, chat: bool) -> None:
        self.head: dict[str, Any] = {
            "id": response_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
        }
        self.chat = chat

    def role(self, prompt_token_ids: list[int] | None) -> dict[str, Any]:
        """Chat's first chunk: the role, and prompt_token_ids (null unless requested)."""
        choice = {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        return {**self.head, "choices": [choice], "prompt_token_ids": prompt_token_ids}

    def token(
        self,
        *,
        content: str,
        reasoning: str,
        token_ids: list[int] | None,
        finish_reason: str | None,
        stop_reason: str | None,
        prompt_token_ids: list[int] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any]
        if self.chat:
            delta: dict[str, Any] = {}
            if reasoning:
                delta = {"reasoning": reasoning, "reasoning_content": reasoning}
            else:
                delta = {"content": content}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            if finish_reason is not None:
                choice["stop_reason"] = stop_reason
            choice["token_ids"] = token_ids
        else:
            choice = {
                "index": 0,
                "text": content,
                "logprobs": None,
                "finish_reason": finish_reason,
                "stop_reason": stop_reason,
                "prompt_token_ids": prompt_token_ids,
                "token_ids": token_ids,
            }
        return {**self.head, "choices": [choice]}

    def usage(self, usage_: dict[str, Any]) -> dict[str, Any]:
        return {**self.head, "choices": [], "usage": usage_no_nulls(usage_)}


def stream_error() -> bytes:
    """vLLM's in-stream GenerationError event (the HTTP status is already 200)."""
    return sse(INTERNAL_ERROR)


def models_list(model: str, max_model_len: int, created: int) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {
                "id": model,
                "object": "model",
                "created": created,
                "owned_by": "vllm",
                "root": model,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": "modelperm-sim",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }
