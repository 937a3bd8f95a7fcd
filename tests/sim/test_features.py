"""Flags and admin features against processes: stream params, reasoning, auth, faults, SDK."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import openai
import pytest
import zmq
import zmq.asyncio

from harness.chat import NULL_HANDOFF
from harness.procs import SimProc, sims
from tests.sim.client import chat, get, parse_sse, post, stream, tokenize, words
from vllm_sim import model
from vllm_sim.events_decode import decode_batch

MSGS = [{"role": "user", "content": words(200, 40)}]


@pytest.fixture(scope="module")
def procs() -> Iterator[dict[str, SimProc]]:
    specs = {
        "P": ("prefill", "--vllm-version", "0.32"),
        "Dk": ("decode", "--bidirectional", "--stream-kv-params", "--vllm-version", "0.32"),
        "R": ("decode", "--reasoning-tokens", "3"),
        "A": ("decode", "--api-key", "sekret"),
        "E": ("prefill", "--kv-events-port", "0"),  # the port is bound by the simulator
    }
    with sims(*specs.values(), name="feat") as procs:
        yield dict(zip(specs, procs, strict=True))


async def test_stream_kv_params_in_final_chunk(procs: dict[str, SimProc]) -> None:
    """vLLM 0.32 with PR #40186's flag: only the final chunk carries the key."""
    p, dk = procs["P"], procs["Dk"]
    _, pb = await chat(p.url, MSGS, max_tokens=1, kv_transfer_params=NULL_HANDOFF)
    body = {
        "messages": MSGS,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": pb["kv_transfer_params"],
    }
    status, raw = await stream(dk.url + "/v1/chat/completions", body)
    events = parse_sse(raw)[:-1]
    assert status == 200
    carrying = [e for e in events if "kv_transfer_params" in e]
    assert len(carrying) == 1 and carrying[0]["choices"][0]["finish_reason"] == "length"
    params = carrying[0]["kv_transfer_params"]
    assert params["do_remote_decode"] is True and params["remote_engine_id"] == dk.engine_id
    assert params["remote_num_tokens"] == events[-1]["usage"]["prompt_tokens"] + 5 - 1
    # Without the flag (P here) a stream carries no params, as stock vLLM 0.32.
    status, raw = await stream(p.url + "/v1/chat/completions", {**body, "kv_transfer_params": None})
    assert all("kv_transfer_params" not in e for e in parse_sse(raw)[:-1])


async def test_reasoning_is_not_sent_back(procs: dict[str, SimProc]) -> None:
    r = procs["R"]
    status, body = await chat(r.url, MSGS, max_tokens=8, return_token_ids=True)
    assert status == 200
    msg = body["choices"][0]["message"]
    assert len(msg["reasoning"].split()) == 3 and msg["reasoning_content"] == msg["reasoning"]
    assert len(msg["content"].split()) == 5
    held = body["prompt_token_ids"] + body["choices"][0]["token_ids"]
    history = [*MSGS, {"role": "assistant", "content": msg["content"]}]
    ids = await tokenize(r.url, history)
    assert ids[: len(held)] != held  # vllm#43094: not an extension of what D holds
    status, raw = await stream(
        r.url + "/v1/chat/completions", {"messages": MSGS, "max_tokens": 8, "stream": True}
    )
    deltas = [e["choices"][0]["delta"] for e in parse_sse(raw)[1:-1]]
    assert "".join(d.get("reasoning", "") for d in deltas) == msg["reasoning"]
    assert "".join(d.get("content", "") for d in deltas) == msg["content"]


async def test_api_key(procs: dict[str, SimProc]) -> None:
    a = procs["A"]
    status, body = await chat(a.url, MSGS, max_tokens=1)
    assert status == 401 and body == {"error": "Unauthorized"}
    status, _ = await post(
        a.url + "/v1/chat/completions",
        {"messages": MSGS, "max_tokens": 1},
        headers={"Authorization": "Bearer sekret"},
    )
    assert status == 200
    status, _ = await get(a.url + "/health")
    assert status == 200


