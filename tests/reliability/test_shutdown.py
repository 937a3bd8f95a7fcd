"""Graceful shutdown: on SIGTERM a streaming turn in flight runs to its end (and commits),
bounded by --shutdown-grace, while new requests are refused; the router exits 0."""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import time

import pytest

from harness.chat import JSON, chat_body
from harness.procs import wait_until
from harness.router import RouterProc
from tests.reliability.conftest import SLOW_TOKEN_MS, Slow
from tests.reliability.helpers import new_cid, reference, router, running, session

GRACE = 10.0
TOKENS = 6  # 3 s of decoding on the slow D: it spans the SIGTERM
MESSAGES = [{"role": "user", "content": "Arriving during the shutdown."}]


def new_request_outcome(port: int) -> str:
    """What a new client sees during the shutdown: "refused" or the HTTP status."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("POST", "/v1/chat/completions", json.dumps(chat_body(MESSAGES)), JSON)
        resp = conn.getresponse()
        body = json.loads(resp.read())
        assert body["error"]["message"] == "the router is shutting down", body
        return str(resp.status)
    except ConnectionRefusedError:
        return "refused"
    except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
        return "closed"
    finally:
        conn.close()


def start_stream(
    port: int, messages: list[dict[str, str]], cid: str, tokens: int
) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse, bytes]:
    """A streaming turn, read until its first SSE event: (connection, response, bytes so far)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = chat_body(messages, cid=cid, stream=True, max_tokens=tokens)
    conn.request("POST", "/v1/chat/completions", json.dumps(body), JSON)
    resp = conn.getresponse()
    assert resp.status == 200
    head = resp.read1(65536)
    while b"data: " not in head:
        head += resp.read1(65536)
    return conn, resp, head


def long_grace(slow: Slow, name: str) -> contextlib.AbstractContextManager[RouterProc]:
    """A router on the slow engines whose shutdown would wait 30 s for work in flight."""
    return router(
        [slow.p.url], [slow.d.url], "--shutdown-grace", "30", redis_url=slow.redis_url, name=name
    )


@pytest.mark.timeout(60)
def test_sigterm_lets_the_stream_in_flight_finish_and_refuses_new_requests(slow: Slow) -> None:
    wait_until(lambda: running(slow.d) == 0, "the slow D is busy")
    args = ("--stream-kv-params", "--shutdown-grace", str(GRACE))
    cid = new_cid("shutdown")
    messages = [{"role": "user", "content": f"Tell me a long story ({cid})."}]
    with router(
        [slow.p.url], [slow.d.url], *args, redis_url=slow.redis_url, name="rel-shutdown"
    ) as r:
        idle = http.client.HTTPConnection("127.0.0.1", r.port, timeout=10)
        idle.request("GET", "/health")
        idle.getresponse().read()  # a kept-alive connection, idle at the SIGTERM
        conn, resp, head = start_stream(r.port, messages, cid, TOKENS)
        r.proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        time.sleep(0.3)
        outcome = new_request_outcome(r.port)
        # The listener stays open while the stream in flight runs: a clear 503, not a
        # refused connection.
        assert outcome == "503", outcome
        try:
            idle.request("GET", "/v1/models")
            on_idle = str(idle.getresponse().status)
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            on_idle = "closed"
        assert on_idle == "503", on_idle  # /v1/models on a kept-alive connection
        print(f"during the shutdown: new connection {outcome}, idle keep-alive {on_idle}")
        rest = head + resp.read()  # the stream in flight runs to its end
        conn.close()
        idle.close()
        assert r.proc.wait(GRACE + 10) == 0
        assert time.monotonic() - signalled < GRACE + 10
    text = ""
    for line in rest.split(b"\n"):
        if line.startswith(b"data: {"):
            for choice in json.loads(line[6:])["choices"]:
                text += choice["delta"].get("content") or ""
    assert b'"finish_reason":"length"' in rest and rest.rstrip().endswith(b"data: [DONE]")
    assert text == reference(slow.ref, messages, TOKENS)
    assert session(slow.redis_url, cid)["turn"] == "1", "the finished turn was committed"
    assert SLOW_TOKEN_MS * TOKENS / 1000 < GRACE


@pytest.mark.timeout(60)
def test_a_second_sigterm_stops_at_once(slow: Slow) -> None:
    """An operator's second signal (Ctrl-C twice) does not wait for the stream in flight."""
    wait_until(lambda: running(slow.d) == 0, "the slow D is busy")
    tokens = 40  # 20 s of decoding: far past the test's patience
    cid = new_cid("shutdown-twice")
    messages = [{"role": "user", "content": f"Tell me the longest story ({cid})."}]
    with long_grace(slow, "rel-shutdown-twice") as r:
        conn, _, _ = start_stream(r.port, messages, cid, tokens)
        r.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert r.proc.poll() is None, "the first signal waits for the stream"
        signalled = time.monotonic()
        r.proc.send_signal(signal.SIGTERM)
        assert r.proc.wait(10) == 0
        took = time.monotonic() - signalled
        conn.close()
    print(f"exited {took:.2f} s after the second signal")
    assert took < 5, f"the second signal took {took:.1f} s"
    wait_until(lambda: running(slow.d) == 0, "D still decodes the cut stream")


@pytest.mark.timeout(60)
def test_idle_kept_alive_connections_do_not_hold_the_shutdown(slow: Slow) -> None:
    """Connections idle between requests (the router's idle watch is a timer, not Hypercorn's
    task: router/http/idle.py) are closed as the shutdown begins, not after the grace."""
    with long_grace(slow, "rel-shutdown-idle") as r:
        idle = []
        for _ in range(3):
            conn = http.client.HTTPConnection("127.0.0.1", r.port, timeout=10)
            conn.request("GET", "/health")
            assert conn.getresponse().read()
            idle.append(conn)
        signalled = time.monotonic()
        r.proc.send_signal(signal.SIGTERM)
        assert r.proc.wait(20) == 0
        took = time.monotonic() - signalled
        for conn in idle:
            conn.close()
    print(f"exited {took:.2f} s after SIGTERM with 3 idle kept-alive connections")
    assert took < 5, f"the idle connections held the shutdown for {took:.1f} s"
