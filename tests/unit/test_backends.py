"""Placement: affinity while healthy and not overloaded, else least loaded, round robin."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from router.config import Settings
from router.engines.client import Upstream
from router.engines.identity import (
    PAUSE_FIRST_S,
    PAUSE_MAX_S,
    REFUSALS_TO_PAUSE,
    EngineIdentity,
)
from router.engines.metrics_text import engine_requests, process_started
from router.engines.pool import AFFINITY_SLACK, Pool
from router.errors import Unavailable, UpstreamFailure
from router.lifecycle.health import check
from router.turn.decide.sendable import decode_blocker
from sessions import model as sm


def _placement_reason(pool: Pool, state: sm.SessionState) -> str:
    """Why the decision core keeps the state's handle from P ("" when it may be sent)."""
    return str(decode_blocker(pool.find("decode", state.decode), state) or "")


def pool() -> Pool:
    return Pool(("http://p1", "http://p2"), ("http://d1", "http://d2", "http://d3"), 2)


def test_round_robin_on_ties() -> None:
    p = pool()
    picked = [p.pick("decode").url for _ in range(6)]
    assert sorted(set(picked)) == ["http://d1", "http://d2", "http://d3"]
    assert picked[:3] != picked[0:1] * 3


def test_least_outstanding_wins() -> None:
    p = pool()
    d1, d2, _ = p.instances("decode")
    d1.outstanding, d2.outstanding = 3, 1
    assert p.pick("decode").url == "http://d3"


def test_affinity_kept_until_overloaded() -> None:
    p = pool()
    d1 = p.instances("decode")[0]
    d1.outstanding = AFFINITY_SLACK
    assert p.pick("decode", prefer="http://d1").url == "http://d1"
    d1.outstanding = AFFINITY_SLACK + 1
    assert p.pick("decode", prefer="http://d1").url != "http://d1"


def test_ejection_after_consecutive_failures_and_exclusion() -> None:
    p = pool()
    p1 = p.instances("prefill")[0]
    p.record_failure(p1, "boom")
    assert p1.healthy
    p.record_success(p1)
    p.record_failure(p1, "boom")
    assert p1.healthy
    p.record_failure(p1, "boom")
    assert not p1.healthy
    assert p.pick("prefill", prefer="http://p1").url == "http://p2"
    with pytest.raises(Unavailable, match="no healthy prefill"):
        p.pick("prefill", exclude=["http://p2"])


def test_busy_counts_and_always_releases() -> None:
    p = pool()
    d = p.instances("decode")[0]
    with pytest.raises(RuntimeError), p.busy(d):
        assert d.outstanding == 1
        raise RuntimeError
    assert d.outstanding == 0
    assert p.find("decode", "http://d9") is None


def test_process_start_time_is_read_from_prometheus_text() -> None:
    text = (
        b"# HELP process_start_time_seconds Start time of the process since unix epoch.\n"
        b"# TYPE process_start_time_seconds gauge\n"
        b"process_start_time_seconds 1.79601578555e+09\n"
        b'vllm:num_requests_running{engine="0"} 0.0\n'
    )
    assert process_started(text) == 1.79601578555e09
    assert process_started(b"vllm:num_requests_running 0.0\n") == 0.0
    assert process_started(b"process_start_time_seconds soon\n") == 0.0


def test_a_new_start_time_is_a_restart_and_forgets_the_engine_id() -> None:
    d1 = pool().instances("decode")[0]
    d1.ident.engine_id = "engine-a"
    d1.ident.note_started(100.0)  # first sight: not a restart
    d1.ident.note_started(100.0)
    assert (d1.ident.started, d1.ident.restarts, d1.ident.engine_id) == (100.0, 0, "engine-a")
    d1.ident.note_started(0.0)  # an engine without the metric: nothing learned
    assert (d1.ident.started, d1.ident.restarts) == (100.0, 0)
    d1.ident.note_started(250.5)
    assert (d1.ident.started, d1.ident.restarts, d1.ident.engine_id) == (250.5, 1, "")
    d1.ident.engine_id = "engine-b"
    d1.ident.note_started(180.0)  # an earlier start: another process behind the same port
    assert (d1.ident.started, d1.ident.restarts, d1.ident.engine_id) == (250.5, 1, "engine-b")


