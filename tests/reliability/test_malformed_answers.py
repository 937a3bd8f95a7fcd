"""D's answer is checked before it is passed on or stored (issue 50, item 1): a 200 that is
not what the API promises (an HTML page, half a JSON body, a stream cut without `[DONE]`, an
event that is not JSON) is a 502 or a stream ended by one error event, logged with D's URL,
counted against D, and nothing is stored."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.metrics import metric
from harness.procs import wait_until
from harness.router import RouterProc
from tests.reliability.conftest import ROUTER_FLAGS, Stack
from tests.reliability.helpers import Conversation, instance, new_cid, router, session
from tests.support.fake_d import FakeD, Shape, fake_d

SSE = "text/event-stream; charset=utf-8"


def html(_: bytes) -> tuple[bytes, str]:
    return b"<html><body><h1>502 Bad Gateway</h1></body></html>", "application/json"


def half(body: bytes) -> tuple[bytes, str]:
    return body[: len(body) // 2], "application/json"


def cut(body: bytes) -> tuple[bytes, str]:
    """Cut in the middle of the last chunk, without `[DONE]`."""
    events = body.split(b"\n\n")
    last = max(i for i, e in enumerate(events) if e and e != b"data: [DONE]")
    kept = b"\n\n".join(events[:last]) + b"\n\n" + events[last][: len(events[last]) // 2]
    return kept, SSE


def not_json(body: bytes) -> tuple[bytes, str]:
    return b"data: <html>oops</html>\n\n" + body, SSE


@pytest.fixture(scope="module")
def fake(stack: Stack) -> Iterator[tuple[FakeD, RouterProc]]:
    ps = [p.url for p in stack.ps]
    with (
        fake_d(stack.ds[0].url) as d,
        router(ps, [d.url], *ROUTER_FLAGS, redis_url=stack.redis_url, name="rel-malformed") as r,
    ):
        yield d, r


@pytest.mark.parametrize(
    ("shape", "stream"),
    [(html, False), (half, False), (cut, True), (not_json, True)],
    ids=["html", "half-json", "cut-stream", "data-not-json"],
)
def test_a_malformed_answer_of_d_is_an_error_and_stores_nothing(
    main: Stack, fake: tuple[FakeD, RouterProc], shape: Shape, stream: bool
) -> None:
    d, r = fake
    wait_until(lambda: instance(r.url, "decode", d.url)["usable"], "the fake D is not usable")
    conv = Conversation(r.url, main.ref, new_cid("malformed"))
    conv.turn(stream=stream)
    before = session(main.redis_url, str(conv.cid))
    counted = metric(r.url, "kvbaton_decode_malformed_answers_total", instance=d.url)
    d.shape = shape
    reply = conv.turn(stream=stream, check=False)
    assert d.broken and d.shape is None, "the fake D did not break the answer"
    if stream:
        assert reply.status == 200
        errors = reply.error_events()
        assert len(errors) == 1 and b"malformed" in reply.events()[-1], reply.body[-300:]
        assert b"[DONE]" not in reply.body
    else:
        assert reply.status == 502, reply.body[:300]
        error = reply.json()["error"]
        assert error["type"] == "upstream_error" and "malformed" in error["message"]
        assert len(reply.headers.get("x-request-id", "")) == 32
    after = session(main.redis_url, str(conv.cid))
    assert after.get("turn") == before.get("turn") == "1", "a turn was stored"
    # The claimed handle was spent by P's read; no handle of the broken answer was stored.
    assert after.get("kv_transfer_params", "") in ("", before.get("kv_transfer_params"))
    assert metric(r.url, "kvbaton_decode_malformed_answers_total", instance=d.url) == counted + 1
    line = f"decode answer from {d.url} refused"
    wait_until(lambda: line in r.log.read_text(), "no WARNING names D")
