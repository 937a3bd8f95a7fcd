"""An in-process fake of the engine seam (`EngineClient`): P and D as vLLM answers them, with
a character-level chat render, so whole turns run in milliseconds without processes.

Each engine is scripted by URL: `fail` makes its calls raise or answer an error, and every
request is recorded for the test to read."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from router.errors import UpstreamFailure

BLOCK = 4


def render(messages: list[dict[str, Any]]) -> str:
    """The fake chat template: `role:content\\n` per message, then the generation prompt."""
    return "".join(f"{m['role']}:{m.get('content') or ''}\n" for m in messages) + "assistant:"


def token_ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def answer_for(prompt_ids: list[int]) -> str:
    """D's answer: a function of the prompt, so a wrong prompt gives a wrong answer."""
    return f"[{len(prompt_ids)}]"


@dataclass
class Call:
    url: str
    body: dict[str, Any]
    request_id: str


# What a scripted engine does with a call: None (answer as vLLM would), an HTTP status to
# answer with an error body, or an exception to raise.
Script = Callable[[Call], int | UpstreamFailure | None]


@dataclass
class FakeStream:
    status: int
    body: bytes
    content_type: str = "application/json"
    released: bool = False
    closed: bool = False

    async def read(self) -> bytes:
        self.released = True
        return self.body

    async def chunks(self, idle_timeout: float) -> AsyncIterator[bytes]:
        for i in range(0, len(self.body), 7):  # small chunks, split anywhere
            yield self.body[i : i + 7]

    def release(self) -> None:
        self.released = True

    def close(self) -> None:
        self.closed = True


