"""Reliability fixtures: one P/D stack shared by the package (2 P, 2 D, a reference instance,
a private redis-server the tests stop and restart, the router as a Hypercorn process), and a
slow stack whose decode emits one token every half second."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.e2e.harness import RouterProc
from tests.procs import SimProc, redis_server, restart_redis, sim, sims, stop, wait_until
from tests.reliability.helpers import (
    clear_faults,
    get_json,
    retried,
    router,
    running,
    started,
)

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
ROUTER_FLAGS = (
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


@dataclass
class Stack:
    """The shared stack. `restart` swaps a simulator for a new process on the same ports."""

    ps: list[SimProc]
    ds: list[SimProc]
    ref: SimProc
    router: RouterProc
    redis_port: int
    redis_proc: subprocess.Popen[bytes]
    exits: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def url(self) -> str:
        return self.router.url

    @property
    def log(self) -> Path:
        return self.router.log

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"

    @property
    def engines(self) -> list[SimProc]:
        return [*self.ps, *self.ds]

    def restart(
        self, role: str, index: int, *extra: str, down: Callable[[], None] = lambda: None
    ) -> SimProc:
        """Stop a P or D and start a new one on the same HTTP and side-channel ports (`down`
        runs in between)."""
        group = self.ps if role == "prefill" else self.ds
        old = group[index]
        stop(old.proc)
        down()
        flags = P_FLAGS[1:] if role == "prefill" else D_FLAGS[1:]
        ports = ("--port", str(old.port), "--kv-port", str(old.kv_port))
        new = retried(lambda: sim(role, *flags, *ports, *extra, name=f"rel-{role}"), self.exits)
        group[index] = new
        return new

    def stop_redis(self) -> None:
        stop(self.redis_proc)

    def start_redis(self) -> None:
        if self.redis_proc.poll() is None:
            return
        self.redis_proc = restart_redis(self.redis_port)


@pytest.fixture(scope="package")
def stack() -> Iterator[Stack]:
    with contextlib.ExitStack() as exits:
        _url, redis_port, redis_proc = exits.enter_context(redis_server())
        engines = (P_FLAGS, P_FLAGS, D_FLAGS, D_FLAGS, ("decode",))
        p1, p2, d1, d2, ref = retried(lambda: sims(*engines, name="rel"), exits)
        url = f"redis://127.0.0.1:{redis_port}/0"
        name = "rel-router"
        r = exits.enter_context(
            router([p1.url, p2.url], [d1.url, d2.url], *ROUTER_FLAGS, redis_url=url, name=name)
        )
        s = Stack([p1, p2], [d1, d2], ref, r, redis_port, redis_proc)
        with s.exits:
            try:
                yield s
            finally:
                stop(s.redis_proc)


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
