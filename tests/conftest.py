"""Shared fixtures: one private redis-server per test session, flushed before each test; and
the test tiers (markers unit, component, e2e), set here by folder or file."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from harness.procs import LOG_ROOT, RUN_ENV, prune_logs, redis_server
from harness.waiting import SCALE_ENV, timeout_scale

TESTS = Path(__file__).resolve().parent
TIERS = ("unit", "component", "e2e")
# A test's tier is that of the longest path here that holds its file (relative to tests/).
# unit: in-process and pure (no redis-server, no socket, no subprocess); component: a real
# redis-server, real sockets or servers inside the test process; e2e: real processes (the
# router under Hypercorn, simulators, engines, the tooling's own runs).
TIER_BY_PATH = {
    "unit": "unit",
    "unit/test_backends.py": "component",  # aiohttp servers on loopback
    "unit/test_workers.py": "component",  # binds sockets
    "sessions": "component",
    "sessions/test_codec.py": "unit",
    "sessions/test_digests.py": "unit",
    "sessions/test_keys.py": "unit",
    "sessions/test_memory_store.py": "unit",
    "sessions/test_model.py": "unit",
    "sim": "component",  # the simulator app in the test's event loop
    "sim/test_units.py": "unit",
    "sim/test_features.py": "e2e",
    "sim/test_pd.py": "e2e",
    "sim/test_responses_pd.py": "e2e",
    "sim_events": "component",
    "sim_events/test_decode.py": "unit",
    "compose": "e2e",  # containers; runs only under `make test-compose`
    "deploy": "e2e",
    "deploy/test_compose.py": "unit",
    "e2e": "e2e",
    "ops": "e2e",
    "reliability": "e2e",
    "tooling": "e2e",
    "vllm": "e2e",
}


def tier_of(path: Path) -> str:
    rel = path.resolve().relative_to(TESTS).as_posix()
    best = max(
        (key for key in TIER_BY_PATH if rel == key or rel.startswith(key + "/")),
        key=len,
        default=None,
    )
    if best is None:
        raise pytest.UsageError(f"tests/{rel} has no tier: add it to TIER_BY_PATH")
    return TIER_BY_PATH[best]


# The routers the tests start prefer a pull to the decode plan while P has room, even on an
# idle D (shipped: --decode-local-idle-inflight 64, which runs the tests' later turns on D
# alone): the tests of the pull see pulls. The tests of the rule name the flag.
PULL_FIRST_ENV = {"KVBATON_DECODE_LOCAL_IDLE_INFLIGHT": "0"}


def pytest_configure(config: pytest.Config) -> None:
    """In the main pytest process (not an xdist worker, which inherits it): this run's id,
    which names its folder of process logs; the folders of runs that have ended go. Every
    process the tests start gets PULL_FIRST_ENV unless the environment sets it already."""
    for key, value in PULL_FIRST_ENV.items():
        os.environ.setdefault(key, value)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ[RUN_ENV] = str(os.getpid())
        prune_logs()


def pytest_report_header(config: pytest.Config) -> str:
    return (
        f"kvbaton: process logs in {LOG_ROOT}/run-{os.environ.get(RUN_ENV)}; timeouts x "
        f"{timeout_scale():.2f} ({SCALE_ENV} or the load per CPU, at most 4)"
    )


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    """The test's pytest-timeout (its marker's, else --timeout or the ini's) times
    timeout_scale() when the test starts, as every wait in harness/ scales."""
    scale = timeout_scale()
    marker = item.get_closest_marker("timeout")
    if marker is not None:
        base = marker.args[0] if marker.args else marker.kwargs.get("timeout")
        rest = {k: v for k, v in marker.kwargs.items() if k != "timeout"}
    else:
        given = item.config.getoption("timeout", None) or os.environ.get("PYTEST_TIMEOUT")
        base, rest = given or item.config.getini("timeout"), {}
    if scale != 1.0 and base and float(base) > 0:
        item.add_marker(pytest.mark.timeout(float(base) * scale, **rest), append=False)
    yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test with its tier (`pytest -m unit`, `make test-unit`...); a test marked
    with a tier itself (a pure test in an e2e file) keeps that one."""
    for item in items:
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(getattr(pytest.mark, tier_of(item.path)))


@pytest.fixture(scope="session")
def redis_url_session() -> Iterator[str]:
    with redis_server() as (url, _port, _proc):
        yield url


@pytest.fixture
async def redis_url(redis_url_session: str) -> AsyncIterator[str]:
    """The session's redis-server, emptied for this test and after it (a later file's stacks
    on the same worker share it: a registry entry left here would be their instance)."""
    client = aioredis.from_url(redis_url_session)
    await client.flushall()
    try:
        yield redis_url_session
    finally:
        await client.flushall()
        await client.aclose()
