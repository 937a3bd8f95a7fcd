"""The Responses API through kvbaton: streaming multi-turn reuse on stock engines (D's handle
rides in `response.completed`), never mixed with chat within a conversation."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from harness.chat import chat_turn, client
from tests.e2e.conftest import Stack, pulled
from tests.e2e.helpers import INSTRUCTIONS, responses_reference, responses_turn


@pytest.mark.parametrize("stream", [True, False], ids=["sse", "json"])
def test_four_turn_responses_conversation_hits(stock_responses: Stack, stream: bool) -> None:
    stack = stock_responses
    api = client(stack.router.base_url)
    cid = f"resp-{uuid.uuid4().hex[:8]}"
    items: list[dict[str, Any]] = []
    for turn in range(1, 5):
        items.append({"role": "user", "content": f"Reading {turn} ({stream}): wind and rain?"})
        before = pulled(stack.p.url)
        answer, reuse, completed = responses_turn(api, items, stream=stream, cid=cid)
        assert answer == responses_reference(stack, items), f"turn {turn}"
        assert "kv_transfer_params" not in completed
        if turn == 1:
            assert reuse == "miss;reason=no-session"
        else:
            assert reuse == "hit", f"turn {turn}: {reuse}"
            assert pulled(stack.p.url) > before, f"turn {turn}: P pulled nothing from D"
        # Send the answer back the way the SDK hands it out: the output message item.
        items.append(
            completed["output"][-1] if turn % 2 else {"role": "assistant", "content": answer}
        )


def test_chat_and_responses_never_share_a_handle(stock_responses: Stack) -> None:
    stack = stock_responses
    api = client(stack.router.base_url)
    cid = f"mix-{uuid.uuid4().hex[:8]}"
    messages = [
        {"role": "system", "content": INSTRUCTIONS},
        {"role": "user", "content": "Any fog this morning?"},
    ]
    answer, _, _ = chat_turn(api, messages, stream=False, cid=cid)
    items = [
        {"role": "user", "content": "Any fog this morning?"},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And tonight?"},
    ]
    before = pulled(stack.p.url)
    text, reuse, _ = responses_turn(api, items, stream=True, cid=cid)
    assert reuse == "miss;reason=api-mismatch"
    assert text == responses_reference(stack, items)
    assert pulled(stack.p.url) == before


def test_sdk_stream_helper_as_in_the_readme(stock_responses: Stack) -> None:
    stack = stock_responses
    api = client(stack.router.base_url)
    cid = f"readme-{uuid.uuid4().hex[:8]}"
    items: list[dict[str, Any]] = [{"role": "user", "content": "Plan a day in Lisbon."}]
    for _ in range(2):
        with api.responses.stream(
            model="sim-model",
            input=items,
            instructions=INSTRUCTIONS,  # type: ignore[arg-type]
            max_output_tokens=24,
            extra_body={"conversation_id": cid},
        ) as stream:
            deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
            answer = stream.get_final_response().output_text
        assert deltas == answer == responses_reference(stack, items)
        items += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And the evening?"},
        ]
