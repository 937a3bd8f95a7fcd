"""The instance registry: admin changes survive a router restart (Redis) and reach a second
router sharing the Redis; command-line instances are the base the registry applies on top of."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from harness.procs import SimProc, free_port
from harness.waiting import scaled
from router.config import Settings
from router.engines.client import Upstream
from router.engines.pool import Instance
from router.lifecycle.registry import admit, desired
from sessions.registry_store import Entry
from tests.ops.conftest import call, decode_urls, ops_router
from tests.support.services import make_services


def status(url: str) -> dict[str, Any]:
    code, body = call("GET", url + "/status", key=None)
    assert code == 200
    return body  # type: ignore[no-any-return]


def eventually(check: Callable[[], bool], timeout: float = 10.0) -> None:
    """The other replica re-reads the registry every --health-interval (0.3 s here)."""
    deadline = time.monotonic() + scaled(timeout)
    while not check():
        assert time.monotonic() < deadline, "the replica did not converge"
        time.sleep(0.05)


def test_changes_reach_a_second_router_and_survive_a_restart(
    p: SimProc, d: SimProc, d2: SimProc, ops_redis: str
) -> None:
    with ops_router(p, [d], redis_url=ops_redis, tag="reg-b") as b:
        with ops_router(p, [d], redis_url=ops_redis, tag="reg-a") as a:
            assert (
                call("POST", a.url + "/admin/instances", {"role": "decode", "url": d2.url})[0]
                == 201
            )
            assert call("POST", a.url + "/admin/instances/drain", {"url": d.url})[0] == 200

            def b_sees_both() -> bool:
                urls = decode_urls(status(b.url))
                return d2.url in urls and urls[d.url]["draining"]

            eventually(b_sees_both)
            added = decode_urls(status(b.url))[d2.url]
            assert added["model"] == "sim-model" and added["block_size"] == 16
            assert added["source"] == "admin" and added["usable"]
        # Router a is gone; a new router started with the same command line gets its changes.
        with ops_router(p, [d], redis_url=ops_redis, tag="reg-a2") as a2:
            urls = decode_urls(status(a2.url))
            assert set(urls) == {d.url, d2.url}
            assert urls[d.url]["draining"] and not urls[d2.url]["draining"]
            # Removing on the restarted router reaches router b too, and so does undraining.
            assert call("DELETE", a2.url + "/admin/instances", {"url": d2.url})[0] == 200
            assert (
                call("POST", a2.url + "/admin/instances", {"role": "decode", "url": d.url})[0]
                == 200
            )
            eventually(lambda: set(decode_urls(status(b.url))) == {d.url})
            eventually(lambda: not decode_urls(status(b.url))[d.url]["draining"])


def test_an_entry_whose_instance_is_down_joins_unhealthy(
    p: SimProc, d: SimProc, ops_redis: str
) -> None:
    """The health loop re-admits it once it answers; a malformed entry is ignored."""
    client = redis.Redis.from_url(ops_redis)
    client.hset("kvbaton:instances", "http://127.0.0.1:1", '{"role":"decode","state":"active"}')
    client.hset("kvbaton:instances", "http://127.0.0.1:2", "not json")
    try:
        with ops_router(p, [d], redis_url=ops_redis, tag="reg-down") as r:
            urls = decode_urls(status(r.url))
            assert set(urls) == {d.url, "http://127.0.0.1:1"}
            assert urls["http://127.0.0.1:1"]["healthy"] is False
            assert "127.0.0.1:1" in urls["http://127.0.0.1:1"]["last_error"]
    finally:
        client.delete("kvbaton:instances")
        client.close()


def entry(role: str, state: str) -> Entry:
    return Entry(role=role, state=state)  # type: ignore[arg-type]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("entries", "want"),
    [
        ({}, {("prefill", "P"): False, ("decode", "D"): False}),
        ({"D": entry("decode", "draining")}, {("prefill", "P"): False, ("decode", "D"): True}),
        ({"D": entry("decode", "removed")}, {("prefill", "P"): False}),
        (
            {"D2": entry("decode", "active"), "P": entry("prefill", "removed")},
            {("decode", "D"): False, ("decode", "D2"): False},
        ),
        # An entry only speaks for its own role: a removed decode URL leaves the prefill one.
        ({"P": entry("decode", "removed")}, {("prefill", "P"): False, ("decode", "D"): False}),
        (
            {"X": entry("prefill", "draining")},
            {("prefill", "P"): False, ("decode", "D"): False, ("prefill", "X"): True},
        ),
    ],
)
def test_registry_applies_on_top_of_the_command_line(
    entries: dict[str, Entry], want: dict[tuple[str, str], bool]
) -> None:
    assert desired({"prefill": ["P"], "decode": ["D"]}, entries) == want


async def test_admit_says_once_why_an_unreachable_instance_cannot_join() -> None:
    """discovery writes "check failed: <why>"; the admin's 422 reason does not repeat it."""
    settings = Settings(prefill=("http://p",), decode=("http://d",))
    upstream = Upstream(settings)
    await upstream.open()
    url = f"http://127.0.0.1:{free_port()}"
    inst = Instance(url, "decode")
    try:
        reason = await admit(make_services(settings, upstream), inst)
    finally:
        await upstream.close()
    assert inst.last_error.startswith("check failed: ")  # /status keeps the whole error
    assert reason.startswith(f"{url} did not answer /v1/models: ")
    assert "check failed" not in reason, reason
