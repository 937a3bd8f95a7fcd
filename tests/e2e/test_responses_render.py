"""Responses turns verified token-exactly with P's /v1/responses/render (engines started with
--enable-scale-out, on both vLLM versions' shapes): multi-turn hits, partial reuse of an edited
answer, edited history refused, answers exact; and the item-digest fallback, learned once, on
engines that do not serve the route (vLLM's default: 403)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from harness.chat import client, get_json
from harness.metrics import metric
from tests.e2e.conftest import V032, Stack, pd_stack, pulled
from tests.e2e.helpers import INSTRUCTIONS, responses_reference, responses_turn

SCALE_OUT = ("--enable-scale-out",)
BLOCK = 16  # the simulator's default block size
RENDER = "/v1/responses/render"


@pytest.fixture(scope="module", params=["0.33", "0.32"])
def rendering(redis_url_session: str, request: pytest.FixtureRequest) -> Iterator[Stack]:
    """P, D and the reference engine serve the render routes."""
    version = () if request.param == "0.33" else V032
    with pd_stack(redis_url_session, "render", engines=[*SCALE_OUT, *version]) as st:
        yield st


def renders(url: str) -> float:
    return metric(url, "http_requests_total", handler=RENDER, status="2xx")


def reused(stack: Stack) -> float:
    return metric(stack.router.url, "kvbaton_kv_reused_tokens_total", source="decode_pull")


def first_turn(stack: Stack, cid: str, question: str) -> tuple[list[dict[str, Any]], int]:
    """Turn 1; the items with D's answer (its output item) and the tokens D holds."""
    items: list[dict[str, Any]] = [{"role": "user", "content": question}]
    api = client(stack.router.base_url)
    answer, reuse, completed = responses_turn(api, items, stream=False, cid=cid)
    assert reuse == "miss;reason=no-session" and answer == responses_reference(stack, items)
    usage = completed["usage"]
    # D's handle covers the prompt and the answer but its last token (not yet computed).
    return [*items, completed["output"][-1]], usage["input_tokens"] + usage["output_tokens"] - 1


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_a_responses_conversation_hits_verified_by_render(rendering: Stack, stream: bool) -> None:
    stack = rendering
    api = client(stack.router.base_url)
    cid = f"render-{uuid.uuid4().hex[:8]}"
    items: list[dict[str, Any]] = []
    for turn in range(1, 5):
        items.append({"role": "user", "content": f"Reading {turn} ({stream}): wind and rain?"})
        before, asked = pulled(stack.p.url), renders(stack.p.url)
        answer, reuse, completed = responses_turn(api, items, stream=stream, cid=cid)
        assert answer == responses_reference(stack, items), f"turn {turn}"
        # The router asked D for its token ids; the client, which did not, sees vLLM's null.
        assert completed["input_messages"] is None and completed["output_messages"] is None
        assert "kv_transfer_params" not in completed
        if turn == 1:
            assert reuse == "miss;reason=no-session"
        else:
            assert reuse == "hit", f"turn {turn}: {reuse}"
            assert renders(stack.p.url) == asked + 1, f"turn {turn}: verified by P's render"
            assert pulled(stack.p.url) > before, f"turn {turn}: P pulled nothing from D"
        # The answer sent back as the SDK hands it out (the output item) or as plain text.
        answered = {"role": "assistant", "content": answer}
        items.append(completed["output"][-1] if turn % 2 else answered)
    status = get_json(stack.router.url + "/status")
    p, d = status["instances"]["prefill"][0], status["instances"]["decode"][0]
    assert p["vllm"]["renders"] is True
    # A Responses stream always carries D's handle: it says nothing of D's chat streams.
    assert d["streams_params"] is False


def test_an_edited_answer_reuses_only_the_verified_prefix(rendering: Stack) -> None:
    stack = rendering
    cid = f"partial-{uuid.uuid4().hex[:8]}"
    items, held = first_turn(stack, cid, "Describe the coast road, mile by mile, in detail.")
    answer = items[-1]["content"][0]["text"]
    words = answer.split(" ")
    edited = " ".join([*words[: len(words) - 3], "tea", "tea", "tea"])
    items[-1] = {"role": "assistant", "content": edited}
    items.append({"role": "user", "content": "Thanks. And the inland road?"})
    before = reused(stack)
    text, reuse, _ = responses_turn(client(stack.router.base_url), items, stream=True, cid=cid)
    assert reuse == "hit"
    assert text == responses_reference(stack, items)
    got = reused(stack) - before
    assert 0 < got < held and got % BLOCK == 0, (got, held)
    # The same prompt again without any handle: P's prefix cache was not poisoned.
    again, reuse2, _ = responses_turn(
        client(stack.router.base_url), items, stream=False, cid=f"fresh-{uuid.uuid4().hex[:8]}"
    )
    assert reuse2 == "miss;reason=no-session" and again == text


def test_an_edited_earlier_item_is_a_prefix_mismatch(rendering: Stack) -> None:
    stack = rendering
    cid = f"edited-{uuid.uuid4().hex[:8]}"
    items, _ = first_turn(stack, cid, "What is the tide doing at the harbour?")
    items[0] = {"role": "user", "content": "What is the wind doing at the harbour?"}
    items.append({"role": "user", "content": "And at noon?"})
    before = pulled(stack.p.url)
    text, reuse, _ = responses_turn(client(stack.router.base_url), items, stream=False, cid=cid)
    assert reuse == "miss;reason=prefix-mismatch"
    assert text == responses_reference(stack, items)
    assert pulled(stack.p.url) == before


def test_a_client_that_asks_for_response_messages_gets_them(rendering: Stack) -> None:
    stack = rendering
    api = client(stack.router.base_url)
    items = [{"role": "user", "content": "Is the ferry running?"}]
    out = api.responses.create(
        model="sim-model",
        instructions=INSTRUCTIONS,
        input=items,  # type: ignore[arg-type]
        max_output_tokens=8,
        extra_body={
            "conversation_id": f"own-{uuid.uuid4().hex[:8]}",
            "enable_response_messages": True,
        },
    ).model_dump()
    [prompt] = out["input_messages"]
    assert prompt["type"] == "raw_message_tokens"
    assert len(prompt["tokens"]) == out["usage"]["input_tokens"]


def test_engines_without_render_keep_the_digest_check_and_are_asked_once(
    stock_responses: Stack,
) -> None:
    """vLLM's default (no --enable-scale-out): P answers the render route 403; the router
    learns it from that one answer and verifies the conversation by item digests."""
    stack = stock_responses
    api = client(stack.router.base_url)
    cid = f"norender-{uuid.uuid4().hex[:8]}"
    items: list[dict[str, Any]] = []
    refused = metric(stack.p.url, "http_requests_total", handler=RENDER, status="4xx")
    for turn in range(1, 4):
        items.append({"role": "user", "content": f"Forecast {turn}: any frost?"})
        answer, reuse, completed = responses_turn(api, items, stream=True, cid=cid)
        assert answer == responses_reference(stack, items)
        assert reuse == ("miss;reason=no-session" if turn == 1 else "hit"), turn
        items.append(completed["output"][-1])
    asked = metric(stack.p.url, "http_requests_total", handler=RENDER, status="4xx") - refused
    assert asked == 1, "tried once, learned from its 403, not asked every turn"
    p = get_json(stack.router.url + "/status")["instances"]["prefill"][0]
    assert p["vllm"]["renders"] is False
