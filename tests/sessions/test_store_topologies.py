"""The store contract on a 3-master Redis Cluster and on a Sentinel-managed master, the URL
forms sessions.connect reads, and a Sentinel failover."""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from sessions import connect
from sessions.keys import conversation_key, pins_key
from sessions.model import SessionState
from sessions.redis_store import RedisSessionStore
from sessions.store import StoreError

# The store contract every topology passes, run here with the harness below (cluster and
# sentinel).
from tests.sessions.store_contract import *  # noqa: F403 (the contract's tests)
from tests.sessions.store_contract import Harness
from tests.sessions.topologies import Topology, redis_cluster, redis_sentinel, wait_until


@pytest.fixture(scope="module")
def cluster() -> Iterator[Topology]:
    with redis_cluster(3) as topo:
        yield topo


@pytest.fixture(scope="module")
def sentinel() -> Iterator[Topology]:
    with redis_sentinel() as topo:
        yield topo


@pytest.fixture(params=["cluster", "sentinel"])
async def harness(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    topo: Topology = request.getfixturevalue(request.param)
    raw = connect.connect(topo.url, socket_timeout=5, connect_timeout=5)
    await raw.flushall()
    store = RedisSessionStore(topo.url, timeout=5)

    async def ttl(key: str, ttl_s: float) -> None:
        pttl = await raw.pttl(key)
        assert ttl_s * 1000 - 5_000 < pttl <= ttl_s * 1000

    async def pin_ttl(decode: str, ttl_s: float) -> None:
        await ttl(pins_key(decode), ttl_s)

    yield Harness(store, ttl, pin_ttl)
    await store.close()
    await connect.close(raw)


@pytest.mark.parametrize(
    ("url", "kind", "nodes", "extra"),
    [
        ("redis+cluster://h1:7000,h2:7001", "cluster", [("h1", 7000), ("h2", 7001)], {}),
        ("redis+cluster://h1", "cluster", [("h1", 6379)], {}),
        ("redis+cluster://h1:7000/0", "cluster", [("h1", 7000)], {}),
        (
            "rediss+cluster://u:p%40ss@[::1]:7000",
            "cluster",
            [("::1", 7000)],
            {"tls": True, "username": "u", "password": "p@ss"},
        ),
        (
            "redis+sentinel://s1:26380,s2/mymaster/3",
            "sentinel",
            [("s1", 26380), ("s2", 26379)],
            {"service": "mymaster", "db": 3},
        ),
        (
            "redis+sentinel://:secret@s1:26380/mymaster",
            "sentinel",
            [("s1", 26380)],
            {"service": "mymaster", "db": 0, "password": "secret", "username": None},
        ),
    ],
)
def test_parse_cluster_and_sentinel_urls(
    url: str, kind: str, nodes: list[tuple[str, int]], extra: dict[str, Any]
) -> None:
    target = connect.parse(url)
    assert target is not None
    assert target.kind == kind
    assert list(target.nodes) == nodes
    for name, value in extra.items():
        assert getattr(target, name) == value


@pytest.mark.parametrize(
    "url", ["redis://127.0.0.1:6379/0", "rediss://h:6380", "unix:///tmp/redis.sock"]
)
def test_plain_urls_are_left_to_redis_py(url: str) -> None:
    assert connect.parse(url) is None


@pytest.mark.parametrize(
    "url",
    [
        "redis+cluster://",
        "redis+cluster://h1:7000/2",  # a cluster has db 0 only
        "redis+cluster://h1:notaport",
        "redis+cluster://h1:70000",
        "redis+sentinel://s1:26379",  # no service name
        "redis+sentinel://s1:26379/svc/x",
        "redis+sentinel://s1:26379/svc/0/extra",
    ],
)
def test_bad_cluster_and_sentinel_urls(url: str) -> None:
    with pytest.raises(ValueError):
        connect.parse(url)


def _cli(port: int, *args: str) -> str:
    done = subprocess.run(
        ["redis-cli", "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    return done.stdout.strip()


async def test_cluster_spreads_conversations_over_masters(cluster: Topology) -> None:
    """Hash-tagged keys land on several masters, and each stays readable through the client."""
    store = RedisSessionStore(cluster.url, timeout=5)
    keys = [conversation_key("tenant", f"spread-{i}") for i in range(24)]
    try:
        for i, key in enumerate(keys):
            assert await store.commit(key, SessionState(turn=1, token_count=i), 0, 60)
        for i, key in enumerate(keys):
            got = await store.get(key)
            assert got is not None and got.token_count == i
        holding = [port for port in cluster.ports if int(_cli(port, "dbsize")) > 0]
        assert len(holding) > 1
    finally:
        for key in keys:
            await store.delete(key)
        await store.close()


@pytest.mark.timeout(60)
async def test_sentinel_failover_moves_the_store_to_the_new_master() -> None:
    with redis_sentinel(replicas=1) as topo:
        store = RedisSessionStore(topo.url, timeout=1)
        key = conversation_key("tenant", "failover")
        try:
            assert await store.commit(key, SessionState(turn=1), 0, 60)
            assert _cli(topo.ports[0], "wait", "1", "20000") == "1"  # replicated before the kill
            old_master = topo.procs[0]
            old_master.terminate()
            old_master.wait(10)
            with pytest.raises(StoreError):
                await store.get(key)  # the old master is gone: an error, not a hang

            def promoted() -> bool:
                addr = _cli(topo.sentinel_port, "sentinel", "get-master-addr-by-name", "kvbaton")
                return str(topo.ports[1]) in addr

            wait_until(promoted, "the sentinel did not promote the replica", timeout=30)
            # The store reconnects through the sentinel to the promoted replica.
            state = None
            for _ in range(50):
                try:
                    state = await store.get(key)
                    break
                except StoreError:
                    await asyncio.sleep(0.2)
            assert state is not None and state.turn == 1
            assert await store.commit(key, SessionState(turn=2), 1, 60)
        finally:
            await store.close()


@pytest.mark.parametrize("kind", ["plain", "cluster", "sentinel"])
async def test_many_concurrent_calls_wait_for_a_connection(
    request: pytest.FixtureRequest, redis_url_session: str, kind: str
) -> None:
    """More turns in flight than redis-py's default pool size (100) must not fail the store
    ("Too many connections" would open the router's circuit and turn reuse off for everyone)."""
    url = redis_url_session if kind == "plain" else request.getfixturevalue(kind).url
    store = RedisSessionStore(url, timeout=10)
    keys = [conversation_key("tenant", f"crowd-{i}") for i in range(150)]
    try:
        results = await asyncio.gather(
            *(store.commit(key, SessionState(turn=1), 0, 60) for key in keys)
        )
        assert all(results)
        claimed = await asyncio.gather(
            *(store.claim(key, f"req-{i}") for i, key in enumerate(keys))
        )
        assert all(state is not None and state.turn == 1 for state in claimed)
    finally:
        await asyncio.gather(*(store.delete(key) for key in keys))
        await store.close()
