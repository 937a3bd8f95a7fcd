"""Client body -> P body / D body, as tables. Inputs are checked to be left untouched."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from router.connectors.nixl.params import miss_params
from router.turn.rewrite import (
    ROUTER_FIELDS,
    client_wants_token_ids,
    decode_body,
    prefill_body,
    split_client_body,
)

CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 200,
    "max_completion_tokens": 150,
    "min_tokens": 5,
    "min_completion_tokens": 5,
    "temperature": 0.0,
    "n": 1,
    "session_id": "s-1",
}
COMPLETIONS = {"model": "m", "prompt": "once upon", "stream": False, "max_tokens": 64, "n": 2}
RESPONSES = {"model": "m", "input": "hi", "stream": True, "max_output_tokens": 300}
HANDLE = {"do_remote_decode": True, "remote_block_ids": [[1, 2]], "remote_engine_id": "d"}


def test_router_fields() -> None:
    assert ROUTER_FIELDS == ("conversation_id",)


@pytest.mark.parametrize(
    ("body", "forward", "conversation_id"),
    [
        ({"model": "m"}, {"model": "m"}, None),
        ({"model": "m", "conversation_id": "c1"}, {"model": "m"}, "c1"),
        ({"conversation_id": 7, "x": 1}, {"x": 1}, 7),  # returned unvalidated
        ({"conversation_id": None}, {}, None),
        ({"kv_transfer_params": HANDLE, "model": "m"}, {"model": "m"}, None),
        ({"kv_transfer_params": None, "session_id": "s"}, {"session_id": "s"}, None),
        (CHAT, CHAT, None),
    ],
)
def test_split_client_body(
    body: dict[str, Any], forward: dict[str, Any], conversation_id: object
) -> None:
    before = copy.deepcopy(body)
    out, cid = split_client_body(body)
    assert (out, cid) == (forward, conversation_id)
    assert out is not body
    assert body == before


@pytest.mark.parametrize(
    ("body", "api", "changed", "removed"),
    [
        (
            CHAT,
            "chat",
            {"stream": False, "max_tokens": 1, "max_completion_tokens": 1},
            {"stream_options", "min_tokens", "min_completion_tokens"},
        ),
        (
            {"messages": [], "stream": True},
            "chat",
            {"stream": False, "max_tokens": 1},
            set(),
        ),
        (COMPLETIONS, "completions", {"stream": False, "max_tokens": 1}, set()),
        (
            {"prompt": [1, 2], "min_tokens": 3, "stream_options": None},
            "completions",
            {"stream": False, "max_tokens": 1},
            {"min_tokens", "stream_options"},
        ),
        (RESPONSES, "responses", {"stream": False, "max_output_tokens": 1}, set()),
    ],
)
def test_prefill_body(
    body: dict[str, Any], api: str, changed: dict[str, Any], removed: set[str]
) -> None:
    before = copy.deepcopy(body)
    kv = miss_params()
    out = prefill_body(body, kv, api=api)
    expected = {k: v for k, v in body.items() if k not in removed}
    expected.update(changed)
    expected["kv_transfer_params"] = kv
    assert out == expected
    assert out["kv_transfer_params"] is not kv
    assert body == before
    if api == "responses":
        assert "max_tokens" not in out
    else:
        assert "max_output_tokens" not in out


def test_prefill_body_keeps_n_and_overrides_client_kv() -> None:
    out = prefill_body({"n": 3, "kv_transfer_params": {"evil": 1}}, HANDLE, api="chat")
    assert out["n"] == 3
    assert out["kv_transfer_params"] == HANDLE


def test_prefill_body_rejects_unknown_api() -> None:
    with pytest.raises(ValueError, match="unknown api"):
        prefill_body(CHAT, HANDLE, api="embeddings")


@pytest.mark.parametrize(
    ("body", "kv", "token_ids", "expected"),
    [
        (CHAT, None, False, CHAT),
        (CHAT, HANDLE, False, {**CHAT, "kv_transfer_params": HANDLE}),
        (CHAT, None, True, {**CHAT, "return_token_ids": True}),
        (
            {**COMPLETIONS, "return_token_ids": True},
            HANDLE,
            False,
            {**COMPLETIONS, "return_token_ids": True, "kv_transfer_params": HANDLE},
        ),
        (
            {**COMPLETIONS, "return_token_ids": False},
            None,
            True,
            {**COMPLETIONS, "return_token_ids": True},
        ),
        ({"kv_transfer_params": {"stale": 1}, "x": 1}, None, False, {"x": 1}),
        ({"kv_transfer_params": {"stale": 1}}, HANDLE, False, {"kv_transfer_params": HANDLE}),
        (RESPONSES, HANDLE, False, {**RESPONSES, "kv_transfer_params": HANDLE}),
    ],
)
def test_decode_body(
    body: dict[str, Any], kv: dict[str, Any] | None, token_ids: bool, expected: dict[str, Any]
) -> None:
    before = copy.deepcopy(body)
    out = decode_body(body, kv, return_token_ids=token_ids)
    assert out == expected
    assert out is not body
    if kv is not None:
        assert out["kv_transfer_params"] is not kv
    assert body == before


def test_a_responses_decode_leg_asks_for_token_ids_its_own_way() -> None:
    """vLLM's ResponsesRequest has no return_token_ids: enable_response_messages brings the
    prompt's and the output's ids (input_messages/output_messages)."""
    out = decode_body(RESPONSES, HANDLE, return_token_ids=True, api="responses")
    assert out == {**RESPONSES, "kv_transfer_params": HANDLE, "enable_response_messages": True}
    assert client_wants_token_ids({"enable_response_messages": True}, "responses")
    assert not client_wants_token_ids({"return_token_ids": True}, "responses")


@pytest.mark.parametrize(
    ("body", "wants"),
    [
        ({}, False),
        ({"return_token_ids": True}, True),
        ({"return_token_ids": False}, False),
        ({"return_token_ids": None}, False),
        ({"return_token_ids": "yes"}, False),
    ],
)
def test_client_wants_token_ids(body: dict[str, Any], wants: bool) -> None:
    assert client_wants_token_ids(body) is wants
