"""Releasing D's pinned handles, through the fake engines: what a turn releases when it ends,
the read-nothing request's shape, the release delay, the queue, D's pressure flag."""

from __future__ import annotations

import asyncio

import pytest

from router.connectors.nixl.params import release_body
from router.engines.metrics_text import kv_usage
from router.engines.pool import Instance, Pool
from router.engines.release import Gaps, Job, Releaser
from router.lifecycle import pin_sweep
from router.turn.decide import sendable
from router.turn.outcomes import Reason
from tests.unit.fake_engines import FakeEngines
from tests.unit.handles import HANDLE
from tests.unit.turns import (
    conversation,
    counted,
    crowd_prefill,
    releases,
    releasing,
    second_turn,
    services,
    state_of,
    turn,
)


def test_the_read_nothing_request_carries_the_handle_and_asks_for_no_tokens() -> None:
    body = release_body(HANDLE, "m")
    assert body is not None
    assert (body["model"], body["prompt"], body["max_tokens"], body["stream"]) == (
        "m",
        [0],
        1,
        False,
    )
    kv = body["kv_transfer_params"]
    assert kv["remote_num_tokens"] == 0 and kv["do_remote_decode"] is True
    assert kv["do_remote_prefill"] is False
    for field in ("remote_request_id", "remote_engine_id", "remote_block_ids", "remote_port"):
        assert kv[field] == HANDLE[field], field
    assert HANDLE["remote_num_tokens"] == 10, "the stored handle is not changed"
    assert release_body({"remote_block_ids": None}, "m") is None


async def test_a_decode_plan_turn_releases_the_handle_it_took() -> None:
    engines = FakeEngines()
    svc = releasing(engines, decode_local_max_inflight=1)
    await conversation(svc, 1)
    first = await state_of(svc)
    assert first.kv_transfer_params is not None
    crowd_prefill(svc)
    _, headers, _ = await turn(svc, second_turn("and then?"), request_id="r1")
    assert headers["x-kv-reuse"] == "hit;via=decode"
    assert svc.releaser is not None
    await svc.releaser.drain()
    (sent,) = releases(engines)
    assert sent["remote_request_id"] == first.kv_transfer_params["remote_request_id"]
    assert counted(svc, "superseded") == 1
    await svc.releaser.stop()


async def test_a_turn_that_fails_before_any_p_gets_its_handle_releases_it() -> None:
    engines = FakeEngines()
    svc = releasing(engines, decode_local_max_inflight=1)
    await conversation(svc, 1)
    first = await state_of(svc)
    crowd_prefill(svc)  # the decode plan: D alone, and D refuses the request
    engines.scripts[first.decode] = lambda call: 400 if "/v1/" in call.url else None
    status, _, _ = await turn(svc, second_turn("and then?"), request_id="r1")
    assert status == 400
    assert svc.releaser is not None
    await svc.releaser.drain()
    assert len(releases(engines)) == 1 and counted(svc, "aborted") == 1
    await svc.releaser.stop()


async def test_a_turn_that_reads_the_handle_releases_nothing() -> None:
    engines = FakeEngines()
    svc = releasing(engines)
    results = await conversation(svc, 3)
    assert [h["x-kv-reuse"] for _, h, _ in results][1:] == ["hit", "hit"]
    assert svc.releaser is not None
    await svc.releaser.drain()
    assert releases(engines) == [] and svc.releaser.released == 0
    await svc.releaser.stop()


async def test_with_release_off_nothing_is_released() -> None:
    engines = FakeEngines()
    svc = services(engines, decode_local_max_inflight=1, release_pins=False)
    assert pin_sweep.releaser(svc) is None
    await conversation(svc, 1)
    crowd_prefill(svc)
    await turn(svc, second_turn("and then?"), request_id="r1")
    assert releases(engines) == []


@pytest.mark.parametrize(
    ("reason", "releasable"),
    [
        (None, True),
        (Reason.PREFIX_MISMATCH, True),
        (Reason.EXPIRED, True),
        (Reason.HANDLE_UNAUTHENTICATED, False),  # could aim P at any address
        (Reason.HANDLE_INVALID, False),
        (Reason.DECODE_RESTARTED, False),  # D no longer holds it
        (Reason.DECODE_REMOVED, False),
        (Reason.READS_PAUSED, False),  # P's have been refusing that D
    ],
)
def test_which_taken_handles_may_be_released(reason: Reason | None, releasable: bool) -> None:
    assert sendable.releasable(reason) is releasable


