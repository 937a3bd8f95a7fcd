"""What the router learns from D's response (chunks of a stream or one body): its handle,
the finish, errors, token ids, the output text. Typed views decode only the fields read."""

from __future__ import annotations

import contextlib
from typing import Any

import msgspec


class Captured(msgspec.Struct):
    """What the router learns from D's response."""

    kv_transfer_params: dict[str, Any] | None = None
    finish_reason: str | None = None
    error: dict[str, Any] | None = None
    done: bool = False
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] = []
    output_text: str = ""
    reasoning: bool = False
    tool_calls: bool = False
    usage: dict[str, Any] | None = None
    # A Responses API response object as D ended it (the stream's last event, or the body),
    # for the router's response store (router/turn/responses_keep.py).
    response: bytes | None = None


# Typed views of the fields we read; everything else in a chunk is skipped by the decoder.
class _Delta(msgspec.Struct):
    content: Any = None
    reasoning_content: Any = None
    reasoning: Any = None
    tool_calls: Any = None


class _Choice(msgspec.Struct):
    index: Any = 0
    delta: _Delta | None = None  # chat chunk
    message: _Delta | None = None  # chat body
    text: Any = None  # completions
    finish_reason: Any = None
    token_ids: Any = None
    prompt_token_ids: Any = None  # completions carry it per choice


class Response(msgspec.Struct):  # the Responses API's response object
    status: Any = None
    incomplete_details: Any = None
    error: Any = None
    usage: Any = None
    kv_transfer_params: Any = None
    # enable_response_messages: the prompt and the output as `raw_message_tokens`
    input_messages: Any = None
    output_messages: Any = None


class Chunk(msgspec.Struct):
    choices: list[_Choice] | None = None
    prompt_token_ids: Any = None  # chat carries it at the top level
    kv_transfer_params: Any = None  # vllm#40186 (unmerged): D's handle in the final chunk
    usage: Any = None
    error: Any = None
    object: Any = None  # "error" in vLLM's older flat error body
    message: Any = None
    code: Any = None
    type: Any = None  # Responses API event type
    delta: Any = None
    # A Responses event's response object, decoded (typed) only for the events that carry one.
    response: msgspec.Raw = msgspec.Raw()


decode_chunk = msgspec.json.Decoder(Chunk).decode
_decode_response = msgspec.json.Decoder(Response).decode
# The events that end a Responses stream (a chat or completions stream ends with `[DONE]`).
TERMINAL_EVENTS = frozenset(("response.completed", "response.incomplete", "response.failed"))
TERMINAL_NAMES = tuple(name.encode() for name in TERMINAL_EVENTS)  # looked for in bytes first


def _int_list(value: object) -> list[int] | None:
    """value as a list of ints (no bools), or None; checked in C (a 6k-token prompt costs
    ~20 us here, ~130 us as a Python loop)."""
    if type(value) is not list:
        return None
    if len(value) == 1 and type(value[0]) is int:  # a streamed token's ids: one, mostly
        return value
    try:
        return msgspec.convert(value, list[int])
    except msgspec.ValidationError:
        return None


