"""vLLM 0.32's Responses API objects and SSE events, as plain dicts (pure).

Key order and nulls follow vLLM's pydantic dumps (`model_dump(mode="json", by_alias=True)`
for bodies, `model_dump_json(by_alias=True)` for events): every field present, events' keys
sorted as the OpenAI types declare them.
"""

from __future__ import annotations

import secrets
from typing import Any

from vllm_sim.shapes import _encode


def new_id(prefix: str) -> str:
    """vLLM's ids: a prefix and random_uuid() (16 hex digits)."""
    return f"{prefix}_{secrets.token_hex(8)}"


def sse_event(event: dict[str, Any]) -> bytes:
    """One named SSE event, as vLLM's _convert_stream_to_sse_events writes it."""
    kind: str = event["type"]
    return b"event: " + kind.encode() + b"\ndata: " + _encode(event) + b"\n\n"


def output_text(text: str, logprobs: list[Any] | None) -> dict[str, Any]:
    return {"annotations": [], "text": text, "type": "output_text", "logprobs": logprobs}


def message_item(item_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "content": content,
        "role": "assistant",
        "status": status,
        "type": "message",
        "phase": None,
    }


def reasoning_text(text: str) -> dict[str, Any]:
    return {"text": text, "type": "reasoning_text"}


def reasoning_item(item_id: str, text: str | None, status: str | None) -> dict[str, Any]:
    return {
        "id": item_id,
        "summary": [],
        "type": "reasoning",
        "content": None if text is None else [reasoning_text(text)],
        "encrypted_content": None,
        "status": status,
    }


def output_items(reasoning: str, content: str, parser: bool) -> list[dict[str, Any]]:
    """A non-streaming response's output.

    With a reasoning parser (`--reasoning-tokens`), vLLM returns a reasoning item and a
    message item only when each has text; without one, always one message item.
    """
    text_part = [output_text(content, None)] if content else []
    if not parser:
        return [message_item(new_id("msg"), text_part, "completed")]
    items: list[dict[str, Any]] = []
    if reasoning:
        items.append(reasoning_item(new_id("rs"), reasoning, None))
    if content:
        items.append(message_item(new_id("msg"), text_part, "completed"))
    return items


def usage(input_tokens: int, output_tokens: int, cached: int, reasoning: int) -> dict[str, Any]:
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": output_tokens,
        "output_tokens_details": {
            "reasoning_tokens": reasoning,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": input_tokens + output_tokens,
    }


def response_object(
    *,
    response_id: str,
    created_at: int,
    model: str,
    echo: dict[str, Any],
    max_output_tokens: int,
    output: list[dict[str, Any]],
    status: str,
    usage_: dict[str, Any] | None,
    kv_transfer_params: dict[str, Any] | None,
    messages: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None = None,
) -> dict[str, Any]:
    """vLLM's ResponsesResponse.from_request, dumped (`metrics` is omitted when unset).
    `messages`: input and output as `raw_message_tokens` (enable_response_messages)."""
    e = echo
    return {
        "id": response_id,
        "created_at": created_at,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": e["instructions"],
        "metadata": e["metadata"],
        "model": model,
        "object": "response",
        "output": output,
        "parallel_tool_calls": e["parallel_tool_calls"],
        "temperature": e["temperature"],
        "tool_choice": e["tool_choice"],
        "tools": e["tools"],
        "top_p": e["top_p"],
        "background": False,
        "max_output_tokens": max_output_tokens,
        "max_tool_calls": None,
        "previous_response_id": None,
        "prompt": None,
        "reasoning": e["reasoning"],
        "service_tier": e["service_tier"],
        "status": status,
        "text": e["text"],
        "top_logprobs": None,
        "truncation": e["truncation"],
        "usage": usage_,
        "user": e["user"],
        "presence_penalty": e["presence_penalty"],
        "frequency_penalty": e["frequency_penalty"],
        "kv_transfer_params": kv_transfer_params,
        "ec_transfer_params": None,
        "input_messages": messages[0] if messages else None,
        "output_messages": messages[1] if messages else None,
    }


def raw_messages(
    prompt_text: str, prompt: list[int], output_text: str, output: list[int]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """vLLM's SimpleContext with enable_response_messages: the prompt as rendered and the
    output, text and token ids (`ResponseRawMessageAndToken`); no output entry when nothing
    was generated."""
    kind = "raw_message_tokens"
    inputs = [{"message": prompt_text, "tokens": prompt, "type": kind}]
    outputs = [{"message": output_text, "tokens": output, "type": kind}] if output else []
    return inputs, outputs


def status_of(finish_reason: str | None) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def error_event(sequence_number: int) -> dict[str, Any]:
    """OpenAI's `error` stream event (fault injection; see docs/simulator.md)."""
    return {
        "code": "InternalServerError",
        "message": "Internal server error",
        "param": None,
        "sequence_number": sequence_number,
        "type": "error",
    }


class EventStream:
    """The events of one streamed response: vLLM's simple (non-Harmony) state machine.

    A reasoning delta opens a reasoning item, a non-empty content delta a message item;
    switching kinds closes the open item. `output` collects the closed items.
    """

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self._kind: str | None = None
        self._item_id = ""
        self._text = ""

    def _ev(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = dict(sorted({**fields, "sequence_number": self.seq, "type": kind}.items()))
        self.seq += 1
        return event

    def lifecycle(self, kind: str, response: dict[str, Any]) -> dict[str, Any]:
        """response.created / response.in_progress / response.completed."""
        return self._ev(kind, response=response)

    def delta(self, reasoning: str, content: str) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        for kind, text in (("reasoning", reasoning), ("message", content)):
            if not text:
                continue
            if self._kind != kind:
                events += self.close()
                events += self._open(kind)
            self._text += text
            name = "response.reasoning_text.delta" if kind == "reasoning" else None
            if name is not None:
                events.append(self._ev(name, **self._where(), delta=text))
            else:
                events.append(
                    self._ev("response.output_text.delta", **self._where(), delta=text, logprobs=[])
                )
        return events

    def _where(self) -> dict[str, Any]:
        return {"content_index": 0, "item_id": self._item_id, "output_index": len(self.output)}

    def _open(self, kind: str) -> list[dict[str, Any]]:
        self._kind, self._text = kind, ""
        if kind == "reasoning":
            self._item_id = new_id("rs")
            item = reasoning_item(self._item_id, None, "in_progress")
            part: dict[str, Any] = reasoning_text("")
        else:
            self._item_id = new_id("msg")
            item = message_item(self._item_id, [], "in_progress")
            part = output_text("", [])
        where = self._where()
        return [
            self._ev("response.output_item.added", item=item, output_index=where["output_index"]),
            self._ev("response.content_part.added", **where, part=part),
        ]

    def close(self) -> list[dict[str, Any]]:
        """Close the open item (if any): its done events, and it joins `output`."""
        if self._kind is None:
            return []
        where = self._where()
        if self._kind == "reasoning":
            part = reasoning_text(self._text)
            done = self._ev("response.reasoning_text.done", **where, text=self._text)
            item = reasoning_item(self._item_id, self._text, "completed")
        else:
            part = output_text(self._text, None)
            done = self._ev("response.output_text.done", **where, logprobs=[], text=self._text)
            item = message_item(self._item_id, [part], "completed")
        events = [
            done,
            self._ev("response.content_part.done", **where, part=part),
            self._ev("response.output_item.done", item=item, output_index=where["output_index"]),
        ]
        self.output.append(item)
        self._kind = None
        return events