@dataclass
class FakeEngines:
    """P and D engines by base URL (`http://p1`, `http://d1`, ...)."""

    scripts: dict[str, Script] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)
    engine_ids: dict[str, str] = field(default_factory=dict)
    # Engines that do not serve /v1/responses/render: the status they answer it with (403:
    # vLLM without --enable-scale-out; 404: no such route).
    no_render: dict[str, int] = field(default_factory=dict)
    render_ids: list[Any] | None = None  # what /v1/responses/render answers instead of the ids

    def calls_to(self, base: str, path: str = "") -> list[Call]:
        return [c for c in self.calls if c.url.startswith(base + path)]

    def _script(self, call: Call) -> int | None:
        base = call.url.split("/v1/")[0].split("/tokenize")[0]
        script = self.scripts.get(base)
        outcome = script(call) if script is not None else None
        if isinstance(outcome, UpstreamFailure):
            raise outcome
        return outcome

    async def post_json(
        self,
        url: str,
        body: Mapping[str, Any],
        *,
        request_id: str,
        timeout: float,
        extra_headers: Mapping[str, str] | None = None,
    ) -> tuple[int, bytes]:
        call = Call(url, msgspec.json.decode(msgspec.json.encode(body)), request_id)
        self.calls.append(call)
        status = self._script(call)
        if status is not None:
            return status, b'{"error": {"message": "scripted", "type": "x", "code": 1}}'
        if url.endswith("/tokenize"):
            return 200, msgspec.json.encode({"tokens": _prompt_ids(call.body)})
        if url.endswith("/v1/responses/render"):
            refused = self.no_render.get(url.split("/v1/")[0])
            if refused is not None:
                return refused, NOT_SERVED[refused]
            return 200, msgspec.json.encode(
                {"request_id": "resp_1", "token_ids": self.render_ids or _prompt_ids(body)}
            )
        return 200, msgspec.json.encode(self._prefill(url, call.body))

    async def get(self, url: str, *, timeout: float) -> tuple[int, bytes]:
        return 200, b"process_start_time_seconds 100.0\n"

    async def open_stream(
        self,
        url: str,
        body: Mapping[str, Any],
        *,
        request_id: str,
        extra_headers: Mapping[str, str] | None = None,
    ) -> FakeStream:
        call = Call(url, msgspec.json.decode(msgspec.json.encode(body)), request_id)
        self.calls.append(call)
        status = self._script(call)
        if status is not None:
            return FakeStream(status, b'{"error": {"message": "scripted"}}')
        return FakeStream(200, msgspec.json.encode(self._decode(url, call.body)))

    def _params(self, url: str, num_tokens: int, **extra: Any) -> dict[str, Any]:
        base = url.split("/v1/")[0]
        blocks = -(-num_tokens // BLOCK)
        return {
            "do_remote_prefill": False,
            "do_remote_decode": True,
            "remote_block_ids": [list(range(1, blocks + 1))],
            "remote_engine_id": self.engine_ids.get(base, "engine-" + base[-2:]),
            "remote_request_id": "req-" + base[-2:],
            "remote_host": "127.0.0.1",
            "remote_port": 5600,
            "remote_num_tokens": num_tokens,
            **extra,
        }

    def _prefill(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        prompt = _prompt_ids(body)
        params = self._params(url, len(prompt), do_remote_prefill=True, do_remote_decode=False)
        sent = body.get("kv_transfer_params") or {}
        if "transfer_id" in sent:  # MoRI-IO's P answers with the transfer id it was given
            params["transfer_id"] = sent["transfer_id"]
        return {"choices": [{"index": 0, "finish_reason": "length"}], "kv_transfer_params": params}

    def _decode(self, url: str, body: dict[str, Any]) -> dict[str, Any]:
        prompt = _prompt_ids(body)
        text = answer_for(prompt)
        out = token_ids(text)
        if url.endswith("/v1/responses"):
            return self._response(url, body, prompt, text, out)
        out_body: dict[str, Any] = {
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                    "token_ids": out if body.get("return_token_ids") else None,
                }
            ],
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out)},
            # vLLM's request_finished: no params in, none out (a request D ran alone).
            "kv_transfer_params": self._params(url, len(prompt) + len(out) - 1)
            if body.get("kv_transfer_params")
            else None,
        }
        if body.get("return_token_ids"):
            out_body["prompt_token_ids"] = prompt
        return out_body

    def _response(
        self, url: str, body: dict[str, Any], prompt: list[int], text: str, out: list[int]
    ) -> dict[str, Any]:
        """A Responses D body: the answer as an output message; the token ids as vLLM gives
        them with enable_response_messages."""
        raw = body.get("enable_response_messages") is True
        kind = "raw_message_tokens"
        return {
            "object": "response",
            "status": "completed",
            "output": [
                {
                    "type": "message",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": text}],
                }
            ],
            "usage": {"input_tokens": len(prompt), "output_tokens": len(out)},
            "kv_transfer_params": self._params(url, len(prompt) + len(out) - 1)
            if body.get("kv_transfer_params")
            else None,
            "input_messages": [{"message": "", "tokens": prompt, "type": kind}] if raw else None,
            "output_messages": [{"message": text, "tokens": out, "type": kind}] if raw else None,
        }


# What an engine that does not serve the render route answers: vLLM 0.32/0.33 without
# --enable-scale-out, and a server without the route (FastAPI's own 404 body).
NOT_SERVED = {
    403: b'{"error": {"message": "Scale-out endpoints are disabled.", "type": '
    b'"PermissionDeniedError", "param": null, "code": 403}}',
    404: b'{"detail": "Not Found"}',
}


def responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """A Responses request's instructions and input as chat messages (text parts joined)."""
    messages = (
        [{"role": "system", "content": body["instructions"]}] if "instructions" in body else []
    )
    raw = body["input"]
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    for item in items:
        content = item.get("content")
        if isinstance(content, list):
            content = "".join(part.get("text", "") for part in content)
        messages.append({"role": item["role"], "content": content})
    return messages


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    if "input" in body:  # a Responses request: one more BOS than chat, as vLLM's
        return [1, *token_ids(render(responses_messages(body)))]
    if "messages" in body:
        return token_ids(render(body["messages"]))
    prompt = body["prompt"]
    return list(prompt) if isinstance(prompt, list) else token_ids(prompt)
