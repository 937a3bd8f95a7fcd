"""OpenAI-style chat turns: through the OpenAI SDK (as a client would), or as plain JSON
bodies and urllib requests (for malformed input, raw headers and status codes)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import openai

MODEL = "sim-model"  # the simulators' model name
CHAT = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}
Message = dict[str, str]

# The kv_transfer_params a P leg starts from (vLLM NixlConnector, pull mode): "decode
# elsewhere", no handle yet. Written out here, not imported from the router, so that tests
# and tools hold the router to the wire format.
NULL_HANDOFF: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def client(url: str, **kw: Any) -> openai.OpenAI:
    """An OpenAI SDK client for a base URL (`.../v1`), without retries."""
    kw.setdefault("api_key", "test-key")
    return openai.OpenAI(base_url=url, max_retries=0, **kw)


class Turn(NamedTuple):
    text: str  # the answer
    reuse: str  # X-KV-Reuse
    body: dict[str, Any]  # the JSON reply ({} when streamed)


def chat_turn(
    api: openai.OpenAI,
    messages: list[Message],
    *,
    cid: str | None,
    stream: bool = False,
    max_tokens: int = 24,
    model: str = MODEL,
    extra: Mapping[str, Any] | None = None,
    **create: Any,
) -> Turn:
    """One chat turn through the SDK: conversation_id (when cid) and `extra` go in the body,
    `create` are more create() arguments (e.g. temperature)."""
    body = dict(extra or {})
    if cid:
        body["conversation_id"] = cid
    kwargs: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": max_tokens}
    kwargs.update(create, extra_body=body or None)
    if stream:
        with api.chat.completions.with_streaming_response.create(stream=True, **kwargs) as resp:
            reuse = resp.headers["x-kv-reuse"]
            text = "".join(c.choices[0].delta.content or "" for c in resp.parse() if c.choices)
        return Turn(text, reuse, {})
    raw = api.chat.completions.with_raw_response.create(**kwargs)
    answer = raw.parse().choices[0].message.content or ""
    return Turn(answer, raw.headers["x-kv-reuse"], json.loads(raw.text))


def responses_turn(
    api: openai.OpenAI, kwargs: dict[str, Any], *, stream: bool
) -> tuple[str, str, dict[str, Any]]:
    """One /v1/responses call with these arguments: (answer, X-KV-Reuse, the completed
    response as a dict; {} when a stream ended without one)."""
    if not stream:
        raw = api.responses.with_raw_response.create(**kwargs)
        resp = raw.parse()
        return resp.output_text, raw.headers["x-kv-reuse"], resp.model_dump()
    with api.responses.with_streaming_response.create(stream=True, **kwargs) as r:
        reuse = r.headers["x-kv-reuse"]
        text, completed = "", {}
        for event in r.parse():
            if event.type == "response.output_text.delta":
                text += event.delta
            elif event.type == "response.completed":
                completed = event.response.model_dump()
    return text, reuse, completed


def reference_answer(
    url: str,
    messages: list[Message],
    max_tokens: int,
    *,
    model: str = MODEL,
    timeout: float | None = None,
    **create: Any,
) -> str:
    """The from-scratch answer of a plain instance at url (no router, no connector)."""
    with client(url + "/v1", **({} if timeout is None else {"timeout": timeout})) as ref:
        out = ref.chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=max_tokens,
            **create,
        )
    return out.choices[0].message.content or ""


def chat_body(
    messages: list[Message],
    *,
    cid: str | None = None,
    stream: bool = False,
    max_tokens: int = 8,
    model: str = MODEL,
    **extra: Any,
) -> dict[str, Any]:
    """A chat request's JSON body."""
    body: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }
    if cid is not None:
        body["conversation_id"] = cid
    return body


@dataclass
class Reply:
    status: int
    headers: Mapping[str, str]  # names in lower case
    body: bytes

    @property
    def reuse(self) -> str:
        return self.headers.get("x-kv-reuse", "")

    def json(self) -> Any:
        return json.loads(self.body)

    def events(self) -> list[bytes]:
        """The `data:` payloads of an SSE body, in order (`[DONE]` included)."""
        out = []
        for block in self.body.replace(b"\r\n", b"\n").split(b"\n\n"):
            for line in block.split(b"\n"):
                if line.startswith(b"data:"):
                    out.append(line[5:].strip())
        return out

    def answer(self) -> str:
        """The generated text of a chat or completions reply, streamed or not."""
        if self.headers.get("content-type", "").startswith("text/event-stream"):
            text = []
            for data in self.events():
                if data == b"[DONE]":
                    continue
                chunk = json.loads(data)
                for choice in chunk.get("choices") or []:
                    text.append((choice.get("delta") or {}).get("content") or "")
                    text.append(choice.get("text") or "")
            return "".join(text)
        choice = self.json()["choices"][0]
        answer: str = choice["message"]["content"] if "message" in choice else choice["text"]
        return answer

    def error_events(self) -> list[dict[str, Any]]:
        found = []
        for data in self.events():
            if data != b"[DONE]":
                chunk = json.loads(data)
                if "error" in chunk:
                    found.append(chunk["error"])
        return found


def post(
    url: str,
    body: Any = None,
    *,
    raw: bytes | None = None,
    headers: Mapping[str, str] | None = None,
    timeout: float = 30.0,
    method: str = "POST",
) -> Reply:
    """One request; an HTTP error status is a Reply too."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    all_headers = dict(JSON if headers is None else headers)
    req = urllib.request.Request(url, data, all_headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return Reply(int(resp.status), _lower(resp.headers.items()), resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return Reply(exc.code, _lower(exc.headers.items()), exc.read())


def _lower(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    return {name.lower(): value for name, value in items}


def get_json(url: str, timeout: float = 10.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())
