"""router/turn/ahead.py: D's leg sent beside the claim is used only for the same request to
the same D, cancelled (its open answer closed: D aborts) otherwise, and counted in D's load
only while it opens."""

from __future__ import annotations

import asyncio
from typing import Any

from router.config import Settings
from router.engines.pool import Pool
from router.turn.ahead import Ahead
from router.turn.decide.asks import handle_seen
from router.turn.incoming import Incoming


class Answer:
    """D's open answer: only whether it was cut matters here."""

    status, content_type = 200, "text/event-stream"

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


BODY: dict[str, Any] = {"messages": [{"role": "user", "content": "hi"}], "return_token_ids": True}


def pool() -> Pool:
    return Pool(("http://p",), ("http://d1", "http://d2"))


async def opened(answer: Answer) -> Any:
    return answer


async def sent(answer: Answer, d: Any, headers: dict[str, str] | None = None) -> Ahead:
    ahead = Ahead(d, headers or {}, BODY, asyncio.ensure_future(opened(answer)))
    await asyncio.sleep(0)  # the request opens
    return ahead


async def test_the_same_request_to_the_same_d_is_used() -> None:
    p, answer = pool(), Answer()
    d1 = p.find("decode", "http://d1")
    ahead = await sent(answer, d1)
    assert await ahead.take(d1, {}, dict(BODY)) is answer
    ahead.cancel()  # the turn's end: what it relays is not cut
    assert ahead.used and not answer.closed


async def test_another_d_or_request_cancels_it() -> None:
    p = pool()
    d1, d2 = p.find("decode", "http://d1"), p.find("decode", "http://d2")
    other = {**BODY, "return_token_ids": False}
    for d, headers, body in ((d2, {}, BODY), (d1, {"X-data-parallel-rank": "1"}, BODY)):
        answer = Answer()
        ahead = await sent(answer, d1)
        assert await ahead.take(d, headers, body) is None
        assert answer.closed and not ahead.used
    answer = Answer()
    ahead = await sent(answer, d1)
    assert await ahead.take(d1, {}, other) is None, "another body: another request"
    assert answer.closed


async def test_a_request_still_opening_is_cancelled_and_counted_while_it_opens() -> None:
    p = pool()
    d1, d2 = p.find("decode", "http://d1"), p.find("decode", "http://d2")
    assert d1 is not None and d2 is not None
    never: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    ahead = Ahead(d1, {}, BODY, asyncio.ensure_future(never))
    assert (ahead.counted(d1), ahead.counted(d2)) == (1, 0)
    ahead.cancel()
    await asyncio.sleep(0)
    assert ahead.task.cancelled() and ahead.counted(d1) == 0
    assert await ahead.take(d1, {}, BODY) is None, "a cancelled request is never taken"


def test_d_keeps_its_blocks_only_when_its_handle_will_be_seen() -> None:
    """A turn on D alone asks D to keep its blocks (and return its handle) only when that
    handle reaches the router: a JSON answer, or a stream that carries it. A 0.32 stream
    does not: the blocks would stay pinned on D, unknown, until their TTL."""
    engines: dict[str, Any] = {"prefill": ("http://p",), "decode": ("http://d",)}
    plain = Settings(**engines, check_models=False)
    streamed = Settings(**engines, check_models=False, stream_kv_params=True)
    json_turn, stream = chat(stream=False), chat(stream=True)
    assert handle_seen(plain, json_turn, d_streams_params=False)
    assert not handle_seen(plain, stream, d_streams_params=False)
    assert handle_seen(plain, stream, d_streams_params=True), "D 0.33: it streams its handle"
    assert handle_seen(streamed, stream, d_streams_params=False), "--stream-kv-params"


def chat(*, stream: bool) -> Incoming:
    return Incoming("chat", {"messages": [], "stream": stream}, stream, "c", "default", False)