@contextlib.asynccontextmanager
async def engine(
    started: float, port: int = 0, seen: Callable[[], None] = lambda: None
) -> AsyncIterator[str]:
    """A real HTTP server answering /health and /metrics (with this process start time) as an
    engine does; yields its URL. `seen` runs when /metrics is read."""

    async def metrics(_: web.Request) -> web.Response:
        seen()
        return web.Response(body=f"process_start_time_seconds {started}\n".encode())

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    async with serving(app, port) as url:
        yield url


@contextlib.asynccontextmanager
async def serving(app: web.Application, port: int = 0) -> AsyncIterator[str]:
    """The app on 127.0.0.1:port (0: a free one); yields its URL."""
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    try:
        host, bound = runner.addresses[0][:2]
        yield f"http://{host}:{bound}"
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def upstream() -> AsyncIterator[Upstream]:
    """The router's engine client, opened."""
    client = Upstream(Settings(prefill=("http://p",), decode=("http://d",)))
    await client.open()
    try:
        yield client
    finally:
        await client.close()


async def test_a_decode_is_readmitted_only_after_its_new_start_time_is_read() -> None:
    """A D ejected while it restarted comes back with a new process: its start time is read
    before it is usable again, so no turn in between can send P a handle from the old one."""
    d1 = pool().instances("decode")[0]
    d1.ident.note_started(100.0)
    d1.ident.engine_id, d1.healthy = "e1", False
    usable_when_read: list[bool] = []
    async with (
        upstream() as client,
        engine(250.0, seen=lambda: usable_when_read.append(d1.usable)) as url,
    ):
        d1.url = url
        await check(client, d1, timeout=5.0)
    assert usable_when_read == [False]
    assert (d1.usable, d1.ident.started, d1.ident.restarts, d1.ident.engine_id) == (
        True,
        250.0,
        1,
        "",
    )


async def test_a_decode_whose_metrics_cannot_be_reached_has_its_handles_wait() -> None:
    """Restarted with an engine id fixed by config, a D is told apart from the old process by
    its start time only; while the health loop cannot connect, nothing says it did not restart."""
    p = Pool(("http://p1",), ("http://d1",))
    d1 = p.instances("decode")[0]
    async with upstream() as client:
        async with engine(100.0) as url:
            d1.url = url
            made = sm.SessionState(decode=url, decode_engine_id="fixed", decode_started=100.0)
            await check(client, d1, timeout=5.0)
            d1.ident.note_engine_id("fixed")
        assert (d1.ident.unreachable, _placement_reason(p, made), d1.ident.handle_started) == (
            False,
            "",
            100.0,
        )
        await check(client, d1, timeout=5.0)  # stopped: the connection is refused
        assert (d1.ident.unreachable, d1.healthy) == (True, True), "unreachable is not a failure"
        assert _placement_reason(p, made) == "decode-unreachable"
        # The turn placed there anyway made a handle (the new process's): no start time on it.
        assert d1.ident.handle_started == 0.0
        new = sm.SessionState(decode=d1.url, decode_engine_id="fixed", decode_started=0.0)
        async with engine(250.0, port=int(d1.url.rsplit(":", 1)[1])):
            await check(client, d1, timeout=5.0)
    assert (d1.ident.unreachable, d1.ident.started, d1.ident.restarts) == (False, 250.0, 1)
    assert (_placement_reason(p, made), _placement_reason(p, new)) == ("decode-restarted", "")


