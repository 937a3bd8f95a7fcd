"""The OpenAI SDK holds multi-turn conversations through kvbaton: turns 2+ hit, P pulls the
prefix from D, and every answer equals the from-scratch answer of a fresh instance."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis

from harness.chat import chat_turn, client
from harness.metrics import metric
from tests.e2e.conftest import Stack, reference_chat
from tests.e2e.helpers import SYSTEM, checked_turn


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_five_turn_chat_hits_and_answers_exactly(stack: Stack, stream: bool) -> None:
    api = client(stack.router.base_url)
    cid = f"conv-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": f"{SYSTEM} Mode {stream}."}]
    for turn in range(1, 6):
        messages.append({"role": "user", "content": f"Question {turn}: is it going to rain today?"})
        checked_turn(stack, api, messages, turn, stream=stream, cid=cid)


def test_conversation_id_by_header(stack: Stack) -> None:
    cid = f"hdr-{uuid.uuid4().hex[:8]}"
    api = client(stack.router.base_url, default_headers={"X-Conversation-Id": cid})
    messages = [{"role": "user", "content": "Tell me about tea and the weather please."}]
    answer, reuse, _ = chat_turn(api, messages, stream=False, cid=None)
    assert reuse == "miss;reason=no-session"
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}]
    answer2, reuse2, _ = chat_turn(api, messages, stream=False, cid=None)
    assert reuse2 == "hit"
    assert answer2 == reference_chat(stack, messages, 24)


def test_without_conversation_id_starts_a_history_session(stack: Stack) -> None:
    api = client(stack.router.base_url)
    answer, reuse, _ = chat_turn(
        api, [{"role": "user", "content": "hello"}], stream=False, cid=None
    )
    assert reuse == "miss;reason=no-session"  # found by its history next turn (test_history)
    assert answer == reference_chat(stack, [{"role": "user", "content": "hello"}], 24)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_completions_conversation(stack: Stack, stream: bool) -> None:
    api = client(stack.router.base_url)
    ref = client(stack.ref.url + "/v1")
    cid = f"cmpl-{uuid.uuid4().hex[:8]}"
    prompt = "The weather report for the coming week says"
    for turn in range(1, 6):
        kwargs: dict[str, Any] = {
            "model": "sim-model",
            "prompt": prompt,
            "max_tokens": 24,
            "extra_body": {"conversation_id": cid},
        }
        if stream:
            with api.completions.with_streaming_response.create(stream=True, **kwargs) as resp:
                reuse = resp.headers["x-kv-reuse"]
                text = "".join(c.choices[0].text for c in resp.parse() if c.choices)
        else:
            raw = api.completions.with_raw_response.create(**kwargs)
            reuse, text = raw.headers["x-kv-reuse"], raw.parse().choices[0].text
        expected = ref.completions.create(model="sim-model", prompt=prompt, max_tokens=24)
        assert text == expected.choices[0].text
        assert reuse == ("miss;reason=no-session" if turn == 1 else "hit"), f"turn {turn}"
        prompt = prompt + text + f" and then on day {turn} it"


def test_session_is_readable_with_redis_cli_fields(stack: Stack) -> None:
    api = client(stack.router.base_url, api_key="tenant-a-key")
    cid = f"redis-{uuid.uuid4().hex[:8]}"
    chat_turn(api, [{"role": "user", "content": "Is it sunny?"}], stream=False, cid=cid)
    r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    keys = r.keys(f"kvbaton:conv:{{*:{cid}}}")
    assert len(keys) == 1
    fields = r.hgetall(keys[0])
    assert fields["turn"] == "1"
    assert fields["decode"] == stack.d.url
    assert fields["prefill"] == stack.p.url
    assert '"remote_engine_id"' in fields["kv_transfer_params"]
    assert int(fields["token_count"]) > 0
    assert 0 < r.ttl(keys[0]) <= 3600
    r.close()


def test_a_hit_asks_p_to_tokenize_once(stack: Stack) -> None:
    """P's /tokenize for a hit is sent during the claim and read by the prefix check: one
    request per hit, none on a first turn (nothing to verify yet)."""
    api = client(stack.router.base_url)
    cid = f"tok-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": f"{SYSTEM} Count."}]
    for turn in range(1, 4):
        messages.append({"role": "user", "content": f"Question {turn}: tea or coffee?"})
        before = tokenize_calls(stack.p.url)
        checked_turn(stack, api, messages, turn, cid=cid)
        assert tokenize_calls(stack.p.url) - before == (0 if turn == 1 else 1), f"turn {turn}"


def tokenize_calls(url: str) -> float:
    return metric(url, "http_requests_total", handler="/tokenize", status="2xx")