@pytest.mark.parametrize(
    ("release_after", "handle_ttl", "delay"),
    [
        (0.0, 450.0, 450.0),  # the default: kept until the handle TTL, whatever the gaps
        (7.0, 450.0, 7.0),  # a fixed delay, as an operator set it
        (900.0, 450.0, 450.0),  # never past --handle-ttl: no turn reads the handle then
    ],
)
def test_the_release_delay_is_the_handle_ttl_unless_fixed(
    release_after: float, handle_ttl: float, delay: float
) -> None:
    svc = services(FakeEngines(), release_after=release_after, handle_ttl=handle_ttl)
    for _ in range(50):  # quick scripted turns: the measured gaps do not shorten it
        svc.gaps.note(0.5)
    assert pin_sweep.release_delay(svc) == delay


def test_the_measured_gaps_p95_needs_twenty_samples() -> None:
    gaps = Gaps()
    for seconds in range(1, 20):
        gaps.note(float(seconds))
    assert gaps.p95() is None
    for seconds in range(20, 101):
        gaps.note(float(seconds))
    gaps.note(-1.0)  # a clock step back is not a gap
    assert gaps.p95() == 95.0


async def test_a_full_queue_drops_its_oldest_and_no_p_waits() -> None:
    counted: list[tuple[str, str]] = []
    pool = Pool((), ("http://d1",))
    releaser = Releaser(
        pool,
        FakeEngines(),
        lambda handle, model: ({}, "/v1/completions"),
        lambda: "m",
        lambda reason, outcome: counted.append((reason, outcome)),
        queue=asyncio.Queue(2),
    )
    for reason in ("a", "b", "c"):
        releaser.submit(HANDLE, "http://d1", reason)
    assert counted == [("a", "dropped")]
    # No P at all: the job waits for one (tests/unit/test_release_route.py).
    assert await releaser.release(Job(HANDLE, "http://d1", "b")) == "waiting"


def test_a_d_over_the_high_water_mark_is_avoided_until_under_the_low_one() -> None:
    pool = Pool(("http://p",), ("http://d1", "http://d2"), high_water=0.8, low_water=0.5)
    d1 = pool.find("decode", "http://d1")
    assert isinstance(d1, Instance)
    d1.note_kv_usage(0.85)
    assert d1.pressured
    assert {pool.pick("decode", prefer="http://d1").url for _ in range(4)} == {"http://d2"}
    d1.note_kv_usage(0.6)  # still pressured: hysteresis
    assert d1.pressured
    d1.note_kv_usage(0.4)
    assert not d1.pressured and pool.pick("decode", prefer="http://d1").url == "http://d1"
    d2 = pool.find("decode", "http://d2")
    assert d2 is not None
    d1.note_kv_usage(0.9)
    d2.note_kv_usage(0.95)
    assert pool.pick("decode").url in ("http://d1", "http://d2"), "all pressured: any"
    d1.note_kv_usage(None)  # no reading: unchanged
    assert d1.kv_usage == 0.9


@pytest.mark.parametrize(
    ("text", "usage"),
    [
        (b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.42\n', 0.42),
        (
            b'vllm:kv_cache_usage_perc{engine="0"} 0.2\nvllm:kv_cache_usage_perc{engine="1"} 0.7\n',
            0.7,
        ),
        (b"vllm:kv_cache_usage_perc 0.5\n", 0.5),
        (b'vllm:kv_cache_usage_perc{engine="0"} NaNx\n', None),
        (b"vllm:num_requests_running 3\n", None),
    ],
)
def test_d_s_kv_usage_is_the_fullest_rank_s(text: bytes, usage: float | None) -> None:
    assert kv_usage(text) == usage


@pytest.mark.parametrize(
    ("count", "usage", "batch"),
    [
        (100, 0.95, 22),  # the pinned share above the 0.75 low-water mark: 100 * 0.2 / 0.95
        (100, 1.0, 25),
        (0, 0.95, 1),  # nothing counted yet: one at a time
        (5000, 1.0, 256),  # capped per tick
        (10, -1.0, 1),  # usage unknown
    ],
)
def test_a_pressured_d_releases_its_pinned_share_above_the_low_water_mark(
    count: int, usage: float, batch: int
) -> None:
    inst = Instance("http://d", "decode", kv_usage=usage, pins=count)
    assert pin_sweep.pressure_batch(inst) == batch
