"""The simulator's step loop (vllm_sim/steps.py): decodes batched in one step, a prefill
slowing the decodes it shares a step with, and no waiting at all at zero cost."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time

from tests.sim.client import words
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


def test_a_step_is_one_forward_whatever_it_carries() -> None:
    """A prompt that finishes beside running decodes rides their forward (vLLM batches them
    into one), so the fixed cost is paid once; alone, its forward still costs it."""
    loop = StepLoop(prefill_ms_per_token=0.5, decode_ms_per_token=10.0)
    assert loop.step_s(4, 3, forward_ms=10.0) == 0.012
    assert loop.step_s(4, 0, forward_ms=10.0) == 0.012
    assert loop.step_s(4, 3, forward_ms=15.0) == 0.017  # the larger fixed cost


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
