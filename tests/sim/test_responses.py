"""POST /v1/responses: vLLM 0.32 body and event shapes, rendering, errors, faults, reasoning."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest

from tests.sim.client import output_text, parse_events, post, stream, tokenize, words
from tests.sim.conftest import running
from vllm_sim import responses_api
from vllm_sim.errors import ApiError
from vllm_sim.tokenizer import BOS_ID, Tokenizer

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": words(200, 30)}]
RESPONSE_KEYS = [
    "id",
    "created_at",
    "incomplete_details",
    "instructions",
    "metadata",
    "model",
    "object",
    "output",
    "parallel_tool_calls",
    "temperature",
    "tool_choice",
    "tools",
    "top_p",
    "background",
    "max_output_tokens",
    "max_tool_calls",
    "previous_response_id",
    "prompt",
    "reasoning",
    "service_tier",
    "status",
    "text",
    "top_logprobs",
    "truncation",
    "usage",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "kv_transfer_params",
    "ec_transfer_params",
    "input_messages",
    "output_messages",
]
EVENTS = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * 4,
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


async def respond(base: str, body: dict[str, Any]) -> tuple[int, Any]:
    return await post(base + "/v1/responses", body)


async def test_body_shape(base: str) -> None:
    body = {"model": "sim-model", "input": MSGS, "max_output_tokens": 5, "store": False}
    status, r = await respond(base, {**body, "temperature": 0.2})
    assert status == 200, r
    assert list(r) == RESPONSE_KEYS
    assert r["id"].startswith("resp_") and len(r["id"]) == len("resp_") + 16
    assert r["object"] == "response" and r["model"] == "sim-model"
    assert r["status"] == "incomplete"  # finish_reason "length", as vLLM reports it
    assert r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["kv_transfer_params"] is None and r["max_output_tokens"] == 5
    assert r["temperature"] == 0.2 and r["top_p"] == 1.0 and r["tool_choice"] == "none"
    [item] = r["output"]
    assert item["type"] == "message" and item["id"].startswith("msg_")
    assert item["role"] == "assistant" and item["status"] == "completed"
    [part] = item["content"]
    assert part == {
        "annotations": [],
        "text": part["text"],
        "type": "output_text",
        "logprobs": None,
    }
    assert len(part["text"].split()) == 5
    n = len(await tokenize(base, MSGS)) + 1  # one more BOS than the chat template
    cached = r["usage"]["input_tokens_details"]["cached_tokens"]
    assert r["usage"] == {
        "input_tokens": n,
        "input_tokens_details": {
            "cached_tokens": cached,
            "cache_write_tokens": 0,
            "input_tokens_per_turn": [],
            "cached_tokens_per_turn": [],
        },
        "output_tokens": 5,
        "output_tokens_details": {
            "reasoning_tokens": 0,
            "tool_output_tokens": 0,
            "output_tokens_per_turn": [],
            "tool_output_tokens_per_turn": [],
        },
        "total_tokens": n + 5,
    }
    # The same input again hits the prefix cache (full blocks, the last token recomputed).
    status, again = await respond(base, body)
    assert again["usage"]["input_tokens_details"]["cached_tokens"] == (n - 1) // 16 * 16
    assert output_text(again) == part["text"]


async def test_stream_events(base: str) -> None:
    body = {"input": MSGS, "max_output_tokens": 4, "stream": True, "instructions": "hi"}
    status, raw = await stream(base + "/v1/responses", body)
    assert status == 200
    events = parse_events(raw)  # every event named by its type; no [DONE]
    assert [e["type"] for e in events] == EVENTS
    assert [e["sequence_number"] for e in events] == list(range(len(EVENTS)))
    created, in_progress = events[0]["response"], events[1]["response"]
    assert created == in_progress and created["status"] == "in_progress"
    assert created["output"] == [] and created["usage"] is None and created["instructions"] == "hi"
    added, part_added, *deltas = events[2:8]
    item_id = added["item"]["id"]
    assert added["item"] == {
        "id": item_id,
        "content": [],
        "role": "assistant",
        "status": "in_progress",
        "type": "message",
        "phase": None,
    }
    assert part_added["part"] == {
        "annotations": [],
        "text": "",
        "type": "output_text",
        "logprobs": [],
    }
    assert all(d["item_id"] == item_id and d["output_index"] == 0 for d in deltas)
    assert list(deltas[0]) == [
        "content_index",
        "delta",
        "item_id",
        "logprobs",
        "output_index",
        "sequence_number",
        "type",
    ]
    text = "".join(d["delta"] for d in deltas)
    assert events[8]["text"] == text and events[9]["part"]["text"] == text
    done_item = events[10]["item"]
    assert done_item["status"] == "completed" and done_item["content"][0]["text"] == text
    final = events[-1]["response"]
    assert list(final) == RESPONSE_KEYS and final["id"] == created["id"]
    assert final["output"] == [done_item] and final["status"] == "incomplete"
    assert final["usage"]["output_tokens"] == 4 and final["kv_transfer_params"] is None
    # The same answer as a system message given as instructions, non-streaming.
    status, plain = await respond(
        base, {"input": MSGS[1:], "instructions": "hi", "max_output_tokens": 4}
    )
    assert output_text(plain) != "" and status == 200


async def test_chat_and_responses_renderings_differ_by_one_bos(base: str) -> None:
    chat_ids = await tokenize(base, MSGS)
    status, r = await respond(base, {"input": MSGS, "max_output_tokens": 1})
    assert status == 200 and r["usage"]["input_tokens"] == len(chat_ids) + 1
    tok = Tokenizer()
    ids = responses_api.render_input(tok, responses_api.input_messages({"input": MSGS}))
    assert ids == [BOS_ID, *chat_ids]
    # instructions = a leading system message; a string input = one user message.
    same = {"instructions": "be brief", "input": MSGS[1]["content"]}
    assert responses_api.render_input(tok, responses_api.input_messages(same)) == ids


def test_output_items_round_trip_as_an_exact_extension() -> None:
    tok = Tokenizer()
    answer = " bado caba boso"
    held = responses_api.render_input(tok, [{"role": "user", "content": "hello"}])
    held += tok.encode(answer)
    user2 = {"role": "user", "content": [{"type": "input_text", "text": "more"}]}
    verbatim = {
        "id": "msg_0123456789abcdef",
        "type": "message",
        "role": "assistant",
        "status": "completed",
        "content": [{"type": "output_text", "text": answer, "annotations": [], "logprobs": None}],
    }
    reasoning = {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"text": " x"}]}
    for sent_back in (
        [{"role": "assistant", "content": answer}],
        [verbatim],
        [reasoning, verbatim],  # the whole output list of a reasoning response
    ):
        items = [{"role": "user", "content": "hello"}, *sent_back, user2]
        ids = responses_api.render_input(tok, responses_api.input_messages({"input": items}))
        assert ids[: len(held)] == held


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
        ({"input": "x", "background": True}, 400, "background"),
        ({"input": [{"type": "function_call", "name": "f"}]}, 400, "input"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, 400, "input"),
        ({"input": [{"content": "no role"}]}, 400, "input"),
        ({"input": 3}, 400, "input"),
        ({"max_output_tokens": 3}, 400, "input"),
        ({"input": "x", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "x", "stream": "yes"}, 400, "stream"),
        ({"input": "x", "model": "other"}, 404, "model"),
        ({"input": words(1, 1100)}, 400, "input"),
    ],
)
async def test_errors(base: str, body: dict[str, Any], status: int, param: str) -> None:
    got, err = await respond(base, body)
    assert got == status, err
    assert err["error"]["param"] == param and err["error"]["code"] == status


async def test_store_is_ignored_and_max_output_tokens_clamped(base: str) -> None:
    status, r = await respond(
        base, {"input": words(3, 1000), "store": True, "max_output_tokens": 99}
    )
    assert status == 200 and r["max_output_tokens"] == 1024 - r["usage"]["input_tokens"]
    status, r = await respond(base, {"input": "x"})
    assert status == 200 and r["usage"]["output_tokens"] == 64  # --default-max-tokens
    status, _ = await post(base + "/v1/responses", None, raw=b"{}")
    assert status == 415


def test_parse_unit() -> None:
    with pytest.raises(ApiError, match="must be an object"):
        responses_api.input_messages({"input": ["text"]})
    with pytest.raises(ApiError, match="string 'text'"):
        responses_api.input_messages({"input": [{"role": "user", "content": [{"type": "text"}]}]})
    with pytest.raises(ApiError, match="string or a list of parts"):
        responses_api.input_messages({"input": [{"role": "user", "content": None}]})
    msgs = responses_api.input_messages(
        {"input": [{"type": "reasoning", "summary": [{"text": "s"}]}, {"type": "reasoning"}]}
    )
    assert msgs == [{"role": "assistant", "reasoning": "s"}, {"role": "assistant", "reasoning": ""}]


async def test_reasoning_items_and_events() -> None:
    async with running(max_model_len=1024, reasoning_tokens=3) as sim:
        body: dict[str, Any] = {"input": MSGS, "max_output_tokens": 5}
        status, r = await respond(sim.url, body)
        assert status == 200
        rs, msg = r["output"]
        assert rs["type"] == "reasoning" and rs["id"].startswith("rs_") and rs["status"] is None
        assert rs["summary"] == [] and rs["encrypted_content"] is None
        assert len(rs["content"][0]["text"].split()) == 3 and rs["content"][0]["type"] == (
            "reasoning_text"
        )
        assert len(msg["content"][0]["text"].split()) == 2
        assert r["usage"]["output_tokens_details"]["reasoning_tokens"] == 3
        _, short = await respond(sim.url, {**body, "max_output_tokens": 2})
        assert [i["type"] for i in short["output"]] == ["reasoning"]  # no content, no message

        _, raw = await stream(sim.url + "/v1/responses", {**body, "stream": True})
        events = parse_events(raw)
        kinds = [e["type"] for e in events]
        assert kinds == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            *["response.reasoning_text.delta"] * 3,
            "response.reasoning_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.output_item.added",
            "response.content_part.added",
            *["response.output_text.delta"] * 2,
            "response.output_text.done",
            "response.content_part.done",
            "response.output_item.done",
            "response.completed",
        ]
        assert events[2]["item"]["content"] is None and events[3]["part"] == {
            "text": "",
            "type": "reasoning_text",
        }
        assert events[12]["output_index"] == 1
        final = events[-1]["response"]
        assert [i["status"] for i in final["output"]] == ["completed", "completed"]
        assert final["output"][0]["content"] == rs["content"]


async def test_faults_and_failed_kv_load() -> None:
    async with running(max_model_len=1024) as sim:
        url = sim.url + "/v1/responses"
        body = {"input": "hello", "max_output_tokens": 3, "stream": True}
        await post(sim.url + "/sim/faults", {"fail_next": 1, "status": 503})
        status, err = await post(url, body)
        assert status == 503 and err["error"]["code"] == 503
        await post(sim.url + "/sim/faults", {"error_next": 1, "error_after_chunks": 3})
        status, raw = await stream(url, body)
        events = parse_events(raw)
        assert status == 200 and [e["type"] for e in events][-1] == "error"
        assert events[-1] == {
            "code": "InternalServerError",
            "message": "Internal server error",
            "param": None,
            "sequence_number": 3,
            "type": "error",
        }
        await post(sim.url + "/sim/faults", {"drop_next": 1, "drop_after_chunks": 2})
        with pytest.raises(aiohttp.ClientError):  # the connection is cut
            await stream(url, body)
        # A handle to nothing: policy fail -> 500 JSON; streaming -> the connection is cut
        # after response.created / response.in_progress (vLLM 0.32).
        dead = {
            "do_remote_prefill": True,
            "remote_block_ids": [[1]],
            "remote_engine_id": "gone",
            "remote_request_id": "x",
            "remote_host": "127.0.0.1",
            "remote_port": 1,
        }
        status, err = await post(url, {**body, "stream": False, "kv_transfer_params": dead})
        assert status == 500 and err["error"]["type"] == "InternalServerError"
        with pytest.raises(aiohttp.ClientError):
            await stream(url, {**body, "kv_transfer_params": dead})


async def test_enable_response_messages_gives_prompt_and_output_token_ids(base: str) -> None:
    """vLLM's enable_response_messages (SimpleContext, 0.32 and 0.33): input_messages and
    output_messages as raw_message_tokens, in the body and in response.completed; null
    without it (measured on vLLM 0.32 CPU)."""
    body = {"input": MSGS, "max_output_tokens": 4, "enable_response_messages": True}
    status, r = await respond(base, body)
    assert status == 200
    [prompt] = r["input_messages"]
    [output] = r["output_messages"]
    assert list(prompt) == ["message", "tokens", "type"] and prompt["type"] == "raw_message_tokens"
    assert prompt["tokens"] == [BOS_ID, *await tokenize(base, MSGS)]
    assert len(prompt["tokens"]) == r["usage"]["input_tokens"]
    assert len(output["tokens"]) == 4 and output["message"] == output_text(r)
    status, raw = await stream(base + "/v1/responses", {**body, "stream": True})
    final = parse_events(raw)[-1]["response"]
    assert final["input_messages"] == r["input_messages"]
    assert final["output_messages"] == r["output_messages"]
    status, plain = await respond(base, {**body, "enable_response_messages": False})
    assert plain["input_messages"] is None and plain["output_messages"] is None


async def test_responses_render_is_the_prompt_the_route_computes() -> None:
    """/v1/responses/render (with --enable-scale-out): the ids the Responses route computes,
    for history items sent back as output items; the GenerateRequest's fields as vLLM's."""
    async with running(max_model_len=1024, enable_scale_out=True) as sim:
        items: list[dict[str, Any]] = [{"role": "user", "content": words(40, 3)}]
        body = {"input": items, "instructions": "be brief", "max_output_tokens": 6}
        _, r = await respond(sim.url, {**body, "enable_response_messages": True})
        items += [r["output"][0], {"role": "user", "content": "more"}]
        status, rendered = await post(sim.url + "/v1/responses/render", {**body, "input": items})
        assert status == 200 and rendered["request_id"].startswith("resp_")
        assert list(rendered)[:2] == ["request_id", "token_ids"]
        assert rendered["output_mode"] == "tokens" and rendered["features"] is None
        held = r["input_messages"][0]["tokens"] + r["output_messages"][0]["tokens"]
        assert rendered["token_ids"][: len(held)] == held
        _, r2 = await respond(sim.url, {**body, "input": items, "enable_response_messages": True})
        assert r2["input_messages"][0]["tokens"] == rendered["token_ids"]
