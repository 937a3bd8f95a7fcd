"""The client hangs up mid-stream or while the turn waits for D: the D request is cancelled,
nothing is committed, and the abort is counted as client-disconnected."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from harness.chat import chat_body
from harness.procs import wait_until
from harness.router import RouterProc
from tests.reliability.conftest import Slow
from tests.reliability.helpers import (
    Conversation,
    clear_faults,
    faults,
    metric,
    new_cid,
    read_until,
    router,
    running,
    send_and_hang_up,
)

PATH = "/v1/chat/completions"


@pytest.fixture(scope="module")
def slow_router(slow: Slow) -> Iterator[RouterProc]:
    args = ("--stream-kv-params", "--decode-first-byte-timeout", "30", "--shutdown-grace", "2")
    with router([slow.p.url], [slow.d.url], *args, redis_url=slow.redis_url, name="rel-slow") as r:
        yield r


@pytest.fixture
def conv(slow: Slow, slow_router: RouterProc) -> Iterator[Conversation]:
    """A conversation with one committed turn (a handle on the slow D), on an idle stack."""
    clear_faults(slow.d)
    wait_until(lambda: running(slow.d) == 0, "the slow D is busy")
    c = Conversation(slow_router.url, slow.ref, new_cid("hangup"))
    assert c.turn(max_tokens=2).reuse == "miss;reason=no-session"
    yield c
    clear_faults(slow.d)


def disconnects(router_url: str) -> float:
    return metric(router_url, "kvbaton_turns_aborted_total", reason="client-disconnected")


def turns_ended(router_url: str) -> float:
    """Turns the router has finished with (committed or aborted: one log line each)."""
    return metric(router_url, "kvbaton_request_duration_seconds_count")


def next_question(conv: Conversation, max_tokens: int, stream: bool) -> dict[str, object]:
    messages = [*conv.messages, {"role": "user", "content": "And tomorrow?"}]
    return chat_body(messages, cid=conv.cid, stream=stream, max_tokens=max_tokens)


@pytest.mark.timeout(60)
def test_client_disconnect_mid_stream_cancels_decode(
    slow: Slow, slow_router: RouterProc, conv: Conversation
) -> None:
    before = disconnects(slow_router.url)
    tokens = metric(slow.d.url, "vllm:generation_tokens_total")
    finished = metric(slow.d.url, "vllm:request_success_total")
    body = next_question(conv, 12, stream=True)  # 12 tokens: 6 s if it ran to the end
    got = read_until(slow_router.port, PATH, body, b"data: ", 3)
    assert b" 200 " in got.split(b"\r\n", 1)[0] and b"x-kv-reuse: hit" in got.lower()
    wait_until(lambda: disconnects(slow_router.url) == before + 1, "abort not counted")
    wait_until(lambda: running(slow.d) == 0, "D still decodes for nobody")
    assert metric(slow.d.url, "vllm:request_success_total") == finished
    assert metric(slow.d.url, "vllm:generation_tokens_total") - tokens < 12
    assert conv.turn(max_tokens=2).reuse == "miss;reason=no-handle"  # nothing was committed


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_client_disconnect_while_waiting_for_decode(
    slow: Slow, slow_router: RouterProc, conv: Conversation, stream: bool
) -> None:
    """P is done, D holds back its first byte, the client hangs up: the router notices at once
    (while D still stalls), cancels the turn and commits nothing."""
    before = disconnects(slow_router.url)
    commits = metric(slow_router.url, "kvbaton_session_commits_total")
    ended = turns_ended(slow_router.url)
    stall = 4.0  # generous: the hang-up must be noticed well before D answers
    faults(slow.d, stall_s=stall)
    started = time.monotonic()
    send_and_hang_up(slow_router.port, PATH, next_question(conv, 2, stream), after=0.3)
    try:
        wait_until(lambda: disconnects(slow_router.url) == before + 1, "hang-up not noticed")
        assert time.monotonic() - started < stall, "noticed only when D answered"
    finally:
        wait_until(lambda: turns_ended(slow_router.url) > ended, "the turn never ended")
    time.sleep(max(0.0, started + stall - time.monotonic()))
    wait_until(lambda: running(slow.d) == 0, "D still decodes for nobody")
    assert metric(slow_router.url, "kvbaton_session_commits_total") == commits
    assert conv.turn(max_tokens=2).reuse == "miss;reason=no-handle"
