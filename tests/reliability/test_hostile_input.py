"""Hostile input (issue 22, findings 5-9): control characters in a forwarded header, JSON
nested just under Python's recursion limit, bodies over the limit (declared or chunked),
requests D would refuse after P pinned their KV, and slow clients. Each gets a clear answer
(or a closed connection) before any engine works, with real sockets and a real router."""

from __future__ import annotations

import http.client
import json
import select
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest

from harness.chat import JSON, MODEL, Reply, post
from harness.router import RouterProc
from tests.reliability.conftest import ENGINE_KEY, MAX_BODY, Stack
from tests.reliability.helpers import (
    assert_openai_error,
    new_cid,
    read_to_close,
    request_head,
    router,
    total,
)

CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
SIM_MAX_MODEL_LEN = 8192  # the simulators' default context length


def engine_work(stack: Stack) -> float:
    """Prompt tokens computed by every P and D: unchanged when no engine was called."""
    return total([*stack.ps, *stack.ds], "vllm:prompt_tokens_total")


def chat_body(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "max_tokens": 4, **fields}


def refused_before_the_engines(
    stack: Stack, body: dict[str, Any], *, path: str = CHAT, param: str | None = None
) -> dict[str, Any]:
    before = engine_work(stack)
    reply = post(stack.url + path, body)
    error = assert_openai_error(reply, 400)
    assert reply.headers.get("x-request-id"), reply.headers
    if param is not None:
        assert error["param"] == param, error
    assert engine_work(stack) == before, "an engine worked on a request the router refuses"
    return error


# -- 5: forwarded headers ----------------------------------------------------------------------


@pytest.mark.parametrize("char", ["\x1b", "\x7f", "\x01"], ids=["esc", "del", "soh"])
def test_control_characters_in_x_session_id_are_a_400(stack: Stack, char: str) -> None:
    """With a valid conversation id in the body, X-Session-ID is still forwarded to the
    engines: it is validated like a conversation id (it used to reach aiohttp: a 500)."""
    before = engine_work(stack)
    body = chat_body([{"role": "user", "content": "hi"}], conversation_id=new_cid("hdr"))
    reply = post(stack.url + CHAT, body, headers={**JSON, "X-Session-ID": f"a{char}b"})
    assert_openai_error(reply, 400)
    assert reply.headers.get("x-request-id")
    assert engine_work(stack) == before


def test_a_valid_x_session_id_beside_a_body_id_is_served(stack: Stack) -> None:
    body = chat_body([{"role": "user", "content": "hi"}], conversation_id=new_cid("hdr-ok"))
    reply = post(stack.url + CHAT, body, headers={**JSON, "X-Session-ID": "session-1"})
    assert reply.status == 200, reply.body[:300]


# -- 6: deep nesting -------------------------------------------------------------------------


DEEP = "__deep__"  # replaced by the nested arrays in the JSON text (json.dumps would recurse)


def deep_messages(where: str) -> list[dict[str, Any]]:
    deep = DEEP
    if where == "content-part":
        return [{"role": "user", "content": [{"type": "text", "text": "hi", "extra": deep}]}]
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    if where == "tool-calls":
        assistant = {"role": "assistant", "content": None, "tool_calls": [{**call, "x": deep}]}
    else:
        assistant = {"role": "assistant", "content": "ok", "reasoning": deep}
    return [{"role": "user", "content": "hi"}, assistant, {"role": "user", "content": "more"}]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("depth", [700, 990])
@pytest.mark.parametrize("where", ["content-part", "tool-calls", "reasoning"])
def test_json_nested_under_the_recursion_limit_is_a_400_before_any_engine(
    stack: Stack, where: str, depth: int, stream: bool
) -> None:
    offset = stack.router.log.stat().st_size
    body = chat_body(deep_messages(where), conversation_id=new_cid("deep"), stream=stream)
    raw = json.dumps(body).replace(f'"{DEEP}"', "[" * depth + "]" * depth).encode()
    assert len(raw) < MAX_BODY
    before = engine_work(stack)
    reply = post(stack.url + CHAT, raw=raw, headers=JSON)
    assert_openai_error(reply, 400)
    assert reply.headers.get("x-request-id")
    assert engine_work(stack) == before
    with stack.router.log.open("rb") as log:
        log.seek(offset)
        written = log.read()
    assert b"Traceback" not in written, written[-2000:]


# -- 7: body limits ---------------------------------------------------------------------------


def test_a_declared_length_over_the_limit_gets_413_before_the_body_is_read(stack: Stack) -> None:
    port = stack.router.port
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request_head(port, {"Content-Length": str(200 * 1024 * 1024)}))
        started = time.monotonic()
        data = read_to_close(sock, 5.0)
    assert data.startswith(b"HTTP/1.1 413"), data[:300]
    assert time.monotonic() - started < 5.0
    assert b"payload_too_large" in data


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError("no VmRSS")


def test_a_chunked_body_is_cut_at_the_limit(stack: Stack) -> None:
    port, pid = stack.router.port, stack.router.proc.pid
    rss_before = rss_kib(pid)
    chunk = b"x" * 65536
    framed = f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n"
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(request_head(port, {"Transfer-Encoding": "chunked"}))
        try:
            while sent < 300 * 1024 * 1024:
                sock.sendall(framed)
                sent += len(chunk)
                if select.select([sock], [], [], 0)[0]:
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        data = read_to_close(sock, 5.0)
    assert data.startswith(b"HTTP/1.1 413"), data[:300]
    # Cut near the limit: what is in flight in the socket buffers, not 300 MiB.
    assert sent < 32 * 1024 * 1024, sent
    assert rss_kib(pid) - rss_before < 32 * 1024, "the router buffered the body"