class Capture:
    """Accumulates a Captured; text parts are joined once, not per chunk."""

    def __init__(self) -> None:
        self.cap = Captured()
        self.text: list[str] = []
        self.terminal = False  # a Responses stream's last event was seen

    def result(self) -> Captured:
        if len(self.text) > 1:
            self.text = ["".join(self.text)]
        self.cap.output_text = self.text[0] if self.text else ""
        return self.cap

    def chunks(self, chunks: list[Chunk]) -> None:
        """Several chunks in order. A streamed token's chunk (one choice, a text delta and
        one token's ids, nothing else to read: most of a stream) takes a shorter path, which
        reads the same as `chunk` would."""
        text, ids = self.text, self.cap.output_token_ids
        for c in chunks:
            choices = c.choices
            if (
                choices is not None
                and len(choices) == 1
                and c.kv_transfer_params is None
                and c.prompt_token_ids is None
                and c.usage is None
                and c.error is None
                and c.type is None
                and c.object != "error"
            ):
                ch = choices[0]
                d = ch.delta
                got = ch.token_ids
                if (
                    d is not None
                    and ch.index == 0
                    and ch.finish_reason is None
                    and ch.prompt_token_ids is None
                    and ch.text is None
                    and d.reasoning_content is None
                    and d.reasoning is None
                    and d.tool_calls is None
                    and (
                        got is None or (type(got) is list and len(got) == 1 and type(got[0]) is int)
                    )
                ):
                    content = d.content
                    if type(content) is str and content:
                        text.append(content)
                    if got is not None:
                        ids.append(got[0])
                    continue
            self.chunk(c)
            text, ids = self.text, self.cap.output_token_ids  # a Responses body sets its ids

    def chunk(self, c: Chunk) -> None:
        cap = self.cap
        if isinstance(c.kv_transfer_params, dict):
            cap.kv_transfer_params = c.kv_transfer_params
        if isinstance(c.usage, dict):
            cap.usage = c.usage
        if isinstance(c.error, dict):
            cap.error = c.error
        elif c.object == "error" or c.type == "error":  # flat vLLM error; Responses error event
            cap.error = {"message": c.message, "type": c.type, "code": c.code}
        if cap.prompt_token_ids is None and c.prompt_token_ids is not None:
            cap.prompt_token_ids = _int_list(c.prompt_token_ids)
        if c.choices:
            for choice in c.choices:
                if choice.index == 0:
                    self._choice(choice)
        if c.type is not None:
            self._responses_event(c)

    def _choice(self, ch: _Choice) -> None:
        cap = self.cap
        if isinstance(ch.finish_reason, str):
            cap.finish_reason = ch.finish_reason
        if ch.token_ids is not None and (ids := _int_list(ch.token_ids)) is not None:
            cap.output_token_ids.extend(ids)
        if cap.prompt_token_ids is None and ch.prompt_token_ids is not None:
            cap.prompt_token_ids = _int_list(ch.prompt_token_ids)
        if isinstance(ch.text, str) and ch.text:
            self.text.append(ch.text)
        d = ch.delta if ch.delta is not None else ch.message
        if d is not None:
            if isinstance(d.content, str) and d.content:
                self.text.append(d.content)
            if d.reasoning_content or d.reasoning:
                cap.reasoning = True
            if d.tool_calls:
                cap.tool_calls = True

    def _responses_event(self, c: Chunk) -> None:
        # Responses API stream: text deltas, and the final response.completed whose
        # response.kv_transfer_params is D's handle on stock vLLM 0.32 (vllm#37424).
        cap, kind = self.cap, c.type
        if not isinstance(kind, str):
            return
        if kind == "response.output_text.delta":
            if isinstance(c.delta, str):
                self.text.append(c.delta)
        elif kind.startswith("response.reasoning"):
            cap.reasoning = True
        elif kind.startswith("response.function_call"):
            cap.tool_calls = True
        elif kind in TERMINAL_EVENTS:
            self.terminal = True
            if c.response:
                cap.response = bytes(c.response)
        if c.response:
            with contextlib.suppress(msgspec.ValidationError):  # not an object: nothing to read
                self.response(_decode_response(c.response))

    def response(self, r: Response) -> None:
        cap = self.cap
        if isinstance(r.kv_transfer_params, dict):
            cap.kv_transfer_params = r.kv_transfer_params
        if isinstance(r.usage, dict):
            cap.usage = r.usage
        # One finish rule for every API: completed -> "stop", incomplete -> "length".
        if r.status == "completed":
            cap.finish_reason = "stop"
        elif r.status == "incomplete":
            details = r.incomplete_details
            reason = details.get("reason") if isinstance(details, dict) else None
            cap.finish_reason = "length" if reason in (None, "max_output_tokens") else reason
        elif r.status == "failed":
            cap.error = r.error if isinstance(r.error, dict) else {"message": None}
        if r.input_messages is not None:
            self._response_ids(r.input_messages, r.output_messages)

    def _response_ids(self, inputs: object, outputs: object) -> None:
        """D's token ids from a Responses object with enable_response_messages, in the shape
        of vLLM's one-request context: one prompt entry, at most one output entry. Any other
        shape (Harmony messages, a tool loop's several requests) gives none."""
        prompt = _raw_tokens(inputs)
        output = _raw_tokens(outputs)
        if prompt is None or output is None or len(prompt) != 1 or len(output) > 1:
            return
        self.cap.prompt_token_ids = prompt[0]
        self.cap.output_token_ids = output[0] if output else []


def _raw_tokens(messages: object) -> list[list[int]] | None:
    """The token ids of each `raw_message_tokens` entry; None unless every entry is one."""
    if not isinstance(messages, list):
        return None
    out = []
    for m in messages:
        if not isinstance(m, dict) or m.get("type") != "raw_message_tokens":
            return None
        ids = _int_list(m.get("tokens"))
        if ids is None:
            return None
        out.append(ids)
    return out


def responses_output(capture: Capture, items: object) -> None:
    """A non-streaming Responses body: text from message items, flags from the others."""
    if not isinstance(items, list):
        return
    for item in items:
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if kind == "reasoning":
            capture.cap.reasoning = True
        elif kind == "function_call":
            capture.cap.tool_calls = True
        elif kind == "message" and isinstance(item.get("content"), list):
            for part in item["content"]:
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    capture.text.append(part["text"])
