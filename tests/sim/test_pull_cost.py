"""How the simulator prices a pull (issue 49), as vLLM's scheduler does: the request is parked
(WAITING_FOR_REMOTE_KVS) from the step that schedules it, through its read's modelled time,
until a later step reports the read done; the side channel's own exchange runs beside that
wait; a read P declines under kv_recompute_threshold waits for nothing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

import pytest
from aiohttp.test_utils import TestServer

from harness.chat import NULL_HANDOFF
from tests.sim.client import chat, words
from tests.sim.conftest import running
from vllm_sim import transfer
from vllm_sim.config import SimSettings
from vllm_sim.costs import CostModel
from vllm_sim.engine import Engine
from vllm_sim.kvchannel import KVChannelClient, side_channel_app
from vllm_sim.request import GenRequest
from vllm_sim.steps import StepLoop

MSGS = [{"role": "user", "content": words(700, 60)}]


def test_a_pull_costs_its_fixed_part_and_its_blocks() -> None:
    costs = CostModel(transfer_ms_per_block=0.05, transfer_ms_per_pull=0.5)
    assert costs.transfer_s(4) == pytest.approx(0.0007)
    assert costs.transfer_s(0) == 0.0, "reading nothing costs nothing"
    assert CostModel().transfer_s(4) == 0.0


async def test_on_an_idle_engine_a_pull_pays_one_empty_step() -> None:
    """The engine keeps stepping while a request waits for remote KV: an empty step reports
    the read, and the prefill is the step after it."""
    loop = StepLoop(prefill_ms_per_token=0.01, pull_step_ms=5.0)
    t0 = time.monotonic()
    await loop.parked(0.002)
    assert loop.steps == 1, "no step reported the pull"
    assert time.monotonic() - t0 >= 0.007 * 0.9  # the read, then the empty step
    await loop.prefill(10)
    assert loop.steps == 2


async def test_on_a_busy_engine_the_step_in_progress_reports_the_pull() -> None:
    """A pull arriving mid-step is scheduled when that step ends, reported by the next one
    (no empty step: pull_step_ms would be a whole second) and prefilled in the one after."""
    loop = StepLoop(prefill_ms_per_token=1.0, max_batched_tokens=50, pull_step_ms=1000.0)
    long = asyncio.create_task(loop.prefill(100))  # two steps of 50 tokens
    await asyncio.sleep(0)
    await asyncio.sleep(0)  # the loop's task has begun its first step
    assert loop._step is not None and loop.steps == 0
    await loop.parked(0.0)
    assert loop.steps == 1, "scheduled before the step in progress ended"
    await loop.prefill(1)
    assert loop.steps == 3, "the prefill did not join the step after the report"
    await long


def engine(**kw: float) -> Engine:
    return Engine(SimSettings(engine_id="pulls", **kw), kv_port=0)  # type: ignore[arg-type]


class Channel:
    """A side channel whose read answers only once the request is parked, and whose free
    notification is held until told."""

    def __init__(self, parked: asyncio.Event) -> None:
        self.parked = parked
        self.read_began = asyncio.Event()
        self.release = asyncio.Event()
        self.sent: list[str] = []

    async def read(self, *args: object) -> list[list[int]]:
        self.read_began.set()
        await self.parked.wait()
        return [[41] * 16, [42] * 16]

    async def notify(self, host: str, port: int, engine: str, request_id: str, gen: int) -> None:
        self.sent.append(request_id)
        await self.release.wait()


async def test_the_side_channel_read_runs_beside_the_modelled_wait() -> None:
    """The modelled wait and the real exchange overlap (sequential, each would wait for the
    other forever); the blocks read are the ones the request then holds."""
    e = engine()
    parked = asyncio.Event()
    channel = Channel(parked)
    e.kv.channel = channel  # type: ignore[assignment]
    blocks: list[int] = []

    async def wait(n: int) -> None:
        blocks.append(n)
        await channel.read_began.wait()
        parked.set()

    src = transfer.RemoteSource("d", "req-1", "127.0.0.1", 1, [7, 8], 32, None, None)
    ids = [0, *e.tok.encode(words(3, 40))]
    seq = await e._admit(GenRequest(request_id="p-1", prompt=ids, max_tokens=1))
    assert await asyncio.wait_for(e.kv.pull_or_notify(src, seq, 0, 32, wait), 2.0) == 32
    assert blocks == [2]
    assert e.pool.read(seq.block_ids[:2]) == [[41] * 16, [42] * 16]


async def test_a_declined_read_does_not_wait_for_its_notification() -> None:
    """P reads nothing (under kv_recompute_threshold): it tells D to free the blocks beside
    the request, as vLLM's worker does, not in front of its prefill."""
    e = engine()
    channel = Channel(asyncio.Event())
    e.kv.channel = channel  # type: ignore[assignment]

    async def never(n: int) -> None:
        raise AssertionError("a declined read is not parked")

    src = transfer.RemoteSource("d", "req-1", "127.0.0.1", 1, [1], 16, None, None)
    ids = [0, *e.tok.encode(words(3, 20))]
    seq = await e._admit(GenRequest(request_id="p-1", prompt=ids, max_tokens=1))
    assert await asyncio.wait_for(e.kv.pull_or_notify(src, seq, 0, 0, never), 1.0) == 0
    await asyncio.sleep(0)
    assert channel.sent == ["req-1"], "the notification was not sent"
    channel.release.set()
    await asyncio.sleep(0)


