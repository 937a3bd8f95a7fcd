"""The engine in this process with a fake clock: leases, TTLs, thresholds, queueing, costs."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import aiohttp

from harness.chat import NULL_HANDOFF
from tests.sim.client import chat, words
from tests.sim.conftest import FakeTime, running
from vllm_sim.blocks import CacheEvent, Removed, Stored
from vllm_sim.config import SimSettings
from vllm_sim.engine import Engine
from vllm_sim.request import GenRequest, RunResult
from vllm_sim.template import render

MSGS = [{"role": "user", "content": words(500, 60)}]


async def run(engine: Engine, prompt: list[int], n: int, **kw: Any) -> RunResult:
    res = RunResult()
    req = GenRequest(request_id=f"req-{time.monotonic_ns()}", prompt=prompt, max_tokens=n, **kw)
    async with contextlib.aclosing(engine.generate(req, res)) as steps:
        async for _ in steps:
            pass
    return res


def engine(**kw: Any) -> Engine:
    kw.setdefault("engine_id", "unit")
    return Engine(SimSettings(**kw), kv_port=0)


async def test_p_lease_expires_on_the_fake_clock() -> None:
    t = FakeTime()
    async with running(t, kv_lease_duration=30.0) as p:
        status, body = await chat(p.url, MSGS, max_tokens=1, kv_transfer_params=NULL_HANDOFF)
        assert status == 200
        e = p.sim.engine
        assert len(e.pins) == 1 and e.pins.snapshot()[0]["expiry"] == t.t + 30.0
        t.t += 29.9
        assert e.sweep() == 0
        t.t += 0.2
        assert e.sweep() == 1 and len(e.pins) == 0
        assert e.counters.nixl_kv_expired_reqs == 1
        assert e.counters.sim_blocks_expired == len(
            body["kv_transfer_params"]["remote_block_ids"][0]
        )


async def test_short_d_to_p_read_is_skipped_but_frees_d() -> None:
    async with (
        running(bidirectional=True, kv_recompute_threshold=64) as p,
        running(bidirectional=True) as d,
        running() as ref,
    ):
        _, pb = await chat(p.url, MSGS, max_tokens=1, kv_transfer_params=NULL_HANDOFF)
        _, db = await chat(d.url, MSGS, max_tokens=10, kv_transfer_params=pb["kv_transfer_params"])
        assert len(d.sim.engine.pins) == 1
        content = db["choices"][0]["message"]["content"]
        msgs2 = [
            *MSGS,
            {"role": "assistant", "content": content},
            {"role": "user", "content": "the"},
        ]
        handle = {**db["kv_transfer_params"], "do_remote_decode": True, "do_remote_prefill": False}
        status, p2 = await chat(p.url, msgs2, max_tokens=5, kv_transfer_params=handle)
        assert status == 200
        assert p.sim.engine.counters.by_source["external_kv_transfer"] == 0  # under threshold
        # ... but D is told to free its blocks, beside the request (as vLLM's worker does)
        for _ in range(200):
            if not d.sim.engine.pins:
                break
            await asyncio.sleep(0.01)
        assert len(d.sim.engine.pins) == 0
        _, r2 = await chat(ref.url, msgs2, max_tokens=5)
        assert p2["choices"][0]["message"]["content"] == r2["choices"][0]["message"]["content"]


async def test_replayed_p_params_read_freed_blocks() -> None:
    async with running() as p, running() as d:
        _, pb = await chat(p.url, MSGS, max_tokens=1, kv_transfer_params=NULL_HANDOFF)
        params = pb["kv_transfer_params"]
        _, first = await chat(d.url, MSGS, max_tokens=5, kv_transfer_params=params)
        # P freed the blocks after the first read; a replay still reads them (vLLM: HTTP 200).
        async with running() as d2:
            status, again = await chat(d2.url, MSGS, max_tokens=5, kv_transfer_params=params)
        assert status == 200 and again["choices"] == first["choices"]
        assert p.sim.engine.counters.sim_notify_unknown == 1


async def test_max_num_seqs_queues_fifo() -> None:
    e = engine(max_num_seqs=1, decode_ms_per_token=20.0)
    prompt = render(e.tok, MSGS)
    first = asyncio.create_task(run(e, prompt, 5))
    await asyncio.sleep(0.01)
    second = asyncio.create_task(run(e, prompt, 5))
    await asyncio.sleep(0.01)
    assert (e.gauges().running, e.gauges().waiting) == (1, 1)
    t0 = time.monotonic()
    a, b = await asyncio.gather(first, second)
    assert time.monotonic() - t0 >= 0.1  # the second ran only after the first
    assert a.output_ids == b.output_ids
    assert (e.running, e.waiting) == (0, 0)


async def test_cost_model_charges_computed_tokens_not_hits() -> None:
    e = engine(prefill_ms_per_token=2.0)
    prompt = render(e.tok, MSGS)  # 64 tokens
    t0 = time.monotonic()
    await run(e, prompt, 1)
    cold = time.monotonic() - t0
    t0 = time.monotonic()
    hit = await run(e, prompt, 1)
    warm = time.monotonic() - t0
    assert hit.cached_tokens == 48
    assert cold >= len(prompt) * 0.002 and warm < cold


async def test_admission_waits_for_pinned_blocks() -> None:
    t = FakeTime()
    e = Engine(
        SimSettings(engine_id="u", num_blocks=10, max_model_len=80, kv_lease_duration=30.0),
        kv_port=0,
        clock=t,
    )
    a = [0, *e.tok.encode(words(1, 69))]
    b = [0, *e.tok.encode(words(2, 69))]
    await run(e, a, 1, kv_params={"do_remote_decode": True})
    assert e.pins.num_blocks == 5 and e.pool.num_free == 4
    waiting = asyncio.create_task(run(e, b, 10))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    t.t += 31
    e.sweep()
    res = await asyncio.wait_for(waiting, 1)
    assert len(res.output_ids) == 10


async def test_events_for_stored_and_evicted_blocks() -> None:
    seen: list[CacheEvent] = []
    e = Engine(
        SimSettings(engine_id="u", num_blocks=10, max_model_len=80),
        kv_port=0,
        on_events=seen.extend,
    )
    a = [0, *e.tok.encode(words(1, 69))]
    await run(e, a, 1)
    stored = [x for x in seen if isinstance(x, Stored)]
    assert len(stored) == 1 and len(stored[0].block_hashes) == 4
    assert stored[0].parent_block_hash is None and stored[0].token_ids == a[:64]
    seen.clear()
    for seed in range(3, 6):
        await run(e, [0, *e.tok.encode(words(seed, 69))], 1)
    assert any(isinstance(x, Removed) for x in seen)
    e.reset_prefix_cache()
    assert e.pool.num_cached == 0


async def test_client_disconnect_mid_stream_frees_the_request() -> None:
    async with running(decode_ms_per_token=10.0) as s:
        body = {"messages": MSGS, "max_tokens": 50, "stream": True}
        async with (
            aiohttp.ClientSession() as session,
            session.post(s.url + "/v1/chat/completions", json=body) as resp,
        ):
            await resp.content.readuntil(b"\n\n")
            await resp.content.readuntil(b"\n\n")
        e = s.sim.engine
        for _ in range(100):
            if e.running == 0:
                break
            await asyncio.sleep(0.01)
        assert e.running == 0 and e.pool.usage == 0.0
        assert e.counters.generation_tokens < 50
