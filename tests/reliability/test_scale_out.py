"""A router whose --redis-url names a Redis Cluster or a Sentinel-managed master holds a
conversation: turn 2 hits. (The store contract on both: tests/sessions/test_store_topologies.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.reliability.conftest import ENGINE_KEY, Stack
from tests.reliability.helpers import Conversation, new_cid, router
from tests.sessions.topologies import Topology, redis_cluster, redis_sentinel


@pytest.fixture(scope="module", params=["cluster", "sentinel"])
def topology(request: pytest.FixtureRequest) -> Iterator[Topology]:
    make = redis_cluster if request.param == "cluster" else redis_sentinel
    with make() as topo:
        yield topo


@pytest.mark.timeout(90)
def test_router_on_a_cluster_or_sentinel_url_hits_on_turn_two(
    stack: Stack, topology: Topology
) -> None:
    with router(
        [stack.ps[0].url],
        [stack.ds[0].url],
        "--stream-kv-params",
        "--engine-api-key",
        ENGINE_KEY,
        redis_url=topology.url,
        name="rel-scale-router",
    ) as r:
        conv = Conversation(r.url, stack.ref, new_cid("scale"))
        assert conv.turn().reuse == "miss;reason=no-session"
        assert conv.turn(stream=True).reuse == "hit"
        assert conv.turn().reuse == "hit"