async def test_the_fixed_cost_and_the_report_step_show_in_ps_time() -> None:
    """Turn 2 on P with D's handle: P's answer takes at least the pull's fixed cost, its
    blocks and the empty step that reports them, and is the answer of the KV it read."""
    async with (
        running(
            bidirectional=True,
            kv_recompute_threshold=1,
            transfer_ms_per_pull=150.0,
            transfer_ms_per_block=1.0,
            pull_step_ms=50.0,
        ) as p,
        running(bidirectional=True) as d,
        running() as ref,
    ):
        _, pb = await chat(p.url, MSGS, max_tokens=1, kv_transfer_params=NULL_HANDOFF)
        _, db = await chat(d.url, MSGS, max_tokens=20, kv_transfer_params=pb["kv_transfer_params"])
        content = db["choices"][0]["message"]["content"]
        msgs2 = [
            *MSGS,
            {"role": "assistant", "content": content},
            {"role": "user", "content": "so"},
        ]
        handle = {**db["kv_transfer_params"], "do_remote_decode": True, "do_remote_prefill": False}
        t0 = time.monotonic()
        status, p2 = await chat(p.url, msgs2, max_tokens=5, kv_transfer_params=handle)
        took = time.monotonic() - t0
        assert status == 200
        pulled = p.sim.engine.counters.by_source["external_kv_transfer"]
        assert pulled > 0, "P did not pull"
        assert took >= (150.0 + -(-pulled // 16) * 1.0 + 50.0) / 1000.0 * 0.95, took
        _, r2 = await chat(ref.url, msgs2, max_tokens=5)
        assert p2["choices"][0]["message"]["content"] == r2["choices"][0]["message"]["content"]


async def test_a_declined_read_answers_while_d_holds_its_notification() -> None:
    """A D whose side channel accepts and never answers: a read P declines still answers at
    once, and the notification did go out to D."""
    connected, answer = asyncio.Event(), asyncio.Event()

    async def hold(_: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connected.set()
        await answer.wait()  # then hang up: P's notification fails (and is not retried)
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    handle = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": "held-d",
        "remote_request_id": "d-req",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_block_ids": [[1, 2]],
        "remote_num_tokens": 20,  # under the threshold: P reads nothing
    }
    try:
        async with running(
            bidirectional=True, kv_recompute_threshold=64, handshake_timeout=60.0
        ) as p:
            status, _ = await asyncio.wait_for(
                chat(p.url, MSGS, max_tokens=1, kv_transfer_params=handle), 10.0
            )
            assert status == 200
            assert p.sim.engine.counters.by_source["external_kv_transfer"] == 0
            await asyncio.wait_for(connected.wait(), 10.0)  # D was told, beside the request
            answer.set()  # the notification ends before P stops
            await asyncio.gather(*p.sim.engine.kv._abandoned, return_exceptions=True)
    finally:
        server.close()
        await server.wait_closed()


class Source:
    """A producer's side channel that counts its handshakes."""

    engine_id, block_size, agent, connector_version, registered = "d", 16, "agent-1", 15, True

    def __init__(self) -> None:
        self.handshakes = 0

    def now(self) -> float:
        self.handshakes += 1  # only the handshake reads the producer's clock
        return 5000.0

    def read_blocks(self, block_ids: Sequence[int]) -> list[list[int]] | None:
        return [[b] * 16 for b in block_ids]

    def release(self, request_id: str) -> bool:
        return True


async def test_a_deadline_is_converted_with_the_first_handshakes_clock() -> None:
    """vLLM measures D's clock offset once, at the handshake (vllm#47021): a read with a
    deadline makes no round trip of its own until a new registration calls for one."""
    source = Source()
    server = TestServer(side_channel_app(source), host="127.0.0.1")  # the OS picks the port
    await server.start_server()
    port = server.port
    assert port is not None
    client = KVChannelClient(5.0)
    await client.start()
    try:
        first = await client.clock("127.0.0.1", port, "d")
        again = await client.clock("127.0.0.1", port, "d")
        assert await client.read("127.0.0.1", port, "d", 16, [3], None) == [[3] * 16]
        assert source.handshakes == 1 and again == first
        await client.clock("127.0.0.1", port, "d", generation=2)  # D re-registered
        assert source.handshakes == 2
    finally:
        await client.close()
        await server.close()
