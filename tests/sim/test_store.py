"""The store connector in the simulator (`--kv-connector store --kv-store URL`): producers write
finished blocks by content hash into a real redis-server, consumers load them before computing.
Answers are compared with an instance that computes everything (the oracle)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import pytest
import redis.asyncio as aioredis

from harness.procs import free_port
from tests.sim.client import chat, metric, words
from tests.sim.conftest import InProc, running
from vllm_sim.kvstore import KEY_PREFIX, pack

BS = 16
MSGS = [{"role": "user", "content": words(1600, 90)}]  # ~93 prompt tokens: 5 full blocks


@contextlib.asynccontextmanager
async def pd(url_p: str, url_d: str, **d_extra: Any) -> AsyncIterator[tuple[InProc, InProc]]:
    async with (
        running(role="prefill", kv_connector="store", kv_store=url_p) as p,
        running(role="decode", kv_connector="store", kv_store=url_d, **d_extra) as d,
    ):
        yield p, d


def with_db(url: str, db: int) -> str:
    return urlsplit(url)._replace(path=f"/{db}").geturl()


async def answer(base: str, messages: list[dict[str, Any]], n: int = 12) -> dict[str, Any]:
    status, body = await chat(base, messages, max_tokens=n)
    assert status == 200, body
    return body


async def scratch(messages: list[dict[str, Any]], n: int = 12) -> str:
    async with running(role="decode") as r:
        return str((await answer(r.url, messages, n))["choices"][0]["message"]["content"])


async def counters(base: str) -> dict[str, float]:
    names = {
        "read": "vllm_sim:store_blocks_read_total",
        "written": "vllm_sim:store_blocks_written_total",
        "errors": "vllm_sim:store_errors_total",
    }
    out = {k: await metric(base, v) for k, v in names.items()}
    for source in ("local_compute", "local_cache_hit", "external_kv_transfer"):
        out[source] = await metric(base, "vllm:prompt_tokens_by_source_total", source=source)
    return out


async def test_d_loads_what_p_wrote_and_answers_as_from_scratch(redis_url: str) -> None:
    async with pd(redis_url, redis_url) as (p, d):
        body = await answer(p.url, MSGS, n=1)
        n = body["usage"]["prompt_tokens"]
        assert body["kv_transfer_params"] is None  # the store connector returns no handle
        assert (await counters(p.url))["written"] == n // BS
        got = await answer(d.url, MSGS)
        c = await counters(d.url)
        loaded = (n - 1) // BS
        assert c["read"] == loaded
        assert c["external_kv_transfer"] == loaded * BS
        assert c["local_compute"] == n - loaded * BS
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == loaded * BS
        assert c["written"] == 0  # a consumer writes nothing unless told to
    assert got["choices"][0]["message"]["content"] == await scratch(MSGS)


async def test_a_consumer_on_another_store_finds_nothing(redis_url: str) -> None:
    """Wrong wiring: P and D on different store databases. D computes everything (its
    counters say so); the answer stays right, as on a real engine that misses the store."""
    other = with_db(redis_url, 3)
    async with pd(redis_url, other) as (p, d):
        await answer(p.url, MSGS, n=1)
        got = await answer(d.url, MSGS)
        c = await counters(d.url)
        assert c["read"] == 0 and c["external_kv_transfer"] == 0
        assert c["local_compute"] == got["usage"]["prompt_tokens"]
    assert got["choices"][0]["message"]["content"] == await scratch(MSGS)


async def test_a_wrong_block_in_the_store_gives_a_wrong_answer(redis_url: str) -> None:
    """What D loads is what it computes with: one overwritten block changes the answer."""
    async with pd(redis_url, redis_url) as (p, d):
        await answer(p.url, MSGS, n=1)
        client = aioredis.from_url(redis_url)
        keys = sorted(await client.keys(f"{KEY_PREFIX}:*"))
        assert keys
        for key in keys:
            await client.set(key, pack([7] * BS))
        await client.aclose()
        got = await answer(d.url, MSGS)
        assert (await counters(d.url))["read"] > 0
    assert got["choices"][0]["message"]["content"] != await scratch(MSGS)


async def test_decode_output_reaches_the_next_turn_through_the_store(redis_url: str) -> None:
    """With --kv-store-save-decode, D writes prompt and answer blocks: a P that never saw the
    conversation loads its history (turn 2) instead of computing it."""
    async with pd(redis_url, redis_url, kv_store_save_decode=True) as (p, d):
        await answer(p.url, MSGS, n=1)
        first = await answer(d.url, MSGS, n=40)
        text = first["choices"][0]["message"]["content"]
        turn2 = [*MSGS, {"role": "assistant", "content": text}, {"role": "user", "content": "ok"}]
        async with running(role="prefill", kv_connector="store", kv_store=redis_url) as p2:
            body = await answer(p2.url, turn2, n=1)
            c = await counters(p2.url)
        n = body["usage"]["prompt_tokens"]
        history = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"] - 1
        assert c["external_kv_transfer"] == history // BS * BS
        assert c["local_compute"] == n - history // BS * BS
        got = await answer(d.url, turn2)
    assert got["choices"][0]["message"]["content"] == await scratch(turn2)


async def test_a_store_that_is_down_costs_compute_not_answers(redis_url: str) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    async with pd(dead, dead) as (p, d):
        assert (await answer(p.url, MSGS, n=1))["choices"]
        got = await answer(d.url, MSGS)
        c = await counters(d.url)
        assert c["errors"] == 1 and c["read"] == 0
        assert (await counters(p.url))["errors"] == 2  # the lookup and the write
    assert got["choices"][0]["message"]["content"] == await scratch(MSGS)


@pytest.mark.unit
def test_the_store_url_is_checked_at_start() -> None:
    from vllm_sim.config import parse_settings

    with pytest.raises(SystemExit):
        parse_settings(["--kv-connector", "store"])
    with pytest.raises(SystemExit):
        parse_settings(["--kv-connector", "store", "--kv-store", "http://x"])
    assert parse_settings(["--kv-connector", "store", "--kv-store", "redis://h:1/2"]).kv_store


@pytest.mark.unit
def test_resp_urls_and_replies() -> None:
    import asyncio

    from vllm_sim.resp import RespError, encode, parse_url, read_reply

    a = parse_url("redis://user:p%40ss@h:7000/5")
    assert (a.host, a.port, a.db, a.username, a.password) == ("h", 7000, 5, "user", "p@ss")
    assert parse_url("redis://h").port == 6379 and parse_url("redis://h").db == 0
    wire = b"*4\r\n$3\r\nSET\r\n$1\r\nk\r\n$2\r\n\x00v\r\n$1\r\n7\r\n"
    assert encode("SET", "k", b"\x00v", 7) == wire

    async def replies(raw: bytes, n: int) -> list[object]:
        reader = asyncio.StreamReader()
        reader.feed_data(raw)
        reader.feed_eof()
        return [await read_reply(reader) for _ in range(n)]

    got = asyncio.run(replies(b"+OK\r\n:12\r\n$-1\r\n*2\r\n$2\r\nab\r\n$-1\r\n", 4))
    assert got == ["OK", 12, None, [b"ab", None]]
    with pytest.raises(RespError, match="WRONGTYPE"):
        asyncio.run(replies(b"-WRONGTYPE bad\r\n", 1))
    with pytest.raises(RespError, match="closed"):
        asyncio.run(replies(b"", 1))
