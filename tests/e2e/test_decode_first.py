"""The decode plan decided from the state alone (issue 49): a later short turn whose D is idle
runs on that D alone, before the turn pays for anything (no /tokenize on any engine, no P
leg), even though P could pull its handle; while D is busy decoding other conversations'
long answers, the same kind of turn is pulled by P, so the prefill stays off D's batch."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Iterator

import pytest

from harness.chat import MODEL, Message, chat_turn, client, get_json
from harness.metrics import metric
from harness.procs import wait_until
from harness.stack import start_stack
from tests.e2e.conftest import BIDIR, Stack, p_route_calls, pulled, reference_chat

SLOW = (*BIDIR, "--decode-ms-per-token", "15")  # a 300-token answer streams for 4.5 s
# The decode plan while D has fewer than 2 in flight (shipped: 64, which a test would have to
# crowd D to pass; the tests' routers otherwise prefer a pull: tests/conftest.py). D's own
# count of its requests, read every --health-interval, counts in its load.
IDLE = ("--decode-local-idle-inflight", "2", "--health-interval", "0.5")


@pytest.fixture(scope="module")
def stack(redis_url_session: str) -> Iterator[Stack]:
    with start_stack(
        prefill=[SLOW],
        decode=[SLOW],
        reference=("--decode-ms-per-token", "15"),
        routers=[IDLE],
        redis=redis_url_session,
        name="decode-first",
    ) as st:
        yield st


def tokenize_calls(st: Stack) -> float:
    return sum(metric(e.url, "http_requests_total", handler="/tokenize") for e in st.engines)


def decode_plans(st: Stack) -> float:
    return metric(st.url, "kvbaton_kv_reuse_total", outcome="hit", reason="via=decode")


def d_idle(stack: Stack) -> bool:
    """Whether the router sees its D idle: none of its requests, none in D's last count."""
    (d,) = get_json(stack.url + "/status")["instances"]["decode"]
    return d["outstanding"] == 0 and d["engine_requests"] == 0


def opened(st: Stack, topic: str) -> tuple[str, list[Message]]:
    """A conversation's first turn (a plain P/D turn that leaves D's handle), and its next
    question."""
    cid = f"first-{uuid.uuid4().hex[:8]}"
    messages: list[Message] = [{"role": "user", "content": f"Tell me about {topic}."}]
    with client(st.router.base_url) as api:
        answer, reuse, _ = chat_turn(api, messages, cid=cid)
    assert reuse == "miss;reason=no-session"
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}]
    return cid, messages


def test_a_short_turn_on_an_idle_d_runs_there_without_a_tokenize(stack: Stack) -> None:
    cid, messages = opened(stack, "the harbour seals")
    wait_until(lambda: d_idle(stack), "the router sees D idle (after another test's streams)")
    asked, p_legs, plans = tokenize_calls(stack), p_route_calls(stack.p.url), decode_plans(stack)
    with client(stack.router.base_url) as api:
        answer, reuse, _ = chat_turn(api, messages, cid=cid)
    assert reuse == "hit;via=decode"
    assert answer == reference_chat(stack, messages, 24)
    assert tokenize_calls(stack) == asked, "no /tokenize on any engine"
    # No P leg (the handle left unread is released off the turn's path, through P's
    # /v1/completions that reads nothing).
    assert p_route_calls(stack.p.url)[0] == p_legs[0], "no P leg"
    assert decode_plans(stack) == plans + 1, "counted by plan"


@contextlib.contextmanager
def busy_d(stack: Stack) -> Iterator[None]:
    """Two long answers streaming from the one D while the block runs."""
    started = threading.Barrier(3)
    done: list[int] = []

    def long_answer(i: int) -> None:
        prompt = [{"role": "user", "content": f"A long story, number {i}."}]
        body = {"conversation_id": f"busy-{i}-{uuid.uuid4().hex[:6]}"}
        with (
            client(stack.router.base_url, timeout=60) as other,
            other.chat.completions.with_streaming_response.create(
                model=MODEL,
                messages=prompt,  # type: ignore[arg-type]
                max_tokens=300,
                stream=True,
                extra_body=body,
            ) as resp,
        ):
            chunks = resp.iter_lines()
            next(chunks)  # D is decoding it
            started.wait(10)
            for _ in chunks:
                pass
        done.append(i)

    threads = [threading.Thread(target=long_answer, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    try:
        started.wait(10)  # two streams in flight on the one D: busy
        yield
    finally:
        for t in threads:
            t.join(30)
    assert sorted(done) == [0, 1]


def pulled_turn(stack: Stack, cid: str, messages: list[Message]) -> None:
    """A turn on a busy D: P pulls D's blocks, the answer is right."""
    read = pulled(stack.p.url)
    with client(stack.router.base_url) as api:
        answer, reuse, _ = chat_turn(api, messages, cid=cid)
    assert reuse == "hit", "P pulled; D kept decoding the others"
    assert pulled(stack.p.url) > read, "P read D's blocks"
    assert answer == reference_chat(stack, messages, 24)


def test_a_busy_d_gets_a_pull(stack: Stack) -> None:
    cid, messages = opened(stack, "the lighthouse")
    with busy_d(stack):
        pulled_turn(stack, cid, messages)


def test_a_turn_on_d_alone_leaves_a_handle_the_next_busy_turn_pulls(stack: Stack) -> None:
    cid, messages = opened(stack, "the tide pools")
    wait_until(lambda: d_idle(stack), "the router sees D idle (after another test's streams)")
    with client(stack.router.base_url) as api:
        answer, reuse, _ = chat_turn(api, messages, cid=cid)
    assert reuse == "hit;via=decode"
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    # D kept its blocks for P (bidirectional): not miss;reason=decode-local, a recompute.
    with busy_d(stack):
        pulled_turn(stack, cid, messages)
