"""vLLM's own session identity as the conversation id, end to end with the OpenAI SDK: a
conversation named only by the `X-Session-ID` header, or only by the `session_id` body field,
hits on turn 2, and both engines receive the header or the field as the client sent it."""

from __future__ import annotations

import json
import urllib.request
import uuid
from typing import Any

import openai
import pytest

from tests.e2e.conftest import Stack, pulled

pytestmark = pytest.mark.e2e


def sessions_seen(url: str) -> list[dict[str, Any]]:
    """What the simulator recorded of the session identity of its last requests."""
    with urllib.request.urlopen(url + "/sim/state", timeout=5) as resp:
        seen: list[dict[str, Any]] = json.loads(resp.read())["sessions"]
    return seen


def two_turns(api: openai.OpenAI, extra_body: dict[str, str] | None) -> list[str]:
    messages: list[Any] = [{"role": "user", "content": "Say something about tea and rain."}]
    reuse = []
    for content in ("And about the weather tomorrow?", None):
        raw = api.chat.completions.with_raw_response.create(
            model="sim-model", messages=messages, max_tokens=24, extra_body=extra_body
        )
        reuse.append(raw.headers["x-kv-reuse"])
        answer = raw.parse().choices[0].message.content or ""
        messages.append({"role": "assistant", "content": answer})
        if content:
            messages.append({"role": "user", "content": content})
    return reuse


def test_x_session_id_header_alone_identifies_the_conversation(stack: Stack) -> None:
    sid = f"vllm-session-{uuid.uuid4().hex[:10]}"
    api = openai.OpenAI(
        base_url=stack.router.base_url,
        api_key="k",
        max_retries=0,
        default_headers={"X-Session-ID": sid},
    )
    before = pulled(stack.p.url)
    assert two_turns(api, None) == ["miss;reason=no-session", "hit"]
    assert pulled(stack.p.url) > before  # P read turn 1's KV from D
    for engine in (stack.p, stack.d):
        mine = [s for s in sessions_seen(engine.url) if s["header"] == sid]
        assert len(mine) >= 2, f"{engine.url} got no X-Session-ID {sid}"
        assert all(s["body"] is None for s in mine)


def body_sessions(stack: Stack, sid: str) -> dict[str, list[dict[str, Any]]]:
    api = openai.OpenAI(base_url=stack.router.base_url, api_key="k", max_retries=0)
    assert two_turns(api, {"session_id": sid}) == ["miss;reason=no-session", "hit"]
    return {
        role: [s for s in sessions_seen(engine.url) if s["body"] == sid]
        for role, engine in (("prefill", stack.p), ("decode", stack.d))
    }


def test_session_id_body_field_alone_identifies_the_conversation(stack: Stack) -> None:
    seen = body_sessions(stack, f"vllm-session-{uuid.uuid4().hex[:10]}")
    assert len(seen["decode"]) == 2  # both D legs got the field untouched
    assert seen["prefill"] and seen["prefill"][0]["path"] == "/v1/chat/completions"
    assert all(s["header"] is None for s in seen["prefill"] + seen["decode"])


def test_vllm_xargs_session_id_alone_identifies_the_conversation(stack: Stack) -> None:
    """vLLM reads its session identity from `vllm_xargs["session_id"]` last; so does kvbaton."""
    api = openai.OpenAI(base_url=stack.router.base_url, api_key="k", max_retries=0)
    sid = f"vllm-xargs-{uuid.uuid4().hex[:10]}"
    assert two_turns(api, {"vllm_xargs": {"session_id": sid}}) == ["miss;reason=no-session", "hit"]


def test_session_id_body_field_reaches_p_on_the_token_ids_leg_too(stack: Stack) -> None:
    seen = body_sessions(stack, f"vllm-session-{uuid.uuid4().hex[:10]}")
    assert [s["path"] for s in seen["prefill"]] == ["/v1/chat/completions", "/v1/completions"]
