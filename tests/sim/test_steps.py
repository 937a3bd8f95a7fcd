"""The simulator's step loop (vllm_sim/steps.py): decodes batched in one step, a prefill
slowing the decodes it shares a step with, and no waiting at all at zero cost."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

from tests.sim.client import words
from vllm_sim import transfer
from vllm_sim.config import SimSettings
from vllm_sim.engine import Engine
from vllm_sim.request import GenRequest, RunResult
from vllm_sim.steps import StepLoop


def engine(**kw: float) -> Engine:
    return Engine(SimSettings(engine_id="steps", **kw), kv_port=0)  # type: ignore[arg-type]


def prompt(e: Engine, seed: int, n: int) -> list[int]:
    return [0, *e.tok.encode(words(seed, n))]


async def token_times(e: Engine, ids: list[int], n: int) -> list[float]:
    """When each output token of one request came out (monotonic seconds)."""
    req = GenRequest(request_id=f"r-{time.monotonic_ns()}", prompt=ids, max_tokens=n)
    times = []
    async with contextlib.aclosing(e.generate(req, RunResult())) as steps:
        async for _ in steps:
            times.append(time.monotonic())
    return times


def test_step_time_is_the_decodes_share_plus_the_prefill_tokens() -> None:
    loop = StepLoop(prefill_ms_per_token=0.5, decode_ms_per_token=10.0)
    assert loop.step_s(0, 3) == 0.010  # three decodes batched: one step
    assert loop.step_s(400, 3) == 0.210
    assert loop.step_s(400, 0) == 0.200


async def test_decodes_are_batched_not_serialised() -> None:
    e = engine(decode_ms_per_token=20.0)
    t0 = time.monotonic()
    await asyncio.gather(*(token_times(e, prompt(e, i, 20), 11) for i in range(4)))
    took = time.monotonic() - t0
    # 10 steps of 20 ms each for all four; one after the other it would be 0.8 s.
    assert 0.2 <= took < 0.6, took


async def test_a_prefill_on_the_engine_slows_the_decodes_batched_with_it() -> None:
    e = engine(decode_ms_per_token=10.0, prefill_ms_per_token=0.5)
    running = asyncio.create_task(token_times(e, prompt(e, 1, 8), 40))
    await asyncio.sleep(0.1)  # it is decoding
    long_prompt = prompt(e, 2, 600)
    await token_times(e, long_prompt, 1)
    times = await running
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # The step that computed the other request's prompt lasted its tokens' time too.
    assert max(gaps) >= 0.010 + (len(long_prompt) - 1) * 0.0005 * 0.9, max(gaps)
    assert sorted(gaps)[len(gaps) // 2] < 0.05, "the other steps are decode steps"


async def test_zero_cost_never_waits_on_the_loop() -> None:
    e = engine()
    await token_times(e, prompt(e, 3, 50), 20)
    assert e.steps.steps == 0


async def test_a_step_computes_at_most_its_token_budget_oldest_first() -> None:
    """vLLM's chunked prefill (max_num_batched_tokens), first come first served: 2,500 queued
    tokens over a 1,000-token budget take three steps, and a 10-token prompt queued behind
    them shares the third."""
    loop = StepLoop(prefill_ms_per_token=0.01, max_batched_tokens=1000)
    done: dict[str, int] = {}

    async def prefill(name: str, tokens: int) -> None:
        await loop.prefill(tokens)
        done[name] = loop.steps

    await asyncio.gather(prefill("long", 2500), prefill("short", 10))
    assert done == {"long": 3, "short": 3} and loop.steps == 3


async def test_a_finished_pull_waits_for_the_step_that_reports_it() -> None:
    """vLLM parks a pulling request in WAITING_FOR_REMOTE_KVS: the step in progress when its
    transfer finishes reports it, and only then can its prefill join a step (issue 49)."""
    loop = StepLoop(decode_ms_per_token=50.0)
    decoding = asyncio.create_task(loop.decode())  # a step of 50 ms is now in progress
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert loop.steps == 0
    await loop.transfer_reported()
    assert loop.steps == 1, "the pull went on before the step in progress ended"
    await decoding


async def test_on_an_idle_engine_the_report_is_one_empty_step() -> None:
    idle = StepLoop(pull_step_ms=30.0)
    reported = asyncio.create_task(idle.transfer_reported())
    await asyncio.sleep(0.005)
    assert not reported.done(), "no empty step was paid"
    await reported
    free = StepLoop()  # at zero cost nothing waits
    t0 = time.monotonic()
    await free.transfer_reported()
    assert time.monotonic() - t0 < 0.005


class HeldNotify:
    """A side channel whose free notification never completes until told."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.release = asyncio.Event()

    async def notify(self, host: str, port: int, engine: str, request_id: str, gen: int) -> None:
        self.sent.append(request_id)
        await self.release.wait()


async def test_a_declined_read_does_not_wait_for_its_notification() -> None:
    """P reads nothing (under kv_recompute_threshold): it tells D to free the blocks beside
    the request, as vLLM's worker does, not in front of its prefill (issue 49)."""
    e = engine()
    held = HeldNotify()
    e.kv.channel = held  # type: ignore[assignment]
    src = transfer.RemoteSource("d", "req-1", "127.0.0.1", 1, [1], 16, None, None)
    seq = await e._admit(GenRequest(request_id="p-1", prompt=prompt(e, 3, 20), max_tokens=1))
    assert await asyncio.wait_for(e.kv.pull_or_notify(src, seq, 0, 0), 1.0) == 0
    await asyncio.sleep(0)
    assert held.sent == ["req-1"], "the notification was not sent"
    held.release.set()
    await asyncio.sleep(0)
