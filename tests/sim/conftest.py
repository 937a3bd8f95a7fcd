"""Simulator fixtures: an instance as a process (module scope) and in this process (per test)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp.test_utils import TestServer

from harness.procs import SimProc, sim
from vllm_sim.clock import SimClock
from vllm_sim.config import SimSettings
from vllm_sim.server import Sim, build_app


@dataclass
class InProc:
    url: str
    sim: Sim


class FakeTime:
    """A manual clock for SimClock, so TTLs are tested without sleeping."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@contextlib.asynccontextmanager
async def running(time_source: FakeTime | None = None, **settings: Any) -> AsyncIterator[InProc]:
    """A Sim app on a free loopback port inside the test's event loop."""
    settings.setdefault("engine_id", f"inproc-{uuid.uuid4().hex[:8]}")
    s = SimSettings(**settings)
    sim_ = Sim(s, clock=SimClock(time_source) if time_source is not None else None)
    # No port given: the OS picks one as it binds, so no other test can take it in between.
    server = TestServer(build_app(sim_), host="127.0.0.1")
    await server.start_server()
    try:
        yield InProc(str(server.make_url("")).rstrip("/"), sim_)
    finally:
        await server.close()


@pytest.fixture(scope="module")
def proc_sim() -> Iterator[SimProc]:
    with sim("decode", "--max-model-len", "1024", name="http") as p:
        yield p


@pytest.fixture(params=["process", "inprocess"])
async def base(request: pytest.FixtureRequest) -> AsyncIterator[str]:
    """The URL of a default instance: a real process, then an in-process app (for coverage)."""
    if request.param == "process":
        yield request.getfixturevalue("proc_sim").url
        return
    async with running(max_model_len=1024) as inproc:
        yield inproc.url
