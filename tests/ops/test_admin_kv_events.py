"""Engines added at run time bring their KV events: `POST /admin/instances` (and the seeds'
`/instances/add`) take `kv_events` as `ENDPOINT[,REPLAY]`, like `--kv-events`; the router
subscribes at once, records the endpoint in the registry (so other replicas and a restart
follow it too), and stops reading when the engine is removed. Real processes throughout."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from harness.chat import NULL_HANDOFF, post
from harness.procs import SimProc, free_port, sim, wait_until
from harness.router import RouterProc
from tests.ops.conftest import BIDIR, call, ops_router


@pytest.fixture(scope="module")
def ports() -> tuple[int, int]:
    return free_port(), free_port()


@pytest.fixture(scope="module")
def p2(ports: tuple[int, int]) -> Iterator[SimProc]:
    pub, replay = ports
    flags = ("--kv-events-port", str(pub), "--kv-events-replay-port", str(replay))
    with sim("prefill", *BIDIR, *flags, name="ops-ev-p2") as proc:
        yield proc


@pytest.fixture(scope="module")
def r(p: SimProc, d: SimProc, ops_redis: str) -> Iterator[RouterProc]:
    """A router started without --kv-events."""
    with ops_router(p, [d], redis_url=ops_redis, tag="kvev") as proc:
        yield proc


def kv_events(r: RouterProc) -> dict[str, Any]:
    code, body = call("GET", r.url + "/status", key=None)
    assert code == 200
    return body["kv_events"]  # type: ignore[no-any-return]


def prefill_straight(p: SimProc) -> None:
    """A request straight to the engine: its blocks are stored, and it publishes them."""
    body = {
        "model": "sim-model",
        "prompt": "the valley and the rain " * 12,
        "max_tokens": 1,
        "kv_transfer_params": NULL_HANDOFF,
    }
    assert post(p.url + "/v1/completions", body).status == 200


def test_a_bad_endpoint_is_refused_and_nothing_joins(r: RouterProc, p2: SimProc) -> None:
    code, body = call(
        "POST",
        r.url + "/admin/instances",
        {"url": p2.url, "role": "prefill", "kv_events": "udp://nowhere"},
    )
    assert code == 400
    assert body["error"]["param"] == "kv_events"
    assert "tcp://HOST:PORT" in body["error"]["message"]
    assert kv_events(r) == {"on": False}


def test_an_added_engine_is_followed_and_recorded(
    r: RouterProc, p2: SimProc, ports: tuple[int, int], ops_redis: str
) -> None:
    spec = f"tcp://127.0.0.1:{ports[0]},tcp://127.0.0.1:{ports[1]}"
    code, body = call(
        "POST", r.url + "/admin/instances", {"url": p2.url, "role": "prefill", "kv_events": spec}
    )
    assert code == 201, body
    wait_until(
        lambda: kv_events(r).get("engines", {}).get(p2.url, {}).get("in_sync", False),
        "the router did not subscribe to the added engine's KV events",
    )
    view = kv_events(r)["engines"][p2.url]
    assert (view["endpoint"], view["replay"]) == tuple(spec.split(","))
    prefill_straight(p2)
    wait_until(
        lambda: kv_events(r)["engines"][p2.url]["blocks"] > 0,
        "the router's index did not follow the added engine's events",
    )
    store = redis.Redis.from_url(ops_redis, decode_responses=True)
    try:
        entry = json.loads(store.hget("kvbaton:instances", p2.url) or "{}")
    finally:
        store.close()
    assert entry["kv_events"] == spec and entry["state"] == "active"


def test_a_second_replica_follows_the_registry_entry(
    p: SimProc, d: SimProc, p2: SimProc, ops_redis: str
) -> None:
    """A router started later reads the entry from Redis and subscribes too."""
    with ops_router(p, [d], redis_url=ops_redis, tag="kvev-2") as other:
        wait_until(
            lambda: kv_events(other).get("engines", {}).get(p2.url, {}).get("blocks", 0) > 0,
            "the second replica did not follow the registry's KV-events endpoint",
        )


def test_a_removed_engine_is_no_longer_read(r: RouterProc, p2: SimProc) -> None:
    code, _ = call("DELETE", r.url + "/admin/instances", {"url": p2.url, "role": "prefill"})
    assert code == 200
    assert kv_events(r) == {"on": False}
