"""Reliability fixtures: one P/D stack shared by the package (2 P, 2 D, a reference instance,
a private redis-server the tests stop and restart, the router as a Hypercorn process), and a
slow stack whose decode emits one token every half second."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from harness.chat import get_json
from harness.procs import SimProc, sims, wait_until
from harness.stack import Stack, start_stack, started
from tests.reliability.helpers import clear_faults, running

BIDIR = ("--bidirectional", "--kv-recompute-threshold", "0")
# The shared engines want a key (vLLM --api-key); routers send it from their config.
ENGINE_KEY = "reliability-engine-key"
ENGINE_AUTH = ("--api-key", ENGINE_KEY)
# --log-requests: each engine logs the X-Request-Id it got (tests/reliability/test_request_ids).
P_FLAGS = ("prefill", *BIDIR, *ENGINE_AUTH, "--log-requests")
D_FLAGS = ("decode", *BIDIR, "--stream-kv-params", *ENGINE_AUTH, "--log-requests")
SLOW_P_FLAGS = ("prefill", *BIDIR)
SLOW_D_FLAGS = ("decode", *BIDIR, "--stream-kv-params")

# Small timeouts so that faults show within a test; generous enough for a loaded machine.
STORE_RETRY_AFTER = 1.0
PREFILL_TIMEOUT = 1.5
FIRST_BYTE_TIMEOUT = 2.0
UNHEALTHY_AFTER = 2
MAX_BODY = 65536
TENANT_HEADER = "X-Tenant"
ADMIN_KEY = "reliability-admin-key"
# Every shared-stack router signs its sessions (tests/reliability/test_integrity.py).
SESSION_SECRET = "reliability-session-secret-0001"
# --release-after 900: no handle goes idle-released during the run; a release is a request
# to a P, which would take a fault armed for a turn (tests/e2e/test_pins.py covers releases).
ROUTER_FLAGS = (
    "--release-after",
    "900",
    "--session-secret",
    SESSION_SECRET,
    "--engine-api-key",
    ENGINE_KEY,
    "--admin-key",
    ADMIN_KEY,
    "--stream-kv-params",
    "--prefill-timeout",
    str(PREFILL_TIMEOUT),
    "--decode-first-byte-timeout",
    str(FIRST_BYTE_TIMEOUT),
    "--decode-idle-timeout",
    "10",
    "--unhealthy-after",
    str(UNHEALTHY_AFTER),
    "--health-interval",
    "0.3",
    "--store-retry-after",
    str(STORE_RETRY_AFTER),
    "--max-body-bytes",
    str(MAX_BODY),
    "--tenant-header",
    TENANT_HEADER,
    "--shutdown-grace",
    "2",
)
SLOW_TOKEN_MS = 500


@pytest.fixture(scope="package")
def stack() -> Iterator[Stack]:
    with start_stack(
        prefill=[P_FLAGS[1:]] * 2,
        decode=[D_FLAGS[1:]] * 2,
        reference=(),
        routers=[ROUTER_FLAGS],
        name="rel",
        router_timeout=60,
        router_attempts=2,
    ) as s:
        yield s


def settle(s: Stack) -> None:
    """No fault left armed, Redis up, every instance usable and idle, the store circuit closed."""
    s.start_redis()
    for engine in [*s.engines, s.ref]:
        clear_faults(engine)

    def settled() -> bool:
        status = get_json(s.url + "/status")
        instances = status["instances"]["prefill"] + status["instances"]["decode"]
        usable = all(i["usable"] for i in instances)
        idle = all(running(e) == 0 for e in s.engines)
        return usable and idle and not status["store"]["circuit_open"]

    wait_until(settled, "the stack did not settle", timeout=60)


@pytest.fixture
def main(stack: Stack) -> Iterator[Stack]:
    """The shared stack, settled before and after the test."""
    settle(stack)
    yield stack
    settle(stack)


@dataclass
class Slow:
    p: SimProc
    d: SimProc
    ref: SimProc
    redis_url: str


@pytest.fixture(scope="package")
def slow(redis_url_session: str) -> Iterator[Slow]:
    """P and a D that decodes one token per SLOW_TOKEN_MS (long streams, idle gaps)."""
    slow_d = (*SLOW_D_FLAGS, "--decode-ms-per-token", str(SLOW_TOKEN_MS))
    with started(lambda: sims(SLOW_P_FLAGS, slow_d, ("decode",), name="rel-slow")) as (p, d, ref):
        yield Slow(p, d, ref, redis_url_session)
