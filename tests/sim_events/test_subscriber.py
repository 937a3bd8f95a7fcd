"""The router's KV-events subscriber against the simulator's real publisher (ZMQ PUB and
replay ROUTER on loopback): catch-up, gaps, restarts; the index follows."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

import pytest
import zmq.asyncio

from router.engines.kv_events import Source, Subscriber
from router.engines.kv_index import EngineIndex, held_tokens
from vllm_sim.events import AllBlocksCleared, BlockStored, KVEventPublisher

BS = 4
TOKENS = list(range(100, 140))


def block(i: int, tokens: list[int] = TOKENS) -> BlockStored:
    """The i-th block of `tokens` as one BlockStored (engine hash i+1, chained to i)."""
    return BlockStored([i + 1], i or None, tokens[i * BS : (i + 1) * BS], BS)


async def until(check: Callable[[], bool], what: str, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(sub: Subscriber) -> AsyncIterator[Subscriber]:
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


def publisher(port: int = 0, replay: int = 0) -> KVEventPublisher:
    pub = KVEventPublisher(port, replay, topic="kv-events")
    pub.start()
    return pub


def subscriber(pub: KVEventPublisher, ctx: zmq.asyncio.Context) -> Subscriber:
    src = Source(
        "http://p",
        f"tcp://127.0.0.1:{pub.port}",
        f"tcp://127.0.0.1:{pub.replay_port}",
        "kv-events",
    )
    return Subscriber(src, EngineIndex(), ctx, replay_timeout=1.0)


async def test_catch_up_from_the_replay_buffer_then_live(ctx: zmq.asyncio.Context) -> None:
    pub = publisher()
    try:
        pub.publish([block(0)])
        pub.publish([block(1)])
        sub = subscriber(pub, ctx)
        async with running(sub):
            await until(lambda: held_tokens(sub.index, TOKENS) == 2 * BS, "the replayed blocks")
            assert sub.counts.replays == 2
            pub.publish([block(2)])
            await until(lambda: held_tokens(sub.index, TOKENS) == 3 * BS, "a live block")
            pub.publish([AllBlocksCleared()])
            await until(lambda: sub.index.blocks == 0, "the clear")
            assert sub.counts.last_seq == 3 and sub.counts.gaps == 0
    finally:
        pub.close()


async def test_a_dropped_socket_is_replayed_on_reconnect(ctx: zmq.asyncio.Context) -> None:
    pub = publisher()
    try:
        sub = subscriber(pub, ctx)
        async with running(sub):
            await asyncio.sleep(0.3)  # connected (a PUB drops what no SUB is there for)
            pub.publish([block(0)])
            await until(lambda: sub.index.blocks == 1, "the first block")
        pub.publish([block(1)])  # while our socket is gone
        pub.publish([block(2)])
        async with running(sub):
            await until(lambda: held_tokens(sub.index, TOKENS) == 3 * BS, "the missed blocks")
        assert sub.counts.replays == 2 and sub.counts.rebuilds == 0
    finally:
        pub.close()


async def test_a_sequence_gap_is_replayed(ctx: zmq.asyncio.Context) -> None:
    """Batches 1-2 never reached the SUB socket: batch 3's seq shows the gap, replay fills it."""
    pub = publisher()
    try:
        sub = subscriber(pub, ctx)
        for i in range(4):
            pub.publish([block(i)])
        await asyncio.sleep(0.2)
        payloads = {seq: p for seq, p in await sub._replay(0) or []}
        frames = [b"kv-events", (0).to_bytes(8, "big"), payloads[0]]
        await sub._on_message(frames)
        await sub._on_message([b"kv-events", (3).to_bytes(8, "big"), payloads[3]])
        assert sub.counts.gaps == 1 and sub.counts.replays == 3  # 1..3; the live 3 skipped
        assert sub.counts.batches == 4
        assert held_tokens(sub.index, TOKENS) == 4 * BS
    finally:
        pub.close()


async def test_a_gap_the_buffer_cannot_fill_rebuilds_the_index(ctx: zmq.asyncio.Context) -> None:
    pub = KVEventPublisher(0, 0, topic="kv-events", buffer_steps=1)
    pub.start()
    try:
        sub = subscriber(pub, ctx)
        pub.publish([block(0)])
        await asyncio.sleep(0.2)
        first = (await sub._replay(0) or [])[0][1]
        await sub._on_message([b"kv-events", (0).to_bytes(8, "big"), first])
        assert sub.index.blocks == 1
        for i in range(1, 4):
            pub.publish([block(i)])
        await asyncio.sleep(0.2)
        last = (await sub._replay(3) or [])[0][1]
        await sub._on_message([b"kv-events", (3).to_bytes(8, "big"), last])
        assert sub.counts.rebuilds == 1
        assert sub.index.blocks == 0  # block 3's parent was lost with the gap
        assert sub.counts.last_seq == 3
    finally:
        pub.close()


async def test_the_index_follows_a_restarted_publisher(ctx: zmq.asyncio.Context) -> None:
    pub = publisher()
    port, replay = pub.port, pub.replay_port
    assert port is not None and replay is not None
    sub = subscriber(pub, ctx)
    async with running(sub):
        try:
            await asyncio.sleep(0.3)
            for i in range(3):
                pub.publish([block(i)])
            await until(lambda: sub.index.blocks == 3, "the first engine's blocks")
        finally:
            pub.close()
        await until(lambda: sub.index.stale, "the disconnect")
        assert held_tokens(sub.index, TOKENS) == 0  # claims nothing while it may be restarting
        other = [7, 7, 7, 7, 8, 8, 8, 8]
        pub = publisher(port, replay)  # seq starts at 0 again
        try:

            def follows() -> bool:
                pub.publish([block(0, other)])
                return held_tokens(sub.index, other) == BS

            await until(follows, "the restarted engine's block")
            assert held_tokens(sub.index, TOKENS) == 0  # the old blocks are gone
            assert sub.counts.rebuilds >= 1 and not sub.index.stale
        finally:
            pub.close()
