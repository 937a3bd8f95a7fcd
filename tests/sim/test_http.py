"""The OpenAI surface: vLLM 0.32 body and SSE shapes, /tokenize, errors, /metrics."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.sim.client import get, metric, parse_sse, post, stream, tokenize, words

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": words(100, 30)}]


async def test_models_and_health(base: str) -> None:
    status, body = await get(base + "/v1/models")
    assert status == 200 and body["object"] == "list"
    model = body["data"][0]
    assert model["id"] == "sim-model" and model["max_model_len"] == 1024
    assert model["object"] == "model" and model["owned_by"] == "vllm"
    status, body = await get(base + "/health")
    assert status == 200 and body is None


async def test_chat_body_shape(base: str) -> None:
    status, body = await post(
        base + "/v1/chat/completions",
        {"model": "sim-model", "messages": MSGS, "max_tokens": 5},
        headers={"X-Request-Id": "req-1"},
    )
    assert status == 200
    assert list(body) == [
        "id",
        "object",
        "created",
        "model",
        "choices",
        "service_tier",
        "system_fingerprint",
        "usage",
        "prompt_logprobs",
        "prompt_token_ids",
        "kv_transfer_params",
    ]
    assert body["id"] == "chatcmpl-req-1" and body["object"] == "chat.completion"
    assert body["kv_transfer_params"] is None and body["prompt_token_ids"] is None
    choice = body["choices"][0]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert choice["token_ids"] is None
    assert choice["message"]["role"] == "assistant" and choice["message"]["reasoning"] is None
    assert len(choice["message"]["content"].split()) == 5
    prompt_len = len(await tokenize(base, MSGS))
    assert body["usage"] == {
        "prompt_tokens": prompt_len,
        "total_tokens": prompt_len + 5,
        "completion_tokens": 5,
        "prompt_tokens_details": {
            "cached_tokens": body["usage"]["prompt_tokens_details"]["cached_tokens"],
            "created_cache_tokens": 0,
            "multimodal_tokens": None,
        },
    }


async def test_chat_default_max_tokens_is_capped(base: str) -> None:
    status, body = await post(base + "/v1/chat/completions", {"messages": MSGS})
    assert status == 200 and body["usage"]["completion_tokens"] == 64


async def test_completions_shapes(base: str) -> None:
    url = base + "/v1/completions"
    status, body = await post(url, {"prompt": "the end", "return_token_ids": True})
    assert status == 200 and body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    choice = body["choices"][0]
    assert choice["prompt_token_ids"][0] == 0  # BOS, add_special_tokens defaults to true
    assert len(choice["token_ids"]) == 16  # vLLM's completions default max_tokens
    ids = choice["prompt_token_ids"]
    for prompt in (ids, [ids], ["the end"]):
        status, again = await post(url, {"prompt": prompt, "max_tokens": 16})
        assert status == 200 and again["choices"][0]["text"] == choice["text"]
    status, _ = await post(url, {"prompt": ["a", "b"]})
    assert status == 400


async def test_chat_stream_shape(base: str) -> None:
    body: dict[str, Any] = {"messages": MSGS, "max_tokens": 4}
    _, full = await post(base + "/v1/chat/completions", body)
    status, raw = await stream(
        base + "/v1/chat/completions",
        {**body, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert status == 200
    events = parse_sse(raw)
    assert events[-1] == "[DONE]"
    first, *tokens, usage = events[:-1]
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]
    assert len(tokens) == 4
    assert all(t["choices"][0]["finish_reason"] is None for t in tokens[:-1])
    assert tokens[-1]["choices"][0]["finish_reason"] == "length"
    # vLLM 0.33 (the default): every content chunk carries the key, null here (no
    # bidirectional_kv_xfer: D returns no params); the role and usage chunks do not.
    assert all("kv_transfer_params" in t and t["kv_transfer_params"] is None for t in tokens)
    assert "kv_transfer_params" not in first and "kv_transfer_params" not in usage
    text = "".join(t["choices"][0]["delta"]["content"] for t in tokens)
    assert text == full["choices"][0]["message"]["content"]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4
    assert "multimodal_tokens" not in usage["usage"]["prompt_tokens_details"]
    assert {e["id"] for e in events[:-1]} == {first["id"]}


async def test_completions_stream_shape(base: str) -> None:
    status, raw = await stream(
        base + "/v1/completions",
        {"prompt": "water", "max_tokens": 3, "stream": True, "return_token_ids": True},
    )
    events = parse_sse(raw)
    assert status == 200 and events[-1] == "[DONE]" and len(events) == 4
    assert events[0]["object"] == "text_completion"
    assert events[0]["choices"][0]["prompt_token_ids"] == [
        0,
        *events[0]["choices"][0]["prompt_token_ids"][1:],
    ]
    assert events[1]["choices"][0]["prompt_token_ids"] is None
    assert all(len(e["choices"][0]["token_ids"]) == 1 for e in events[:-1])
    assert events[2]["choices"][0]["finish_reason"] == "length"


async def test_return_token_ids_match_tokenize(base: str) -> None:
    ids = await tokenize(base, MSGS)
    body = {"messages": MSGS, "max_tokens": 6, "return_token_ids": True}
    _, full = await post(base + "/v1/chat/completions", body)
    assert full["prompt_token_ids"] == ids
    out = full["choices"][0]["token_ids"]
    assert len(out) == 6
    _, raw = await stream(base + "/v1/chat/completions", {**body, "stream": True})
    events = parse_sse(raw)[:-1]
    assert events[0]["prompt_token_ids"] == ids
    assert [t for e in events[1:] for t in e["choices"][0]["token_ids"]] == out
    # The toy model's text re-tokenizes to its own ids (clients can send it back).
    content = full["choices"][0]["message"]["content"]
    history = [*MSGS, {"role": "assistant", "content": content}]
    ids2 = await tokenize(base, history)
    assert ids2[: len(ids) + len(out)] == ids + out


async def test_tokenize_prompt_and_messages(base: str) -> None:
    status, body = await post(base + "/tokenize", {"prompt": "the end"})
    assert status == 200
    assert body["count"] == len(body["tokens"]) == 3 and body["tokens"][0] == 0
    assert body["max_model_len"] == 1024 and body["token_strs"] is None
    status, body = await post(
        base + "/tokenize", {"prompt": "the end", "add_special_tokens": False}
    )
    assert body["count"] == 2


async def test_stop_strings(base: str) -> None:
    body: dict[str, Any] = {"messages": MSGS, "max_tokens": 10}
    _, full = await post(base + "/v1/chat/completions", body)
    words_ = full["choices"][0]["message"]["content"].split()
    stop = " " + words_[3]
    expected = " " + " ".join(words_[: words_.index(words_[3])])
    _, cut = await post(base + "/v1/chat/completions", {**body, "stop": [stop]})
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert choice["message"]["content"] == expected
    _, raw = await stream(base + "/v1/chat/completions", {**body, "stop": stop, "stream": True})
    events = parse_sse(raw)[:-1]
    assert "".join(e["choices"][0]["delta"]["content"] for e in events) == expected
    assert events[-1]["choices"][0]["finish_reason"] == "stop"
    _, late = await post(base + "/v1/chat/completions", {**body, "stop": stop, "min_tokens": 8})
    assert late["choices"][0]["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({}, 400, "messages"),
        ({"messages": "hi"}, 400, "messages"),
        ({"messages": MSGS, "max_tokens": "5"}, 400, "max_tokens"),
        ({"messages": MSGS, "stream_options": {"include_usage": True}}, 400, "stream_options"),
        ({"messages": MSGS, "max_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
        ({"messages": MSGS, "max_tokens": 5000}, 400, "max_tokens"),
        ({"messages": [{"role": "user", "content": words(1, 1100)}]}, 400, "messages"),
        ({"messages": MSGS, "n": 2}, 400, "n"),
        ({"messages": MSGS, "stop": 3}, 400, "stop"),
        ({"messages": MSGS, "model": "other"}, 404, "model"),
    ],
)
async def test_invalid_requests(base: str, body: dict[str, Any], status: int, param: str) -> None:
    got, err = await post(base + "/v1/chat/completions", body)
    assert got == status
    assert set(err["error"]) == {"message", "type", "param", "code"}
    assert err["error"]["code"] == status and err["error"]["param"] == param
    assert err["error"]["type"] == ("NotFoundError" if status == 404 else "BadRequestError")


async def test_bad_json_and_content_type(base: str) -> None:
    url = base + "/v1/chat/completions"
    status, err = await post(url, None, raw=b"{nope", headers={"Content-Type": "application/json"})
    assert status == 400 and err["error"]["type"] == "BadRequestError"
    status, err = await post(url, None, raw=b"{}", headers={"Content-Type": "text/plain"})
    assert status == 415 and err["error"]["code"] == 415
    assert "application/json" in err["error"]["message"]


async def test_http_requests_by_route_and_status_class(base: str) -> None:
    """vLLM's HTTP instrumentator: a sample per route template, method and status class;
    /metrics and /health are not counted, unknown paths are `handler="none"`."""

    async def count(handler: str, status: str, method: str = "POST") -> float:
        try:
            return await metric(
                base, "http_requests_total", handler=handler, method=method, status=status
            )
        except KeyError:
            return 0.0

    before = {
        "chat": await count("/v1/chat/completions", "2xx"),
        "bad": await count("/v1/completions", "4xx"),
        "none": await count("none", "4xx", "GET"),
    }
    await post(base + "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2})
    await post(base + "/v1/completions", {"prompt": [], "max_tokens": 2})
    await get(base + "/no/such/path")
    await get(base + "/health")
    assert await count("/v1/chat/completions", "2xx") == before["chat"] + 1
    assert await count("/v1/completions", "4xx") == before["bad"] + 1
    assert await count("none", "4xx", "GET") == before["none"] + 1
    assert await count("/health", "2xx", "GET") == 0
    assert await count("/metrics", "2xx", "GET") == 0


async def test_metrics_names(base: str) -> None:
    await post(base + "/v1/chat/completions", {"messages": MSGS, "max_tokens": 2})
    _, text = await get(base + "/metrics")
    for name in (
        "vllm:prompt_tokens_by_source_total",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:external_prefix_cache_queries_total",
        "vllm:external_prefix_cache_hits_total",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:nixl_num_failed_transfers_total",
        "vllm:nixl_num_kv_expired_reqs_total",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm_sim:blocks_pinned_total",
    ):
        assert f'{name}{{engine="0",model_name="sim-model"' in text, name
    assert await metric(base, "vllm:cache_config_info", block_size="16") == 1.0
    assert await metric(base, "vllm:generation_tokens_total") >= 2
    # As vLLM's API server (prometheus_client's process collector): a restart changes it.
    started = await metric(base, "process_start_time_seconds")
    assert 0 < time.time() - started < 600


async def test_reset_prefix_cache_and_state(base: str) -> None:
    body = {"messages": MSGS, "max_tokens": 1}
    await post(base + "/v1/chat/completions", body)
    _, again = await post(base + "/v1/chat/completions", body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    status, _ = await post(base + "/reset_prefix_cache", {})
    assert status == 200
    _, after = await post(base + "/v1/chat/completions", body)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    status, state = await get(base + "/sim/state")
    assert status == 200 and state["block_size"] == 16 and state["pins"] == []
    assert state["blocks"]["total"] == 4096 and "api_key" not in state["settings"]
