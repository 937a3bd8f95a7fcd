"""Admin API on instances, against real processes: add (validated against /v1/models), drain
(no new turns, in-flight turns finish), remove. The tests run in order on one router."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from harness.chat import CHAT, chat_body, post
from harness.metrics import metric
from harness.procs import SimProc, sim
from harness.router import RouterProc
from harness.waiting import scaled
from tests.ops.conftest import BIDIR, call, chat, decode_urls, ops_router


@pytest.fixture(scope="module")
def slow_d() -> Iterator[SimProc]:
    """A decode engine slow enough (30 ms a token) to have a turn in flight while we act."""
    with sim("decode", *BIDIR, "--decode-ms-per-token", "30", name="ops-slow-d") as proc:
        yield proc


@pytest.fixture(scope="module")
def other_model() -> Iterator[SimProc]:
    with sim("decode", "--model", "other-model", name="ops-other") as proc:
        yield proc


@pytest.fixture(scope="module")
def r(p: SimProc, slow_d: SimProc, ops_redis: str) -> Iterator[RouterProc]:
    with ops_router(p, [slow_d], redis_url=ops_redis, tag="inst") as proc:
        yield proc


def served(d: SimProc) -> float:
    return metric(d.url, "vllm:request_success_total")


def status(r: RouterProc) -> dict[str, Any]:
    code, body = call("GET", r.url + "/status", key=None)
    assert code == 200
    return body  # type: ignore[no-any-return]


def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + scaled(timeout)
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


class SlowStream(threading.Thread):
    """A streaming chat turn of 60 tokens, read to the end in a thread."""

    def __init__(self, router_url: str) -> None:
        super().__init__(daemon=True)
        self.router_url = router_url
        self.status = 0
        self.text = ""

    def run(self) -> None:
        messages = [{"role": "user", "content": "Tell me a long story."}]
        cid = f"slow-{uuid.uuid4().hex[:8]}"
        body = chat_body(messages, cid=cid, max_tokens=60, stream=True)
        reply = post(self.router_url + CHAT, body, timeout=30)
        self.status = reply.status
        self.text = reply.body.decode()


def in_flight(r: RouterProc, url: str) -> int:
    return int(decode_urls(status(r)).get(url, {}).get("outstanding", -1))


def test_add_is_refused_unless_the_instance_serves_the_model(
    r: RouterProc, other_model: SimProc
) -> None:
    code, body = call(
        "POST", r.url + "/admin/instances", {"role": "decode", "url": other_model.url}
    )
    assert code == 422
    assert "'other-model'" in body["error"]["message"] and "'sim-model'" in body["error"]["message"]
    assert body["error"]["code"] == "instance_refused"
    code, body = call(
        "POST", r.url + "/admin/instances", {"role": "decode", "url": "http://127.0.0.1:1"}
    )
    assert code == 422 and "did not answer /v1/models" in body["error"]["message"]
    for bad in ({"role": "decode"}, {"url": "http://x:1"}, {"role": "d", "url": "http://x:1"}):
        assert call("POST", r.url + "/admin/instances", bad)[0] == 400
    assert call("POST", r.url + "/admin/instances", {"role": "decode", "url": "ftp://x"})[0] == 400
    assert len(status(r)["instances"]["decode"]) == 1


def test_drain_lets_the_turn_in_flight_finish_and_takes_no_new_ones(
    r: RouterProc, slow_d: SimProc, d2: SimProc, ops_redis: str
) -> None:
    stream = SlowStream(r.url)
    stream.start()
    wait_for(lambda: in_flight(r, slow_d.url) == 1)
    code, body = call("POST", r.url + "/admin/instances/drain", {"url": slow_d.url})
    assert code == 200 and body["status"] == "draining"
    assert body["instance"]["draining"] is True and body["instance"]["outstanding"] == 1
    # The only decode instance drains: a new turn has nowhere to go.
    assert chat(r.url, "ops-refused", "hello")[0] == 503
    stream.join(20)
    assert stream.status == 200 and "data: [DONE]" in stream.text
    assert in_flight(r, slow_d.url) == 0
    # Add a second decode instance: new turns go there, none to the draining one.
    code, body = call("POST", r.url + "/admin/instances", {"role": "decode", "url": d2.url + "/"})
    assert code == 201 and body["status"] == "added"
    assert body["instance"]["source"] == "admin" and body["instance"]["model"] == "sim-model"
    before_slow, before_d2 = served(slow_d), served(d2)
    for i in range(3):
        assert chat(r.url, f"ops-drain-{i}", "hello there")[0] == 200
    assert served(slow_d) == before_slow
    assert served(d2) == before_d2 + 3
    # Kept in Redis for restarts and replicas.
    entries = redis.Redis.from_url(ops_redis).hgetall("kvbaton:instances")
    assert json.loads(entries[slow_d.url.encode()])["state"] == "draining"
    assert json.loads(entries[d2.url.encode()]) | {"updated_at": 0} == {
        "role": "decode",
        "state": "active",
        "updated_at": 0,
    }


def test_adding_again_undrains_and_a_url_has_one_role(
    r: RouterProc, slow_d: SimProc, d2: SimProc
) -> None:
    code, body = call("POST", r.url + "/admin/instances", {"role": "decode", "url": slow_d.url})
    assert code == 200 and body["status"] == "active"
    assert decode_urls(status(r))[slow_d.url]["usable"] is True
    code, body = call("POST", r.url + "/admin/instances", {"role": "prefill", "url": d2.url})
    assert code == 409


def test_remove_lets_the_turn_in_flight_finish(r: RouterProc, slow_d: SimProc, d2: SimProc) -> None:
    # Only slow_d takes new turns while d2 drains, so the stream lands there.
    assert call("POST", r.url + "/admin/instances/drain", {"url": d2.url})[0] == 200
    stream = SlowStream(r.url)
    stream.start()
    wait_for(lambda: in_flight(r, slow_d.url) == 1)
    code, body = call("DELETE", r.url + "/admin/instances?url=" + slow_d.url)
    assert code == 200 and body["status"] == "removed"
    assert slow_d.url not in decode_urls(status(r))
    stream.join(20)
    assert stream.status == 200 and "data: [DONE]" in stream.text
    # Removing it again: it is not in the pool any more.
    code, body = call("DELETE", r.url + "/admin/instances", {"url": slow_d.url})
    assert code == 404 and body["error"]["code"] == "instance_not_found"
    # Put the pool back: d2 active, slow_d added again.
    assert call("POST", r.url + "/admin/instances", {"role": "decode", "url": d2.url})[0] == 200
    assert call("POST", r.url + "/admin/instances", {"role": "decode", "url": slow_d.url})[0] == 201
    code, body = call("GET", r.url + "/admin/instances")
    assert code == 200 and body["registry_error"] == ""
    assert {u: e["state"] for u, e in body["registry"].items()} == {
        slow_d.url: "active",
        d2.url: "active",
    }
    assert set(decode_urls(body)) == {slow_d.url, d2.url}
