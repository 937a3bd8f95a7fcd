"""`--vllm-version 0.32|0.33`: each version's wire shapes, its NIXL connector version (peers of
different versions refuse each other), and 0.33's pause and sleep."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from harness.chat import NULL_HANDOFF
from harness.procs import SimProc, sims
from tests.sim.client import chat, get, metric, parse_sse, post, stream
from tests.sim.handoff import answer, as_p_handle, decode, prefill, scratch, turn1, turn2_messages


@pytest.fixture(scope="module")
def fleet() -> Iterator[dict[str, SimProc]]:
    """A 0.33 P/D pair (the default version), a 0.32 P/D pair, and a reference R."""
    specs = {
        "P": ("prefill", "--bidirectional"),
        "D": ("decode", "--bidirectional", "--enable-scale-out"),
        "P32": ("prefill", "--bidirectional", "--vllm-version", "0.32"),
        "D32": ("decode", "--bidirectional", "--vllm-version", "0.32", "--enable-scale-out"),
        "R": ("prefill",),
    }
    with sims(*specs.values(), name="versions") as procs:
        yield dict(zip(specs, procs, strict=True))


async def test_version_route(fleet: dict[str, SimProc]) -> None:
    assert await get(fleet["D"].url + "/version") == (200, {"version": "0.33.0"})
    assert await get(fleet["D32"].url + "/version") == (200, {"version": "0.32.0"})
    # 0.32 has no pause route (0.33 serves it, as with VLLM_SERVER_DEV_MODE=1).
    assert (await get(fleet["D32"].url + "/is_paused"))[0] == 404


async def test_033_streams_the_handle_and_a_null_key_per_content_chunk(
    fleet: dict[str, SimProc],
) -> None:
    p, d = fleet["P"], fleet["D"]
    msgs = [{"role": "user", "content": "tell me about the sea"}]
    pb = await prefill(p, msgs, NULL_HANDOFF)
    assert pb["kv_transfer_params"]["remote_registration_generation"] == 1
    body = {
        "messages": msgs,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
        "kv_transfer_params": pb["kv_transfer_params"],
    }
    status, raw = await stream(d.url + "/v1/chat/completions", body)
    role, *tokens, usage = parse_sse(raw)[:-1]
    assert status == 200 and len(tokens) == 5
    assert "kv_transfer_params" not in role and "kv_transfer_params" not in usage
    assert all(t["kv_transfer_params"] is None for t in tokens[:-1])
    handle = tokens[-1]["kv_transfer_params"]
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    assert handle["do_remote_decode"] is True and handle["remote_engine_id"] == d.engine_id
    assert handle["remote_registration_generation"] == 1
    # vLLM's serializer writes the null key without spaces: what a relay may match on.
    assert raw.count(b'"kv_transfer_params":null') == 4
    # Completions streams carry it too.
    status, raw = await stream(
        d.url + "/v1/completions", {"prompt": "waves", "max_tokens": 3, "stream": True}
    )
    chunks = parse_sse(raw)[:-1]
    assert status == 200 and all("kv_transfer_params" in c for c in chunks)


async def test_032_has_no_generation_and_streams_no_handle(fleet: dict[str, SimProc]) -> None:
    p, d = fleet["P32"], fleet["D32"]
    msgs = [{"role": "user", "content": "tell me about the hills"}]
    pb = await prefill(p, msgs, NULL_HANDOFF)
    assert "remote_registration_generation" not in pb["kv_transfer_params"]
    body = {"messages": msgs, "max_tokens": 4, "stream": True}
    status, raw = await stream(
        d.url + "/v1/chat/completions", {**body, "kv_transfer_params": pb["kv_transfer_params"]}
    )
    assert status == 200 and b"kv_transfer_params" not in raw


async def test_peers_of_different_versions_refuse_each_other(fleet: dict[str, SimProc]) -> None:
    """NIXL connector versions 14 and 15 are in the compatibility hash: every transfer between
    a 0.32 and a 0.33 engine fails (kv_load_failure_policy fail: HTTP 500), both ways."""
    msgs = [{"role": "user", "content": "a mixed fleet during an upgrade"}]
    failed = await metric(fleet["D"].url, "vllm:nixl_num_failed_transfers_total")
    pb = await prefill(fleet["P32"], msgs, NULL_HANDOFF)
    status, body = await decode(fleet["D"], msgs, pb["kv_transfer_params"], 4)
    assert status == 500 and body["error"]["type"] == "InternalServerError"
    assert await metric(fleet["D"].url, "vllm:nixl_num_failed_transfers_total") == failed + 1
    # A D->P read the other way (a 0.32 P given a 0.33 D's handle) fails the same way.
    msgs1, db = await turn1(fleet, 91)
    msgs2 = turn2_messages(msgs1, answer(db)[1], 92)
    status, body = await chat(
        fleet["P32"].url,
        msgs2,
        max_tokens=1,
        kv_transfer_params=as_p_handle(db["kv_transfer_params"]),
    )
    assert status == 500
    # Same versions work: the 0.32 pair, then the 0.33 pair.
    msgs3, db = await turn1(fleet, 93, p="P32", d="D32")
    assert answer(db) == await scratch(fleet["R"], msgs3, 80)


async def test_paused_engine_refuses_with_503_until_resumed(fleet: dict[str, SimProc]) -> None:
    p = fleet["P"]
    msgs = [{"role": "user", "content": "are you there"}]
    assert (await post(p.url + "/pause", {}))[0] == 200
    try:
        assert await get(p.url + "/is_paused") == (200, {"is_paused": True})
        status, body = await chat(p.url, msgs, max_tokens=1)
        assert status == 503
        assert body["error"]["type"] == "ServiceUnavailableError" and body["error"]["code"] == 503
        assert "paused" in body["error"]["message"]
        status, raw = await stream(
            p.url + "/v1/chat/completions", {"messages": msgs, "max_tokens": 2, "stream": True}
        )
        events = parse_sse(raw)
        assert status == 200 and events[0]["error"]["code"] == 503 and events[-1] == "[DONE]"
    finally:
        assert (await post(p.url + "/resume", {}))[0] == 200
    assert await get(p.url + "/is_paused") == (200, {"is_paused": False})
    assert (await chat(p.url, msgs, max_tokens=1))[0] == 200


async def test_sleep_discards_the_kv_and_raises_the_registration_generation(
    fleet: dict[str, SimProc],
) -> None:
    """A handle D made before it slept names blocks of the old registration: a P that read
    from D before fails to read it after the wake-up; D's handles made after carry
    generation 2, make P handshake again, and read right."""
    p, d, r = fleet["P"], fleet["D"], fleet["R"]
    msgs0, db0 = await turn1(fleet, 94)  # P reads from D once: it keeps D's agent
    pb0 = await prefill(
        p, turn2_messages(msgs0, answer(db0)[1], 90), as_p_handle(db0["kv_transfer_params"])
    )
    assert pb0["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    msgs, db = await turn1(fleet, 95)
    old = as_p_handle(db["kv_transfer_params"])
    assert old["remote_registration_generation"] == 1
    assert (await post(d.url + "/sleep?level=1", {}))[0] == 200
    assert await get(d.url + "/is_sleeping") == (200, {"is_sleeping": True})
    # Meanwhile a request is accepted and waits (sleep leaves the reject policy alone).
    waiting = asyncio.ensure_future(chat(d.url, msgs, max_tokens=2))
    await asyncio.sleep(0.3)
    assert not waiting.done()
    assert (await post(d.url + "/wake_up", {}))[0] == 200
    assert (await waiting)[0] == 200
    state: dict[str, Any] = (await get(d.url + "/sim/state"))[1]
    assert state["registration_generation"] == 2 and state["sleeping"] is False
    msgs2 = turn2_messages(msgs, answer(db)[1], 96)
    status, _ = await chat(p.url, msgs2, max_tokens=1, kv_transfer_params=old)
    # P's agent for D is the old registration's: the read fails (policy fail).
    assert status == 500
    # A new handle (generation 2) makes P handshake again, and reads right.
    msgs3, db3 = await turn1(fleet, 97)
    new = as_p_handle(db3["kv_transfer_params"])
    assert new["remote_registration_generation"] == 2
    msgs4 = turn2_messages(msgs3, answer(db3)[1], 98)
    pb = await prefill(p, msgs4, new)
    status, db4 = await decode(d, msgs4, pb["kv_transfer_params"], 20)
    assert status == 200 and answer(db4) == await scratch(r, msgs4, 20)


@pytest.mark.parametrize("engine", ["D", "D32"])
async def test_render_gives_the_prompt_the_engine_computes(
    fleet: dict[str, SimProc], engine: str
) -> None:
    """vLLM's render routes (both versions, with --enable-scale-out): the token ids are the
    generation routes' prompt."""
    url = fleet[engine].url
    msgs = [{"role": "user", "content": "render me"}]
    status, rendered = await post(url + "/v1/chat/completions/render", {"messages": msgs})
    assert status == 200 and rendered["request_id"].startswith("chatcmpl-")
    _, body = await chat(url, msgs, max_tokens=2, return_token_ids=True)
    assert rendered["token_ids"] == body["prompt_token_ids"]
    status, listed = await post(
        url + "/v1/completions/render", {"prompt": "waves", "max_tokens": 3}
    )
    assert status == 200 and len(listed) == 1 and listed[0]["sampling_params"]["max_tokens"] == 3
    items = [{"role": "user", "content": "render a response"}]
    status, rendered = await post(url + "/v1/responses/render", {"input": items})
    assert status == 200
    _, resp = await post(url + "/v1/responses", {"input": items, "max_output_tokens": 2})
    assert len(rendered["token_ids"]) == resp["usage"]["input_tokens"]
    status, error = await post(url + "/v1/chat/completions/render", {"messages": "nope"})
    assert status == 400 and error["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize("engine", ["P", "P32"])
async def test_render_routes_are_refused_without_enable_scale_out(
    fleet: dict[str, SimProc], engine: str
) -> None:
    """vLLM registers them but answers 403 unless started with --enable-scale-out."""
    url = fleet[engine].url
    for path, body in (
        ("/v1/chat/completions/render", {"messages": [{"role": "user", "content": "x"}]}),
        ("/v1/completions/render", {"prompt": "x"}),
        ("/v1/responses/render", {"input": "x"}),
    ):
        status, error = await post(url + path, body)
        assert status == 403 and error["error"]["type"] == "PermissionDeniedError", path
        assert "--enable-scale-out" in error["error"]["message"]
