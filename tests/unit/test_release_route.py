"""Which engine a release goes through: one that can talk to the holder of the blocks (its
connector group, model and block size), or none yet: then the job waits, never elsewhere."""

from __future__ import annotations

from typing import Any

import pytest

from router.engines.pool import Pool, Role
from router.engines.release import Job, Releaser
from router.engines.versions import EngineVersion
from tests.unit.fake_engines import FakeEngines
from tests.unit.handles import HANDLE

P32, P33, D32, D33 = "http://p32", "http://p33", "http://d32", "http://d33"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def fleet(**engines: tuple[str, str, int]) -> Pool:
    """P's and D's by URL (p... / d...): (vLLM version, model, block size); "" / 0 unknown."""
    pool = Pool(
        tuple(u for u in engines if "//p" in u),
        tuple(u for u in engines if "//d" in u),
    )
    for inst in pool.instances():
        version, inst.model, inst.block_size = engines[inst.url]
        inst.ident.version = EngineVersion(version)
    return pool


def releaser(
    pool: Pool, engines: FakeEngines, clock: Clock, **kw: Any
) -> tuple[Releaser, list[tuple[str, str]]]:
    counted: list[tuple[str, str]] = []
    return Releaser(
        pool,
        engines,
        lambda handle, model: ({"model": model, "prompt": [0]}, "/v1/completions"),
        lambda: "served",
        lambda reason, outcome: counted.append((reason, outcome)),
        prefilled_request=lambda params, model: (
            {"model": model, "prompt": [0]},
            "/v1/completions",
        ),
        clock=clock,
        keep_for=60.0,
        **kw,
    ), counted


MIXED = {
    P32: ("0.32.0", "m", 16),
    P33: ("0.33.0", "m", 16),
    D32: ("0.32.0", "m", 16),
    D33: ("0.33.0", "m", 16),
}


@pytest.mark.parametrize(
    ("engines", "holder", "via", "readers"),
    [
        # A D's handle goes to a P of its connector group, every time (least loaded within it).
        (MIXED, D33, "prefill", {P33}),
        (MIXED, D32, "prefill", {P32}),
        # P's params no D will read go to a D of P's group.
        (MIXED, P33, "decode", {D33}),
        (MIXED, P32, "decode", {D32}),
        # Versions not read yet pair with any engine (as for turns).
        ({P32: ("0.32.0", "m", 16), P33: ("", "m", 16), D33: ("", "m", 16)}, D33, "prefill",
         {P32, P33}),
        # Another model, or another block size, where both are known: not that P.
        ({P32: ("0.33.0", "other", 16), P33: ("0.33.0", "m", 16), D33: ("0.33.0", "m", 16)},
         D33, "prefill", {P33}),
        ({P32: ("0.33.0", "m", 32), P33: ("0.33.0", "m", 16), D33: ("0.33.0", "m", 16)},
         D33, "prefill", {P33}),
        ({P32: ("0.33.0", "", 0), P33: ("0.33.0", "m", 16), D33: ("0.33.0", "m", 16)},
         D33, "prefill", {P32, P33}),
    ],
)  # fmt: skip
async def test_a_release_goes_only_through_a_reader_that_pairs_with_its_holder(
    engines: dict[str, tuple[str, str, int]], holder: str, via: Role, readers: set[str]
) -> None:
    fake = FakeEngines()
    rel, counted = releaser(fleet(**engines), fake, Clock())
    for _ in range(8):
        assert await rel.release(Job(HANDLE, holder, "ended", via=via)) == "released"
    assert {c.url.removesuffix("/v1/completions") for c in fake.calls} == readers
    assert not rel.waiting and counted == []


async def test_the_release_names_the_holder_s_model() -> None:
    fake = FakeEngines()
    pool = fleet(**{P33: ("0.33.0", "", 0), D33: ("0.33.0", "d-model", 16)})
    rel, _ = releaser(pool, fake, Clock())
    assert await rel.release(Job(HANDLE, D33, "idle")) == "released"
    assert fake.calls[0].body["model"] == "d-model"


async def test_with_no_reader_of_its_group_a_release_waits_then_goes_when_one_comes() -> None:
    fake, clock = FakeEngines(), Clock()
    pool = fleet(**MIXED)
    p33 = pool.find("prefill", P33)
    assert p33 is not None
    p33.healthy = False  # the only 0.33 P is down: the 0.32 P must not get D33's handle
    rel, counted = releaser(pool, fake, clock)
    rel.submit(HANDLE, D33, "ended")
    job = rel.queue.get_nowait()
    assert await rel.release(job) == "waiting"
    assert fake.calls == [] and len(rel.waiting) == 1 and rel.view()["waiting"] == 1
    clock.now += 30
    rel.retry()  # back in the queue, still no reader: waits on, with its first deadline
    again = rel.queue.get_nowait()
    assert again.until == 1060.0 and await rel.release(again) == "waiting"
    p33.healthy = True
    rel.retry()
    assert await rel.release(rel.queue.get_nowait()) == "released"
    assert [c.url for c in fake.calls] == [P33 + "/v1/completions"] and counted == []


async def test_a_waiting_release_gives_up_after_keep_for_and_one_whose_d_left_is_dropped() -> None:
    fake, clock = FakeEngines(), Clock()
    pool = fleet(**{P32: ("0.32.0", "m", 16), D33: ("0.33.0", "m", 16), D32: ("0.32.0", "m", 16)})
    rel, _ = releaser(pool, fake, clock)
    assert await rel.release(Job(HANDLE, D33, "idle")) == "waiting"
    clock.now += 60
    rel.retry()
    assert await rel.release(rel.queue.get_nowait()) == "dropped"  # no 0.33 P for 60 s
    d32 = pool.find("decode", D32)
    assert d32 is not None
    pool.remove(d32)
    assert await rel.release(Job(HANDLE, D32, "idle")) == "dropped"  # D left the pool
    assert fake.calls == [] and not rel.waiting


async def test_a_worker_counts_a_job_only_when_it_is_done() -> None:
    fake, clock = FakeEngines(), Clock()
    pool = fleet(**{P32: ("0.32.0", "m", 16), D33: ("0.33.0", "m", 16)})
    rel, counted = releaser(pool, fake, clock)
    rel.start()
    try:
        rel.submit(HANDLE, D33, "ended")
        await rel.drain()
        assert counted == [] and len(rel.waiting) == 1 and rel.view()["failed"] == 0
        clock.now += 61
        rel.retry()
        await rel.drain()
        assert counted == [("ended", "dropped")] and not rel.waiting
    finally:
        await rel.stop()
