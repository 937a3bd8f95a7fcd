"""The demo proxies' conventions on a real router: `POST /instances/add` with
`{"type", "instance"}` and `X-API-Key: $ADMIN_API_KEY` (as their curl examples send it), and
/status's `prefill_node_count`/`decode_node_count` and node lists."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from harness.procs import SimProc, free_port
from harness.router import RouterProc, router
from tests.ops.conftest import call, chat

pytestmark = pytest.mark.e2e

SEED_KEY = "seed-admin-api-key"


@pytest.fixture(scope="module")
def r(p: SimProc, d: SimProc, ops_redis: str) -> Iterator[RouterProc]:
    # The demo proxies read ADMIN_API_KEY from the environment; so does the router.
    with pytest.MonkeyPatch.context() as env:
        env.setenv("ADMIN_API_KEY", SEED_KEY)
        env.delenv("KVBATON_ADMIN_API_KEY", raising=False)
        bare = p.url.removeprefix("http://")  # --prefill host:port, as the demo proxies take it
        with router([bare], [d.url], redis_url=ops_redis, name="ops-seeds") as proc:
            yield proc


def add(r: RouterProc, body: Any, key: str | None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["X-API-Key"] = key
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(r.url + "/instances/add", data, headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=20) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


@pytest.mark.parametrize("key", [None, "", "wrong", SEED_KEY + "x", SEED_KEY[:-1]])
def test_a_wrong_or_missing_key_is_an_openai_401(
    r: RouterProc, d2: SimProc, key: str | None
) -> None:
    instance = d2.url.removeprefix("http://")
    status, body = add(r, {"type": "decode", "instance": instance}, key)
    assert status == 401
    assert set(body["error"]) >= {"message", "type", "code"}
    assert body["error"]["type"] == "authentication_error"
    assert body["error"]["code"] == "invalid_api_key"
    assert "X-API-Key" in body["error"]["message"]
    assert d2.url not in call("GET", r.url + "/status", key=None)[1]["decode_nodes"]


def test_status_carries_the_seed_fields(r: RouterProc, p: SimProc, d: SimProc) -> None:
    status, body = call("GET", r.url + "/status", key=None)
    assert status == 200
    assert body["prefill_node_count"] == 1 and body["decode_node_count"] == 1
    assert body["prefill_nodes"] == [p.url]  # the bare host:port became http://host:port
    assert body["decode_nodes"] == [d.url]
    assert [i["url"] for i in body["instances"]["prefill"]] == [p.url]


def test_bad_bodies_and_unreachable_instances_are_refused(r: RouterProc) -> None:
    for body in (b"not json", {"type": "both", "instance": "h:1"}, {"instance": "h:1"}):
        status, answer = add(r, body, SEED_KEY)
        assert status == 400, body
        assert answer["error"]["type"] == "invalid_request_error"
    status, answer = add(r, {"type": "decode", "instance": f"127.0.0.1:{free_port()}"}, SEED_KEY)
    assert status == 422 and answer["error"]["code"] == "instance_refused"


def test_add_with_the_seed_body_joins_the_pool_and_serves(
    r: RouterProc, d: SimProc, d2: SimProc
) -> None:
    status, body = add(r, {"type": "decode", "instance": d2.url.removeprefix("http://")}, SEED_KEY)
    assert status == 201, body
    assert body["status"] == "added" and body["instance"]["url"] == d2.url
    _, st = call("GET", r.url + "/status", key=None)
    assert st["decode_node_count"] == 2 and sorted(st["decode_nodes"]) == sorted([d.url, d2.url])
    assert chat(r.url, "seed-c1", "hello")[0] == 200
    # Again: already there, nothing changes.
    status, body = add(r, {"type": "decode", "instance": d2.url}, SEED_KEY)
    assert status == 200 and body["status"] == "active"
    assert call("GET", r.url + "/status", key=None)[1]["decode_node_count"] == 2


def test_without_any_key_the_route_is_disabled() -> None:
    from router.errors import NotFound, Unauthorized
    from router.http.seeds import check_api_key

    with pytest.raises(NotFound, match="ADMIN_API_KEY"):
        check_api_key("", SEED_KEY)
    with pytest.raises(Unauthorized):
        check_api_key(SEED_KEY, " ")
    check_api_key(SEED_KEY, SEED_KEY)
