"""Plain HTTP helpers for the reliability tests: raw turns, SSE events, metrics, waiting."""

from __future__ import annotations

import contextlib
import json
import socket
import time
import urllib.error
import urllib.request
import uuid
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import redis

from tests.e2e.conftest import metric
from tests.e2e.harness import RouterProc
from tests.procs import SimProc, free_port, log_file, spawn, stop, wait_http

T = TypeVar("T")

MODEL = "sim-model"
JSON = {"Content-Type": "application/json"}


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
        return choice["message"]["content"] if "message" in choice else choice["text"]

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


def get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.loads(resp.read())


def chat_body(
    messages: list[dict[str, str]],
    *,
    cid: str | None = None,
    stream: bool = False,
    max_tokens: int = 8,
    **extra: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": stream,
        **extra,
    }
    if cid is not None:
        body["conversation_id"] = cid
    return body


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
        self, *, stream: bool = False, max_tokens: int = 8, check: bool = True, **extra: Any
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


def send_and_hang_up(port: int, path: str, body: Mapping[str, Any], *, after: float) -> bytes:
    """Send a request on a raw socket, read for `after` seconds, then close the connection."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(head + data)
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
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    got = b""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(head + data)
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


@contextlib.contextmanager
def router(
    prefill: Sequence[str], decode: Sequence[str], *args: str, redis_url: str, name: str
) -> Iterator[RouterProc]:
    """`kvbaton serve` as tests.e2e.harness.router starts it, with a start-up wait long enough
    for a machine loaded by other engines, and one more try on a fresh port if it is not up."""
    for attempt in range(2):
        port = free_port()
        argv = ["router", "serve", "--host", "127.0.0.1", "--port", str(port), "--redis-url"]
        argv += [redis_url, "--prefill", *prefill, "--decode", *decode, *args]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # spawn() hands its log file over
            proc = spawn(argv, name)
        try:
            wait_http(f"http://127.0.0.1:{port}/health", timeout=60, proc=proc)
        except (TimeoutError, RuntimeError):
            stop(proc, timeout=15)
            if attempt:
                raise
            continue
        try:
            yield RouterProc(f"http://127.0.0.1:{port}", port, proc, log_file(name))
        finally:
            stop(proc, timeout=15)
        return


def retried(
    make: Callable[[], contextlib.AbstractContextManager[T]], exits: contextlib.ExitStack
) -> T:
    """Enter make() in exits; a start that timed out (other engines load this machine, and
    several processes start at once) is tried once more."""
    try:
        return exits.enter_context(make())
    except (TimeoutError, RuntimeError):
        return exits.enter_context(make())


@contextlib.contextmanager
def started(make: Callable[[], contextlib.AbstractContextManager[T]]) -> Iterator[T]:
    """retried() as a context manager of its own."""
    with contextlib.ExitStack() as exits:
        yield retried(make, exits)
