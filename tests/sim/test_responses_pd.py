"""P/D over /v1/responses between real simulator processes; the OpenAI SDK as a client."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from harness.chat import NULL_HANDOFF
from harness.procs import SimProc, sims
from tests.sim.client import chat, external, output_text, parse_events, post, stream, words

BS = 16


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, SimProc]]:
    """P and D (bidirectional) and a reference R computing from scratch."""
    specs = {
        "P": ("prefill", "--bidirectional"),
        "D": ("decode", "--bidirectional"),
        "R": ("prefill",),
    }
    with sims(*specs.values(), name="rpd") as procs:
        yield dict(zip(specs, procs, strict=True))


async def prefill(p: SimProc, items: list[dict[str, Any]], params: dict[str, Any]) -> Any:
    body = {"input": items, "max_output_tokens": 1, "store": False, "kv_transfer_params": params}
    status, r = await post(p.url + "/v1/responses", body)
    assert status == 200, r
    return r


async def decode_stream(
    d: SimProc, items: list[dict[str, Any]], params: dict[str, Any], n: int
) -> dict[str, Any]:
    """A streaming D leg; returns response.completed's response."""
    body = {"input": items, "max_output_tokens": n, "stream": True, "kv_transfer_params": params}
    status, raw = await stream(d.url + "/v1/responses", body)
    events = parse_events(raw)
    assert status == 200 and events[-1]["type"] == "response.completed", events[-1]
    response: dict[str, Any] = events[-1]["response"]
    return response


async def scratch(r: SimProc, items: list[dict[str, Any]], n: int) -> str:
    status, body = await post(r.url + "/v1/responses", {"input": items, "max_output_tokens": n})
    assert status == 200, body
    return output_text(body)


def as_p_handle(d_params: dict[str, Any]) -> dict[str, Any]:
    return {**d_params, "do_remote_decode": True, "do_remote_prefill": False}


async def test_p_to_d_handoff_equals_from_scratch(cluster: dict[str, SimProc]) -> None:
    p, d, r = cluster["P"], cluster["D"], cluster["R"]
    items = [{"role": "user", "content": words(11, 100)}]
    pr = await prefill(p, items, NULL_HANDOFF)
    params = pr["kv_transfer_params"]  # top level, non-streaming (vllm#37424)
    n = pr["usage"]["input_tokens"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == p.engine_id
    assert params["remote_num_tokens"] == n
    assert params["remote_request_id"].startswith(pr["id"] + "-")
    before = await external(d.url)
    body = {"input": items, "max_output_tokens": 20, "kv_transfer_params": params}
    status, dr = await post(d.url + "/v1/responses", body)
    assert status == 200, dr
    assert output_text(dr) == await scratch(r, items, 20)
    assert output_text(dr).startswith(output_text(pr))
    assert await external(d.url) - before == n


async def test_bidirectional_three_turns_streaming_from_d(cluster: dict[str, SimProc]) -> None:
    """response.completed carries D's handle; turns 2-3 pull it into P and stay exact."""
    p, d, r = cluster["P"], cluster["D"], cluster["R"]
    items: list[dict[str, Any]] = [{"role": "user", "content": words(12, 60)}]
    pr = await prefill(p, items, NULL_HANDOFF)
    for turn in range(3):
        n = pr["usage"]["input_tokens"]
        final = await decode_stream(d, items, pr["kv_transfer_params"], 80)
        assert output_text(final) == await scratch(r, items, 80)
        hd = final["kv_transfer_params"]  # D's own handle, on a streaming call
        assert hd["do_remote_decode"] is True and hd["remote_engine_id"] == d.engine_id
        assert hd["remote_num_tokens"] == n + final["usage"]["output_tokens"] - 1
        assert isinstance(hd["remote_blocks_expiry_time"], float)
        if turn == 2:
            break
        # The output message item goes back verbatim, then the next user message.
        items = [*items, *final["output"], {"role": "user", "content": words(120 + turn, 30)}]
        before = await external(p.url)
        pr = await prefill(p, items, as_p_handle(hd))
        p_hit = n // BS * BS  # P's own cache: the last P leg's full prompt blocks
        assert await external(p.url) - before == hd["remote_num_tokens"] - p_hit
        assert pr["usage"]["input_tokens_details"]["cached_tokens"] == hd["remote_num_tokens"]


async def test_chat_handle_on_a_responses_leg_gives_a_wrong_answer(
    cluster: dict[str, SimProc],
) -> None:
    """Mixing APIs: the chat P leg holds one token fewer than the Responses prompt."""
    p, d, r = cluster["P"], cluster["D"], cluster["R"]
    msgs = [{"role": "user", "content": words(13, 70)}]  # 74 chat tokens, 75 Responses tokens
    status, pb = await chat(p.url, msgs, max_tokens=1, kv_transfer_params=NULL_HANDOFF)
    assert status == 200, pb
    params = pb["kv_transfer_params"]
    assert params["remote_num_tokens"] == pb["usage"]["prompt_tokens"] == 74
    body = {"input": msgs, "max_output_tokens": 20, "kv_transfer_params": params}
    status, dr = await post(d.url + "/v1/responses", body)
    assert status == 200 and dr["usage"]["input_tokens"] == 75  # HTTP 200 ...
    assert output_text(dr) != await scratch(r, msgs, 20)  # ... and a wrong answer


async def test_openai_sdk_responses(cluster: dict[str, SimProc]) -> None:
    d = cluster["D"]
    clients = {
        k: openai.AsyncOpenAI(base_url=v.url + "/v1", api_key="x", max_retries=0)
        for k, v in cluster.items()
    }
    try:
        text = words(14, 50)
        plain = await clients["R"].responses.create(
            model="sim-model", input=text, max_output_tokens=12, instructions="be brief"
        )
        assert plain.status == "incomplete" and plain.output_text
        assert plain.usage is not None and plain.usage.output_tokens == 12
        pr = await clients["P"].responses.create(
            model="sim-model",
            input=text,
            instructions="be brief",
            max_output_tokens=1,
            store=False,
            extra_body={"kv_transfer_params": NULL_HANDOFF},
        )
        params = (pr.model_extra or {})["kv_transfer_params"]
        events = await clients["D"].responses.create(
            model="sim-model",
            input=text,
            instructions="be brief",
            max_output_tokens=12,
            stream=True,
            extra_body={"kv_transfer_params": params},
        )
        kinds: list[str] = []
        deltas: list[str] = []
        completed: Any = None
        async for event in events:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
            elif event.type == "response.completed":
                completed = event.response
        assert kinds[:2] == ["response.created", "response.in_progress"]
        assert kinds[-1] == "response.completed" and len(deltas) == 12
        assert completed.output_text == "".join(deltas) == plain.output_text
        handle = (completed.model_extra or {})["kv_transfer_params"]
        assert handle["remote_engine_id"] == d.engine_id
        with pytest.raises(openai.BadRequestError):
            await clients["P"].responses.create(
                model="sim-model", input="x", previous_response_id=plain.id
            )
    finally:
        for client in clients.values():
            await client.close()
