"""D's leg sent beside the claim (issue 49, router/turn/ahead.py): a later turn that will run
on its idle D alone reaches D while the store still holds the claim; the claimed state then
uses that request (one D request for the turn), or cancels it when the claim makes the turn
something else (the answer is the P/D turn's, right all the same)."""

from __future__ import annotations

import hashlib
import threading
import uuid
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import redis

from harness.chat import Message, chat_turn, client
from harness.metrics import metric
from harness.procs import wait_until
from harness.stack import start_stack
from sessions import scripts
from sessions.keys import conversation_key
from tests.e2e.conftest import BIDIR, Stack, p_route_calls, reference_chat
from tests.support.slow_redis import SlowRedis, slow_redis

# The claim script's EVALSHA (redis-py sends a registered script by its SHA-1).
CLAIM_SHA = hashlib.sha1(scripts.CLAIM.encode()).hexdigest().encode()
SLOW = (*BIDIR, "--decode-ms-per-token", "15")
IDLE = ("--decode-local-idle-inflight", "2")  # D alone while idle (tests/conftest.py)
# The claim is held while D answers: no store timeout may end it first.
ROUTER = (*IDLE, "--store-timeout", "60")


@pytest.fixture(scope="module")
def proxied(redis_url_session: str) -> Iterator[tuple[Stack, SlowRedis]]:
    port = urlsplit(redis_url_session).port
    assert port is not None
    with (
        slow_redis(port) as proxy,
        start_stack(
            prefill=[SLOW],
            decode=[SLOW],
            reference=("--decode-ms-per-token", "15"),
            routers=[ROUTER],
            redis=proxy.url,
            name="decode-ahead",
        ) as st,
    ):
        yield st, proxy


def ahead(st: Stack, outcome: str) -> float:
    return metric(st.url, "kvbaton_decode_ahead_total", outcome=outcome)


def opened(st: Stack) -> tuple[str, list[Message]]:
    cid = f"ahead-{uuid.uuid4().hex[:8]}"
    messages: list[Message] = [{"role": "user", "content": "Tell me about the tides."}]
    with client(st.router.base_url) as api:
        answer, _, _ = chat_turn(api, messages, cid=cid)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}]
    return cid, messages


def test_d_answers_the_turn_while_the_claim_is_held(proxied: tuple[Stack, SlowRedis]) -> None:
    st, proxy = proxied
    cid, messages = opened(st)
    d_calls, used = p_route_calls(st.d.url)[0], ahead(st, "used")
    released = proxy.hold_next(CLAIM_SHA)  # the turn's claim: the only one in flight
    got: list[tuple[str, str]] = []

    def turn() -> None:
        with client(st.router.base_url) as api:
            answer, reuse, _ = chat_turn(api, messages, cid=cid)
        got.append((answer, reuse))

    worker = threading.Thread(target=turn)
    worker.start()
    try:
        # D serves the whole request (15 ms a token) while the store has not answered.
        wait_until(lambda: p_route_calls(st.d.url)[0] > d_calls, "D answered the turn")
        assert proxy.holding.is_set(), "the claim is still held"
    finally:
        released.set()
        worker.join(30)
    assert got, "the turn ended"
    answer, reuse = got[0]
    assert reuse == "hit;via=decode"
    assert answer == reference_chat(st, messages, 24)
    assert p_route_calls(st.d.url)[0] == d_calls + 1, "one D request for the turn"
    assert ahead(st, "used") == used + 1


def test_a_claim_that_finds_no_session_cancels_it(
    proxied: tuple[Stack, SlowRedis], redis_url_session: str
) -> None:
    st, _ = proxied
    cid, messages = opened(st)
    # Gone from the store behind this router's back (its TTL, another replica, an operator).
    with redis.Redis.from_url(redis_url_session) as r:
        keys = list(r.scan_iter(match=conversation_key("*", cid)))  # the client's tenant
        assert len(keys) == 1 and r.delete(*keys) == 1
    dropped = ahead(st, "dropped")
    with client(st.router.base_url) as api:
        answer, reuse, _ = chat_turn(api, messages, cid=cid)
    assert reuse == "miss;reason=no-session"
    assert answer == reference_chat(st, messages, 24)
    assert ahead(st, "dropped") == dropped + 1
