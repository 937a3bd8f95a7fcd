"""Plain HTTP helpers for the reliability tests: raw turns, SSE events, OpenAI-format errors,
raw sockets, metrics, waiting."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis

from harness.chat import JSON, Reply, chat_body, get_json, post
from harness.metrics import metric
from harness.procs import SimProc
from harness.router import RouterProc
from harness.router import router as support_router

T = TypeVar("T")


def reference(ref: SimProc, messages: list[dict[str, str]], max_tokens: int = 8) -> str:
    """The from-scratch answer of a plain instance (the simulator's oracle)."""
    reply = post(ref.url + "/v1/chat/completions", chat_body(messages, max_tokens=max_tokens))
    assert reply.status == 200, reply.body
    return reply.answer()


def new_cid(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:10]}"


@dataclass
class Conversation:
    """A multi-turn chat through a router; every answer is checked against the oracle."""

    router: str
    ref: SimProc
    cid: str | None
    headers: dict[str, str] = field(default_factory=lambda: dict(JSON))
    messages: list[dict[str, str]] = field(default_factory=list)
    turns: int = 0
    # Unique content: no instance's prefix cache holds this conversation from another test,
    # so every hit is a real read of D's blocks.
    nonce: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    def turn(
        self, *, stream: bool = False, max_tokens: int = 32, check: bool = True, **extra: Any
    ) -> Reply:
        """Ask the next question; on success append the answer (as a client would)."""
        self.turns += 1
        self.messages.append(
            {"role": "user", "content": f"Question {self.turns} ({self.nonce}): tea or rain?"}
        )
        body = chat_body(self.messages, cid=self.cid, stream=stream, max_tokens=max_tokens, **extra)
        reply = post(self.router + "/v1/chat/completions", body, headers=self.headers)
        if check:
            assert reply.status == 200, reply.body[:500]
            assert not reply.error_events(), reply.body[-500:]
            expected = reference(self.ref, self.messages, max_tokens)
            assert reply.answer() == expected, f"turn {self.turns}: wrong answer ({reply.reuse})"
        if reply.status == 200 and not reply.error_events():
            self.messages.append({"role": "assistant", "content": reply.answer()})
        else:
            self.messages.pop()
            self.turns -= 1
        return reply


def assert_openai_error(reply: Reply, status: int) -> dict[str, Any]:
    """`reply` is an OpenAI-format JSON error with `status`; its `error` object."""
    assert reply.status == status, (reply.status, reply.body[:300])
    assert reply.headers.get("content-type", "").startswith("application/json")
    error = json.loads(reply.body)["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert "code" in error
    return dict(error)


def total(sims: list[SimProc], name: str, **labels: str) -> float:
    """A counter summed over several simulators."""
    return sum(metric(s.url, name, **labels) for s in sims)


def running(sim: SimProc) -> float:
    return metric(sim.url, "vllm:num_requests_running")


def faults(sim: SimProc, **values: float) -> None:
    reply = post(sim.url + "/sim/faults", values)
    assert reply.status == 200, reply.body


def pending_faults(sim: SimProc) -> dict[str, Any]:
    state: dict[str, Any] = get_json(sim.url + "/sim/faults")
    return state


def clear_faults(sim: SimProc) -> None:
    post(sim.url + "/sim/faults", method="DELETE")


def instance(router_url: str, role: str, url: str) -> dict[str, Any]:
    status = get_json(router_url + "/status")
    found: dict[str, Any] = next(i for i in status["instances"][role] if i["url"] == url)
    return found


def raw_post(port: int, path: str, body: Mapping[str, Any]) -> bytes:
    """An HTTP/1.1 JSON POST to 127.0.0.1:port as bytes, for a raw socket."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    return head + data


def request_head(port: int, headers: dict[str, str], path: str = "/v1/chat/completions") -> bytes:
    """A JSON POST's head to 127.0.0.1:port with `headers`, for a raw socket to send a body."""
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}"]
    lines += ["Content-Type: application/json", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def read_to_close(sock: socket.socket, timeout: float) -> bytes:
    """What the server sends until it closes the connection (or `timeout` passes)."""
    sock.settimeout(timeout)
    data = b""
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return data


def send_and_hang_up(port: int, path: str, body: Mapping[str, Any], *, after: float) -> bytes:
    """Send a request on a raw socket, read for `after` seconds, then close the connection."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(raw_post(port, path, body))
        deadline = time.monotonic() + after
        while (left := deadline - time.monotonic()) > 0:
            sock.settimeout(left)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                break
            if not chunk:
                break
            got += chunk
    return got


def read_until(port: int, path: str, body: Mapping[str, Any], marker: bytes, count: int) -> bytes:
    """Send a request on a raw socket and hang up once `marker` was seen `count` times."""
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(raw_post(port, path, body))
        while got.count(marker) < count:
            chunk = sock.recv(65536)
            if not chunk:
                break
            got += chunk
    return got


def session(redis_url: str, cid: str) -> dict[str, str]:
    """The conversation's HASH as redis-cli shows it (any tenant); {} when there is none."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        keys = client.keys(f"kvbaton:conv:{{*:{cid}}}")
        return dict(client.hgetall(keys[0])) if keys else {}
    finally:
        client.close()


def placed(engines: list[SimProc], url: str) -> SimProc:
    return next(e for e in engines if e.url == url)


def advance_clock(engine: SimProc, seconds: float) -> int:
    """Move a simulator's clock forward; the number of requests whose pins expired."""
    reply = post(engine.url + "/sim/clock", {"advance_s": seconds})
    assert reply.status == 200, reply.body
    expired: int = reply.json()["expired_requests"]
    return expired


def router(
    prefill: Sequence[str], decode: Sequence[str], *args: str, redis_url: str, name: str
) -> contextlib.AbstractContextManager[RouterProc]:
    """harness.router.router with a start-up wait long enough for a machine loaded by
    other engines, and one more try on a fresh port if it is not up."""
    return support_router(
        prefill,
        decode,
        *args,
        redis_url=redis_url,
        name=name,
        ready_timeout=60,
        attempts=2,
        stop_timeout=15,
    )
