"""The client's request: content type, size, JSON, fields, identity."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.errors import BadRequest, NotFound, PayloadTooLarge, RouterError, UnsupportedMediaType
from router.turn.incoming import Accepts, Api, check_depth, read_incoming

JSON = {"content-type": "application/json"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}


def read(
    body: Any,
    headers: dict[str, str] | None = None,
    api: Api = "chat",
    max_bytes: int = 10_000,
    tenant_header: str = "",
    keep_responses: bool = True,
) -> Any:
    raw = body if isinstance(body, bytes) else msgspec.json.encode(body)
    return read_incoming(
        raw,
        JSON if headers is None else headers,
        api,
        Accepts("m", max_bytes, tenant_header, keep_responses=keep_responses),
    )


def test_chat_strips_router_fields_and_client_handles() -> None:
    inc = read(
        {
            **CHAT,
            "conversation_id": "c-1",
            "kv_transfer_params": {"remote_block_ids": [[1]]},
            "stream": True,
        }
    )
    assert inc.conversation_id == "c-1"
    assert "conversation_id" not in inc.body
    assert "kv_transfer_params" not in inc.body
    assert inc.stream is True
    assert inc.tenant == "default"


def test_header_conversation_id_and_tenants() -> None:
    inc = read(CHAT, {**JSON, "x-conversation-id": "abc", "authorization": "Bearer k1"})
    other = read(CHAT, {**JSON, "x-conversation-id": "abc", "authorization": "Bearer k2"})
    assert inc.conversation_id == other.conversation_id == "abc"
    assert inc.tenant != other.tenant != "default"
    by_header = read(CHAT, {**JSON, "x-org": "acme"}, tenant_header="x-org")
    assert by_header.tenant not in ("default", inc.tenant)


@pytest.mark.parametrize(
    ("body", "headers", "error", "match"),
    [
        (CHAT, {"content-type": "text/plain"}, UnsupportedMediaType, "application/json"),
        (CHAT, {}, UnsupportedMediaType, "application/json"),
        (b"{nope", JSON, BadRequest, "not valid JSON"),
        (b"[1, 2]", JSON, BadRequest, "JSON object"),
        (b"x" * 20_000, JSON, PayloadTooLarge, "limit"),
        ({"model": "m"}, JSON, BadRequest, "messages"),
        ({"messages": []}, JSON, BadRequest, "messages"),
        ({"messages": ["hi"]}, JSON, BadRequest, "messages\\[0\\]"),
        ({**CHAT, "stream": "yes"}, JSON, BadRequest, "stream"),
        ({**CHAT, "n": 2}, JSON, BadRequest, "n=1"),
        ({**CHAT, "model": 5}, JSON, BadRequest, "model"),
        ({**CHAT, "model": "other"}, JSON, NotFound, "other"),
        ({**CHAT, "conversation_id": "a{b}"}, JSON, BadRequest, "conversation_id"),
        ({**CHAT, "conversation_id": "x" * 500}, JSON, BadRequest, "conversation_id"),
        ({**CHAT, "conversation_id": 7}, JSON, BadRequest, "conversation_id"),
    ],
)
def test_bad_input_is_a_clear_error(
    body: Any, headers: dict[str, str], error: type[RouterError], match: str
) -> None:
    with pytest.raises(error, match=match) as info:
        read(body, headers)
    assert info.value.status in (400, 404, 413, 415)


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [("hello", "hello"), (["hello"], "hello"), ([1, 2, 3], [1, 2, 3]), ([[4, 5]], [4, 5])],
)
def test_completions_prompt_forms(prompt: Any, expected: Any) -> None:
    inc = read({"prompt": prompt}, api="completions")
    assert inc.prompt == expected


@pytest.mark.parametrize("prompt", [["a", "b"], None, 5, [], [1, "a"]])
def test_completions_batches_and_junk_are_refused(prompt: Any) -> None:
    with pytest.raises(BadRequest, match="prompt"):
        read({"prompt": prompt}, api="completions")


def test_token_id_request_flag() -> None:
    assert read({**CHAT, "return_token_ids": True}).wants_token_ids
    assert not read(CHAT).wants_token_ids


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["hi"]}, "input"),
        ({"input": "hi", "previous_response_id": "a}b"}, "previous_response_id"),
        ({"input": "hi", "previous_response_id": ""}, "previous_response_id"),
        ({"input": "hi", "previous_response_id": 7}, "previous_response_id"),
        ({"input": "hi", "previous_response_id": "r", "conversation": "c"}, "together"),
        ({"input": "hi", "store": "yes"}, "store"),
        ({"input": "hi", "conversation": {"name": "c"}}, "conversation"),
        ({"input": "hi", "conversation": "a b"}, "conversation_id"),
    ],
)
def test_responses_refusals(body: dict[str, Any], match: str) -> None:
    with pytest.raises(BadRequest, match=match):
        read(body, api="responses")


def test_previous_response_id_needs_the_store() -> None:
    body = {"input": "hi", "previous_response_id": "resp_1"}
    with pytest.raises(BadRequest, match="--response-ttl 0"):
        read(body, api="responses", keep_responses=False)


@pytest.mark.parametrize(
    ("store", "keeping", "kept"),
    [(None, True, True), (True, True, True), (False, True, False), (True, False, False)],
)
def test_store_defaults_to_true_when_the_router_keeps_responses(
    store: bool | None, keeping: bool, kept: bool
) -> None:
    body: dict[str, Any] = {"input": "hi", **({} if store is None else {"store": store})}
    inc = read(body, api="responses", keep_responses=keeping)
    assert inc.store is kept
    assert inc.body["store"] is False  # the engines never keep a response themselves


def test_state_fields_are_read_and_not_forwarded() -> None:
    body = {"input": "hi", "previous_response_id": "resp_1", "prompt_cache_key": "k"}
    inc = read(body, api="responses")
    assert inc.previous_response_id == "resp_1"
    assert "previous_response_id" not in inc.body
    assert inc.body["prompt_cache_key"] == "k"  # forwarded untouched
    assert inc.conversation_id == "k"
    inc = read({"input": "hi", "conversation": {"id": "conv_1"}}, api="responses")
    assert (inc.conversation_id, inc.named) == ("conv_1", True)
    assert "conversation" not in inc.body


@pytest.mark.parametrize(
    ("body", "headers", "expected"),
    [
        ({"conversation_id": "a", "conversation": "b", "prompt_cache_key": "c"}, {}, "a"),
        ({"conversation": "b", "prompt_cache_key": "c"}, {"x-conversation-id": "h"}, "h"),
        ({"conversation": "b", "prompt_cache_key": "c", "session_id": "s"}, {}, "b"),
        ({"prompt_cache_key": "c", "session_id": "s"}, {"x-session-id": "x"}, "c"),
        ({}, {}, None),
    ],
)
def test_session_key_precedence(
    body: dict[str, Any], headers: dict[str, str], expected: str | None
) -> None:
    inc = read({"input": "hi", **body}, {**JSON, **headers}, api="responses")
    assert inc.conversation_id == expected
    assert inc.named is (expected is not None)


def test_chat_prompt_cache_key_names_the_session() -> None:
    inc = read({**CHAT, "prompt_cache_key": "pk-1"})
    assert (inc.conversation_id, inc.body["prompt_cache_key"]) == ("pk-1", "pk-1")


def test_responses_items_and_canonical_form() -> None:
    from router.turn.incoming import canonical_items

    inc = read({"input": "hello", "instructions": "be brief", "store": False}, api="responses")
    assert inc.items == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello"},
    ]
    echoed = read(
        {
            "input": [
                {"role": "user", "content": "hello"},
                {
                    "type": "message",
                    "id": "msg_1",
                    "status": "completed",
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": " hi there", "annotations": []}],
                },
                {"type": "function_call_output", "id": "x", "call_id": "c", "output": "{}"},
            ]
        },
        api="responses",
    )
    plain = read(
        {
            "input": [
                {"role": "user", "content": "hello"},
                {"role": "assistant", "content": " hi there"},
                {"type": "function_call_output", "call_id": "c", "output": "{}"},
            ]
        },
        api="responses",
    )
    assert canonical_items(echoed) == canonical_items(plain)
    two_parts = read(
        {
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "a"},
                        {"type": "input_text", "text": "b"},
                    ],
                }
            ]
        },
        api="responses",
    )
    assert canonical_items(two_parts)[0]["content"] != "ab"


def test_depth_limit_is_checked_without_recursion() -> None:
    import pytest as _pytest

    from router.errors import BadRequest
    from router.turn.incoming import MAX_JSON_DEPTH, decode_json

    ok = b'{"x": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert decode_json(ok, 1 << 20)
    deep = b'{"x": ' + b"[" * 990 + b"]" * 990 + b"}"
    with _pytest.raises(BadRequest):
        decode_json(deep, 1 << 20)


def _nested(levels: int, inner: Any = "x") -> Any:
    """`levels` containers deep, objects and arrays by turns, each with a plain sibling."""
    value = inner
    for level in range(levels):
        value = {"k": value, "s": "v"} if level % 2 else [1, value, None]
    return value


@pytest.mark.parametrize("levels", [2, 3, 7, 8])
def test_check_depth_counts_objects_and_arrays_to_the_limit(levels: int) -> None:
    check_depth(_nested(levels), levels)  # exactly at the limit: fine
    with pytest.raises(BadRequest, match=f"nested more than {levels - 1} levels"):
        check_depth(_nested(levels), levels - 1)
    # The deepest of several branches counts, wherever it is (an object, an array, then it).
    check_depth({"a": _nested(1), "b": [_nested(levels - 2)], "c": 3}, levels)
    with pytest.raises(BadRequest):
        check_depth({"a": _nested(1), "b": [_nested(levels - 1)], "c": 3}, levels)