def test_a_prefill_that_keeps_refusing_a_decodes_handles_gets_none_for_a_while() -> None:
    d1 = pool().instances("decode")[0]
    p1, p2 = "http://p1", "http://p2"
    for _ in range(REFUSALS_TO_PAUSE - 1):
        d1.ident.note_refused(p1, 100.0)
    d1.ident.note_read(p1)  # a read in between: not in a row
    for _ in range(REFUSALS_TO_PAUSE - 1):
        d1.ident.note_refused(p1, 100.0)
    assert not d1.ident.reads_paused(p1, 100.0)
    d1.ident.note_refused(p1, 100.0)
    assert d1.ident.reads_paused(p1, 100.0) and d1.ident.reads_paused(p1, 100.0 + PAUSE_FIRST_S - 1)
    assert not d1.ident.reads_paused(p2, 100.0), "one pair: another P still gets them"
    at = 100.0 + PAUSE_FIRST_S
    assert not d1.ident.reads_paused(p1, at), "after the pause one handle is tried"
    d1.ident.note_refused(p1, at)  # refused again: twice as long, at once
    assert d1.ident.reads_paused(p1, at + 2 * PAUSE_FIRST_S - 1)
    assert not d1.ident.reads_paused(p1, at + 2 * PAUSE_FIRST_S)
    for _ in range(10):  # refusals while paused: handles in flight when the pause began
        d1.ident.note_refused(p1, at)
    assert d1.ident.refused_by[p1].pause_s == 2 * PAUSE_FIRST_S, (
        "doubles per pause, not per refusal"
    )
    for _ in range(10):  # each handle tried after a pause refused too
        at = d1.ident.refused_by[p1].until
        d1.ident.note_refused(p1, at)
    assert d1.ident.refused_by[p1].pause_s == PAUSE_MAX_S
    d1.ident.note_read(p1)
    assert not d1.ident.reads_paused(p1, at) and p1 not in d1.ident.refused_by
    for _ in range(REFUSALS_TO_PAUSE):
        d1.ident.note_refused(p2, at)
    d1.ident.note_started(100.0)
    d1.ident.note_started(200.0)  # D restarted: a new process may be readable again
    assert not d1.ident.reads_paused(p2, at)


def test_a_d_learned_to_stream_params_is_forgotten_when_it_restarts() -> None:
    by_start = EngineIdentity()
    by_start.note_started(100.0)
    by_start.note_streams_params()
    assert by_start.streams_params
    by_start.note_started(100.0)  # the same process
    assert by_start.streams_params
    by_start.note_started(200.0)  # a new process: maybe another vLLM
    assert not by_start.streams_params
    by_id = EngineIdentity()
    by_id.note_engine_id("e1")
    by_id.note_streams_params()
    by_id.note_engine_id("e2")  # a new engine id: restarted
    assert not by_id.streams_params


def test_engine_requests_sums_running_and_waiting_of_every_engine() -> None:

    text = (
        b"# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
        b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
        b'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
        b'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
        b'vllm:num_requests_waiting_by_reason{engine="0",reason="x"} 9.0\n'
        b"vllm:num_requests_running 1.0\n"
    )
    assert engine_requests(text) == 10
    assert engine_requests(b"process_start_time_seconds 1.0\n") == 0


@contextlib.asynccontextmanager
async def streaming_engine(gaps: list[float]) -> AsyncIterator[str]:
    """A real HTTP server whose /stream sends one chunk after each of `gaps` seconds."""

    async def stream(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, gap in enumerate(gaps):
            await asyncio.sleep(gap)
            await resp.write(f"data: {i}\n\n".encode())
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_post("/stream", stream)
    async with serving(app) as url:
        yield url


async def _read(url: str, idle: float, consumer_pause: float = 0.0) -> list[bytes]:
    async with upstream() as client:
        resp = await client.open_stream(url + "/stream", {}, request_id="r")
        got = []
        try:
            async for chunk in resp.chunks(idle):
                got.append(chunk)
                await asyncio.sleep(consumer_pause)
        finally:
            resp.close()
        return got


async def test_a_silent_stream_fails_after_the_idle_timeout() -> None:
    async with streaming_engine([0.0, 0.05, 1.5]) as url:
        started = time.monotonic()
        with pytest.raises(UpstreamFailure, match="timed out"):
            await _read(url, 0.4)
        assert 0.4 <= time.monotonic() - started < 2.0
    # The task that read is not left cancelled: it goes on to await normally.
    await asyncio.sleep(0.01)


async def test_only_the_wait_for_the_engine_counts_as_idle() -> None:
    """A chunk every 0.15 s never idles 0.4 s, however long the consumer takes per chunk
    (here 0.5 s: a slow client), and no timer outlives the stream."""
    async with streaming_engine([0.15] * 4) as url:
        got = await _read(url, 0.4, consumer_pause=0.5)
    assert b"".join(got) == b"".join(f"data: {i}\n\n".encode() for i in range(4))


async def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    async with streaming_engine([0.0, 1.5]) as url:
        task = asyncio.create_task(_read(url, 3.0))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