async def test_fault_injection(procs: dict[str, SimProc]) -> None:
    url = procs["P"].url
    body: dict[str, Any] = {"messages": MSGS, "max_tokens": 4}
    status, state = await post(url + "/sim/faults", {"fail_next": 2, "status": 503})
    assert status == 200 and state["fail_next"] == 2
    statuses = [(await chat(url, MSGS, max_tokens=1))[0] for _ in range(3)]
    assert statuses == [503, 503, 200]

    await post(url + "/sim/faults", {"stall_s": 0.3, "stall_next": 1})
    t0 = time.monotonic()
    assert (await chat(url, MSGS, max_tokens=1))[0] == 200
    assert time.monotonic() - t0 >= 0.3

    await post(url + "/sim/faults", {"error_after_chunks": 2, "error_next": 1})
    status, raw = await stream(url + "/v1/chat/completions", {**body, "stream": True})
    events = parse_sse(raw)
    assert status == 200 and len(events) == 4
    assert events[2]["error"]["type"] == "InternalServerError" and events[3] == "[DONE]"

    await post(url + "/sim/faults", {"drop_after_chunks": 2, "drop_next": 1})
    with pytest.raises(aiohttp.ClientPayloadError):
        await stream(url + "/v1/chat/completions", {**body, "stream": True})

    await post(url + "/sim/faults", {"fail_next": 5})
    status, state = await get(url + "/sim/faults")
    assert status == 200 and state["fail_next"] == 5
    async with aiohttp.ClientSession() as s, s.delete(url + "/sim/faults") as resp:
        assert resp.status == 200 and (await resp.json())["fail_next"] == 0
    assert (await chat(url, MSGS, max_tokens=1))[0] == 200
    status, err = await post(url + "/sim/faults", {"explode": 1})
    assert status == 400 and "explode" in err["error"]["message"]


async def test_openai_sdk(procs: dict[str, SimProc]) -> None:
    client = openai.AsyncOpenAI(base_url=procs["A"].url + "/v1", api_key="sekret", max_retries=0)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == ["sim-model"]
        resp = await client.chat.completions.create(
            model="sim-model",
            messages=MSGS,
            max_tokens=5,
        )
        assert resp.choices[0].finish_reason == "length"
        text = resp.choices[0].message.content
        chunks = await client.chat.completions.create(
            model="sim-model",
            messages=MSGS,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts: list[str] = []
        usage = None
        async for chunk in chunks:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            usage = chunk.usage or usage
        assert "".join(parts) == text and usage is not None and usage.completion_tokens == 5
        comp = await client.completions.create(model="sim-model", prompt="water", max_tokens=3)
        assert comp.choices[0].finish_reason == "length"
        with pytest.raises(openai.NotFoundError):
            await client.chat.completions.create(model="nope", messages=MSGS)
    finally:
        await client.close()


async def test_kv_events(procs: dict[str, SimProc]) -> None:
    e = procs["E"]
    _, state = await get(e.url + "/sim/state")
    ctx = zmq.asyncio.Context()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://127.0.0.1:{state['kv_events_port']}")
    try:
        msgs = [{"role": "user", "content": words(300, 50)}]
        ids = await tokenize(e.url, msgs)
        want = model.block_hashes(ids, 16)
        stored: list[int] = []
        for _ in range(50):  # PUB drops until the subscription is up: retry a few times
            await post(e.url + "/reset_prefix_cache", {})
            await chat(e.url, msgs, max_tokens=1)
            with contextlib.suppress(TimeoutError):
                while True:
                    frames = await asyncio.wait_for(sub.recv_multipart(), 0.1)
                    assert frames[0] == b"kv-events" and len(frames[1]) == 8
                    _, events, _ = decode_batch(frames[2])
                    for ev in events:
                        if ev["type"] == "BlockStored":
                            stored = ev["block_hashes"]
                            assert ev["block_size"] == 16
            if stored:
                break
        assert stored == want
    finally:
        sub.close(linger=0)
        ctx.term()
