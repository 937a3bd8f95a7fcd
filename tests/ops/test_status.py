"""GET /status (public, nothing secret) and the admin API's gate: disabled -> 404, wrong key ->
401, both as OpenAI-format errors; real router and simulator processes."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harness.procs import SimProc
from harness.router import RouterProc, router
from tests.ops.conftest import ADMIN_KEY, call, ops_router


@pytest.fixture(scope="module")
def r(p: SimProc, d: SimProc, ops_redis: str) -> Iterator[RouterProc]:
    with ops_router(
        p, [d], "--engine-api-key", "engine-secret", redis_url=ops_redis, tag="st"
    ) as proc:
        yield proc


def test_status_shows_instances_store_model_and_nothing_secret(
    r: RouterProc, p: SimProc, d: SimProc, ops_redis: str
) -> None:
    status, body = call("GET", r.url + "/status", key=None)
    assert status == 200
    assert body["model"] == "sim-model"
    assert body["block_size"] == 16
    assert body["version"] == "0.1.0"
    (prefill,) = body["instances"]["prefill"]
    (decode,) = body["instances"]["decode"]
    assert prefill["url"] == p.url and decode["url"] == d.url
    for inst in (prefill, decode):
        assert inst["healthy"] is True and inst["draining"] is False and inst["usable"] is True
        assert inst["outstanding"] == 0
        assert inst["model"] == "sim-model" and inst["block_size"] == 16
        assert inst["last_error"] == "" and inst["source"] == "command-line"
    assert body["store"] == {
        "kind": "redis",
        "status": "ok",
        "error": "",
        "circuit_open": False,
        "failures": 0,
    }
    assert body["kv_events"] == {"on": False}  # no --kv-events: handles sent, P by load
    text = str(body)
    for secret in (ADMIN_KEY, "engine-secret", ops_redis):
        assert secret not in text


@pytest.mark.parametrize("key", [None, "wrong", ADMIN_KEY + "x", "", ADMIN_KEY[:-1]])
def test_admin_wrong_or_missing_key_answers_401(r: RouterProc, key: str | None) -> None:
    for method, path in (("GET", "/admin/instances"), ("DELETE", "/admin/conversations/x")):
        status, body = call(method, r.url + path, key=key)
        assert status == 401
        assert body["error"]["type"] == "authentication_error"
        assert body["error"]["code"] == "invalid_admin_key"
    # Unknown admin paths are not revealed before the key is checked either.
    assert call("GET", r.url + "/admin/whatever", key=key)[0] == 401


def test_unknown_admin_path_is_an_openai_404(r: RouterProc) -> None:
    status, body = call("GET", r.url + "/admin/whatever")
    assert status == 404
    assert body["error"]["type"] == "not_found_error"


def test_ready_says_the_store_is_ok_and_not_degraded(r: RouterProc) -> None:
    status, body = call("GET", r.url + "/ready", key=None)
    assert status == 200
    assert body == {
        "store": "ok",
        "prefill": {"usable": 1, "total": 1},
        "decode": {"usable": 1, "total": 1},
        "degraded": False,
        "status": "ready",
    }


def test_admin_disabled_answers_404_and_status_shows_a_store_down(p: SimProc, d: SimProc) -> None:
    with router([p.url], [d.url], redis_url="redis://127.0.0.1:1/0", name="ops-noadmin") as r:
        for method, path in (("GET", "/admin/instances"), ("POST", "/admin/instances/drain")):
            status, body = call(method, r.url + path, {"url": d.url}, key="anything")
            assert status == 404
            assert body["error"]["code"] == "admin_disabled"
            assert "admin API is disabled" in body["error"]["message"]
        ready_status, ready = call("GET", r.url + "/ready", key=None)
        status, body = call("GET", r.url + "/status", key=None)
    # Turns are served (without reuse), so the router is ready, degraded: a load balancer
    # acting on /ready must not turn a Redis outage into a full outage.
    assert ready_status == 200, ready
    assert ready["status"] == "ready" and ready["degraded"] is True
    assert ready["store"].startswith("unavailable: ")
    assert ready["decode"] == {"usable": 1, "total": 1}
    assert status == 200
    assert body["store"]["status"] == "unavailable"
    assert body["store"]["error"]
    assert "127.0.0.1:1/0" not in str(body)
    assert [i["url"] for i in body["instances"]["decode"]] == [d.url]