# -- 8: what D would refuse, refused before P ------------------------------------------------

LIMIT_CASES: list[tuple[str, dict[str, Any], str]] = [
    ("max-tokens-minus-1", {"max_tokens": -1}, "max_tokens"),
    ("max-tokens-0", {"max_tokens": 0}, "max_tokens"),
    ("max-tokens-1e9-float", {"max_tokens": 1e9}, "max_tokens"),
    ("max-tokens-1e9-int", {"max_tokens": 10**9}, "max_tokens"),
    ("max-tokens-context", {"max_tokens": SIM_MAX_MODEL_LEN}, "max_tokens"),
    ("max-tokens-string", {"max_tokens": "5"}, "max_tokens"),
    ("max-tokens-bool", {"max_tokens": True}, "max_tokens"),
    ("max-completion-tokens-0", {"max_completion_tokens": 0}, "max_completion_tokens"),
    ("min-tokens-above-max", {"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ("min-tokens-negative", {"min_tokens": -1}, "min_tokens"),
    (
        "stream-options-without-stream",
        {"stream_options": {"include_usage": True}},
        "stream_options",
    ),
    ("stream-options-stream-false", {"stream": False, "stream_options": {}}, "stream_options"),
    ("stream-options-not-object", {"stream": True, "stream_options": 1}, "stream_options"),
    ("n-0", {"n": 0}, "n"),
]


@pytest.mark.parametrize(
    ("case", "fields", "param"), LIMIT_CASES, ids=[case[0] for case in LIMIT_CASES]
)
def test_what_decode_would_refuse_is_a_400_before_prefill(
    stack: Stack, case: str, fields: dict[str, Any], param: str
) -> None:
    body = chat_body([{"role": "user", "content": "hi"}], conversation_id=new_cid("lim"))
    refused_before_the_engines(stack, {**body, **fields}, param=param)


def test_responses_max_output_tokens_0_is_a_400_before_prefill(stack: Stack) -> None:
    body = {"model": MODEL, "input": "hi", "max_output_tokens": 0}
    refused_before_the_engines(stack, body, path=RESPONSES, param="max_output_tokens")


def test_a_max_tokens_that_fits_is_served(stack: Stack) -> None:
    body = chat_body([{"role": "user", "content": "hi"}], max_tokens=3, min_tokens=1)
    reply = post(stack.url + CHAT, body)
    assert reply.status == 200, reply.body[:300]


# -- 9: slow clients --------------------------------------------------------------------------

SLOW_TIMEOUT = 1.0


@pytest.fixture(scope="module")
def strict(stack: Stack) -> Iterator[RouterProc]:
    """A router on the shared engines with one-second header and body timeouts."""
    with router(
        [stack.p.url],
        [stack.d.url],
        "--engine-api-key",
        ENGINE_KEY,
        "--header-timeout",
        str(SLOW_TIMEOUT),
        "--body-timeout",
        str(SLOW_TIMEOUT),
        redis_url=stack.redis_url or "",
        name="rel-strict",
    ) as r:
        yield r


def test_a_client_sending_a_header_line_every_so_often_is_cut(strict: RouterProc) -> None:
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as sock:
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\n".encode())
        started = time.monotonic()
        closed = False
        for i in range(20):  # 8 s of header lines, one every 0.4 s
            try:
                sock.sendall(f"X-Pad-{i}: y\r\n".encode())
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            readable = select.select([sock], [], [], 0.4)[0]
            if readable and read_to_close(sock, 1.0) == b"":
                closed = True
                break
        elapsed = time.monotonic() - started
    assert closed, "the connection was held past the header timeout"
    assert elapsed < SLOW_TIMEOUT + 3.0, elapsed


def test_a_kept_alive_connection_idle_past_the_header_timeout_is_closed(
    strict: RouterProc,
) -> None:
    """Between requests the header timeout is the keep-alive (router/http/idle.py's timer):
    a connection that served two requests back to back is closed once idle that long."""
    conn = http.client.HTTPConnection("127.0.0.1", strict.port, timeout=10)
    try:
        for _ in range(2):
            conn.request("GET", "/health")
            assert conn.getresponse().read() == b'{"status":"ok"}'
        assert conn.sock is not None
        idle_from = time.monotonic()
        rest = read_to_close(conn.sock, SLOW_TIMEOUT + 5.0)  # returns when the router closes it
        idle_for = time.monotonic() - idle_from
    finally:
        conn.close()
    assert rest == b"", rest[:200]
    assert SLOW_TIMEOUT * 0.8 < idle_for < SLOW_TIMEOUT + 3.0, idle_for


def test_a_slow_body_gets_408(strict: RouterProc, stack: Stack) -> None:
    before = engine_work(stack)
    body = json.dumps(chat_body([{"role": "user", "content": "hi"}])).encode()
    with socket.create_connection(("127.0.0.1", strict.port), timeout=10) as sock:
        sock.sendall(request_head(strict.port, {"Content-Length": str(len(body))}))
        started = time.monotonic()
        data = b""
        for byte in body[:40]:  # one byte every 0.2 s: 8 s for these alone
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            if select.select([sock], [], [], 0.2)[0]:
                break
        data = read_to_close(sock, 5.0)
    assert data.startswith(b"HTTP/1.1 408"), data[:300]
    assert b"request_timeout" in data
    assert time.monotonic() - started < SLOW_TIMEOUT + 3.0
    assert engine_work(stack) == before


def test_a_kept_alive_connection_still_serves_within_the_timeouts(strict: RouterProc) -> None:
    reply: Reply = post(strict.url + CHAT, chat_body([{"role": "user", "content": "hi"}]))
    assert reply.status == 200, reply.body[:300]
