"""Bad input gets an OpenAI-format error with the right status, never a 500 and never a crash:
a table of known cases, and a property test over request bodies sent to a running router."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.chat import JSON, MODEL, Reply, get_json, post
from tests.reliability.conftest import MAX_BODY, TENANT_HEADER, Stack
from tests.reliability.helpers import assert_openai_error

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
RESPONSES = "/v1/responses"
MESSAGES = [{"role": "user", "content": "hello"}]


def chat(**fields: Any) -> bytes:
    return json.dumps({"model": MODEL, "messages": MESSAGES, "max_tokens": 2, **fields}).encode()


CASES: list[tuple[str, str, bytes, dict[str, str], int]] = [
    # (id, path, body, extra headers, status)
    ("malformed-json", CHAT, b'{"model": "sim-model", "messages": [', {}, 400),
    ("not-an-object", CHAT, b"[1, 2, 3]", {}, 400),
    ("invalid-utf8", CHAT, b'{"model": "\xff\xfe"}', {}, 400),
    ("number-out-of-range", CHAT, chat()[:-1] + b', "temperature": 1e999}', {}, 400),
    ("text-plain", CHAT, chat(), {"Content-Type": "text/plain"}, 415),
    ("form-encoded", CHAT, b"a=b", {"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ("too-large", CHAT, chat(pad="x" * (MAX_BODY + 1)), {}, 413),
    ("messages-missing", CHAT, json.dumps({"model": MODEL}).encode(), {}, 400),
    ("messages-string", CHAT, chat(messages="hello"), {}, 400),
    ("messages-empty", CHAT, chat(messages=[]), {}, 400),
    ("message-without-role", CHAT, chat(messages=[{"content": "x"}]), {}, 400),
    ("message-not-object", CHAT, chat(messages=["hello"]), {}, 400),
    ("stream-not-bool", CHAT, chat(stream="yes"), {}, 400),
    ("model-not-string", CHAT, chat(model=5), {}, 400),
    ("max-tokens-string", CHAT, chat(max_tokens="many"), {}, 400),
    ("max-tokens-negative", CHAT, chat(max_tokens=-1), {}, 400),
    ("n-2", CHAT, chat(n=2), {}, 400),
    ("unknown-model", CHAT, chat(model="gpt-17"), {}, 404),
    ("prompt-missing", COMPLETIONS, json.dumps({"model": MODEL}).encode(), {}, 400),
    (
        "prompt-batch",
        COMPLETIONS,
        json.dumps({"model": MODEL, "prompt": ["one", "two"]}).encode(),
        {},
        400,
    ),
    (
        "prompt-mixed",
        COMPLETIONS,
        json.dumps({"model": MODEL, "prompt": [1, "two"]}).encode(),
        {},
        400,
    ),
    (
        "prompt-n-3",
        COMPLETIONS,
        json.dumps({"model": MODEL, "prompt": "x", "n": 3}).encode(),
        {},
        400,
    ),
    ("responses-input-missing", RESPONSES, json.dumps({"model": MODEL}).encode(), {}, 400),
    (
        "responses-previous-id-unknown",
        RESPONSES,
        json.dumps({"model": MODEL, "input": "x", "previous_response_id": "resp_1"}).encode(),
        {},
        404,
    ),
    (
        "responses-previous-id-key-injection",
        RESPONSES,
        json.dumps({"model": MODEL, "input": "x", "previous_response_id": "}x{"}).encode(),
        {},
        400,
    ),
    (
        "responses-previous-id-and-conversation",
        RESPONSES,
        json.dumps(
            {"model": MODEL, "input": "x", "previous_response_id": "r", "conversation": "c"}
        ).encode(),
        {},
        400,
    ),
    (
        "responses-store-not-bool",
        RESPONSES,
        json.dumps({"model": MODEL, "input": "x", "store": 1}).encode(),
        {},
        400,
    ),
    # Conversation ids: length, characters, and Redis key injection (kvbaton:conv:{t:<id>}).
    ("cid-too-long", CHAT, chat(conversation_id="c" * 129), {}, 400),
    ("cid-empty", CHAT, chat(conversation_id=""), {}, 400),
    ("cid-closing-brace", CHAT, chat(conversation_id="a}b"), {}, 400),
    ("cid-opening-brace", CHAT, chat(conversation_id="{other:tenant}"), {}, 400),
    ("cid-glob", CHAT, chat(conversation_id="*"), {}, 400),
    ("cid-newline", CHAT, chat(conversation_id="a\nb"), {}, 400),
    ("cid-crlf-command", CHAT, chat(conversation_id="x\r\nFLUSHALL\r\n"), {}, 400),
    ("cid-space", CHAT, chat(conversation_id="a b"), {}, 400),
    ("cid-nul", CHAT, chat(conversation_id="a\u0000b"), {}, 400),
    ("cid-unicode", CHAT, chat(conversation_id="caf\u00e9"), {}, 400),
    ("cid-number", CHAT, chat(conversation_id=42), {}, 400),
    ("cid-object", CHAT, chat(conversation_id={"$ne": ""}), {}, 400),
    ("session-id-brace", CHAT, chat(session_id="a}b"), {}, 400),
    ("cid-header-brace", CHAT, chat(), {"X-Conversation-Id": "a}b"}, 400),
    ("cid-header-long", CHAT, chat(), {"X-Conversation-Id": "h" * 300}, 400),
    ("session-header-glob", CHAT, chat(), {"X-Session-ID": "*"}, 400),
]


@pytest.mark.parametrize(
    ("case", "path", "body", "headers", "status"), CASES, ids=[case[0] for case in CASES]
)
def test_bad_request_gets_an_openai_error(
    stack: Stack, case: str, path: str, body: bytes, headers: dict[str, str], status: int
) -> None:
    reply = post(stack.url + path, raw=body, headers={**JSON, **headers})
    error = assert_openai_error(reply, status)
    if case.startswith(("cid-", "session-")):
        assert error["param"] == "conversation_id", error


def test_router_survives_bad_input(stack: Stack) -> None:
    """After all of the above the router still serves, and nothing reached Redis unscoped."""
    reply = post(stack.url + CHAT, raw=chat(conversation_id="fine-id"), headers=JSON)
    assert reply.status == 200
    assert get_json(stack.url + "/health") == {"status": "ok"}


def test_deeply_nested_json_is_a_400(stack: Stack) -> None:
    depth = 20000  # 40 KB, under --max-body-bytes
    raw = b'{"model": "sim-model", "x": ' + b"[" * depth + b"]" * depth + b"}"
    assert len(raw) < MAX_BODY
    assert_openai_error(post(stack.url + CHAT, raw=raw, headers=JSON), 400)


@pytest.mark.parametrize(
    ("method", "path", "status"),
    [("GET", CHAT, 405), ("POST", "/v1/embeddings", 404)],
    ids=["wrong-method", "unknown-path"],
)
def test_unknown_routes_get_an_openai_error(
    stack: Stack, method: str, path: str, status: int
) -> None:
    reply = post(stack.url + path, raw=chat() if method == "POST" else None, method=method)
    assert_openai_error(reply, status)


# -- property test -----------------------------------------------------------------------------

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant", "system", "tool", "x"]) | json_values},
        optional={"content": st.text(max_size=30) | json_values, "name": json_values},
    ),
    max_size=3,
)
valid_ids = st.from_regex(r"[A-Za-z0-9._:@/+=-]{1,20}", fullmatch=True)
conversation_ids = valid_ids | st.text(max_size=140) | json_values
FIELDS: dict[str, st.SearchStrategy[Any]] = {
    "model": st.just(MODEL) | st.text(max_size=10) | json_values,
    "messages": messages | json_values,
    "prompt": st.text(max_size=30) | st.lists(st.integers(0, 300), max_size=8) | json_values,
    "max_tokens": st.integers(-2, 4) | json_values,
    "stream": st.booleans() | json_values,
    "n": st.just(1) | json_values,
    "stop": st.text(max_size=3) | json_values,
    "stream_options": st.just({"include_usage": True}) | json_values,
    "conversation_id": conversation_ids,
    "session_id": conversation_ids,
    "kv_transfer_params": json_values,
    "return_token_ids": st.booleans() | json_values,
    "min_tokens": st.integers(-1, 3) | json_values,
}
bodies = st.fixed_dictionaries({}, optional=FIELDS).flatmap(
    lambda known: st.dictionaries(st.text(max_size=12), json_values, max_size=3).map(
        lambda extra: {**extra, **known}
    )
)


def check_reply(reply: Reply) -> None:
    assert reply.status != 500, reply.body[:300]
    if reply.status >= 400:
        assert_openai_error(reply, reply.status)
    elif reply.headers.get("content-type", "").startswith("text/event-stream"):
        for data in reply.events():
            assert data == b"[DONE]" or isinstance(json.loads(data), dict)
    else:
        assert isinstance(json.loads(reply.body), dict)


@pytest.mark.timeout(120)
@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(path=st.sampled_from([CHAT, COMPLETIONS]), body=bodies, bearer=st.text(max_size=10))
def test_any_body_gets_a_well_formed_answer(
    stack: Stack, path: str, body: dict[str, Any], bearer: str
) -> None:
    headers = dict(JSON)
    if bearer.isprintable() and bearer.isascii():
        headers["Authorization"] = f"Bearer {bearer}"
        headers[TENANT_HEADER] = bearer
    check_reply(post(stack.url + path, body, headers=headers, timeout=30))
