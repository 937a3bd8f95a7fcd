"""The prefix guard: edited history, regenerated turns and changed system prompts never read
D's KV; a late divergence reuses only the verified block-aligned prefix; answers stay exact
and P's prefix cache is never poisoned."""

from __future__ import annotations

import uuid

import pytest

from harness.chat import chat_turn, client
from harness.metrics import metric
from harness.procs import wait_until
from harness.router import router
from tests.e2e.conftest import Stack, p_route_calls, pulled, reference_chat
from tests.e2e.helpers import SYSTEM


def two_turns(stack: Stack, cid: str) -> list[dict[str, str]]:
    """Turn 1 of a conversation; returns the history including D's answer."""
    api = client(stack.router.base_url)
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "What is the weather like in the hills this morning?"},
    ]
    answer, reuse, _ = chat_turn(api, messages, stream=False, cid=cid, max_tokens=40)
    assert reuse == "miss;reason=no-session"
    return [*messages, {"role": "assistant", "content": answer}]


@pytest.mark.parametrize("edit", ["system", "first-user", "regenerate"])
def test_edited_history_is_a_prefix_mismatch(stack: Stack, edit: str) -> None:
    cid = f"edit-{uuid.uuid4().hex[:8]}"
    history = two_turns(stack, cid)
    if edit == "system":
        messages = [{"role": "system", "content": "You are verbose."}, *history[1:]]
        messages.append({"role": "user", "content": "And tomorrow?"})
    elif edit == "first-user":
        messages = [history[0], {"role": "user", "content": "Different question."}, history[2]]
        messages.append({"role": "user", "content": "And tomorrow?"})
    else:
        messages = history[:2]  # regenerate: the same prompt again
    before = pulled(stack.p.url)
    answer, reuse, _ = chat_turn(
        client(stack.router.base_url), messages, stream=False, cid=cid, max_tokens=40
    )
    assert reuse == "miss;reason=prefix-mismatch"
    assert answer == reference_chat(stack, messages, 40)
    assert pulled(stack.p.url) == before


def test_late_divergence_reuses_only_the_verified_prefix(stack: Stack) -> None:
    cid = f"late-{uuid.uuid4().hex[:8]}"
    history = two_turns(stack, cid)
    words = history[2]["content"].split(" ")
    edited = " ".join([*words[: len(words) - 3], "tea", "tea", "tea"])
    messages = [
        *history[:2],
        {"role": "assistant", "content": edited},
        {"role": "user", "content": "Thanks. And in the evening?"},
    ]
    calls = p_route_calls(stack.p.url)
    answer, reuse, _ = chat_turn(
        client(stack.router.base_url), messages, stream=False, cid=cid, max_tokens=40
    )
    assert reuse == "hit"
    assert answer == reference_chat(stack, messages, 40)
    assert p_route_calls(stack.p.url) == (calls[0], calls[1] + 1)  # the verified ids
    # The same prompt again, without any handle: P's prefix cache must not be poisoned.
    again, reuse2, _ = chat_turn(
        client(stack.router.base_url), messages, stream=False, cid=None, max_tokens=40
    )
    assert reuse2 == "miss;reason=no-session"  # nothing indexes this history
    assert again == answer


def test_a_prefix_mismatch_found_by_tokens_sends_p_the_body(stack: Stack) -> None:
    """/tokenize ran but did not verify enough of D's tokens (here: fewer than
    --min-reuse-tokens): the ids it gave are not proven to render as P's chat route does,
    so P gets the client's body, not the ids."""
    with router(
        [stack.p.url], [stack.d.url], "--min-reuse-tokens", "100000", redis_url=stack.redis_url
    ) as r:
        cid = f"floor-{uuid.uuid4().hex[:8]}"
        api = client(r.base_url)
        messages = [{"role": "user", "content": "Is the pass open after the snow?"}]
        answer, _, _ = chat_turn(api, messages, stream=False, cid=cid)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "?"}]
        calls = p_route_calls(stack.p.url)
        answer, reuse, _ = chat_turn(api, messages, stream=False, cid=cid)
        assert reuse == "miss;reason=prefix-mismatch"
        assert answer == reference_chat(stack, messages, 24)
        # P's chat route got the body; its /v1/completions only the release of the handle
        # this turn took and did not read (a one-token read-nothing request: D frees it).
        wait_until(lambda: released(r.url) == 1, "the unread handle released", 10)
        assert p_route_calls(stack.p.url) == (calls[0] + 1, calls[1] + 1)


def released(router_url: str) -> float:
    return metric(router_url, "kvbaton_pin_releases_total", reason="superseded")


def test_reasoning_template_is_caught_by_tokens(stack_reasoning: Stack) -> None:
    """A template that drops reasoning from history (vllm#43094): the digest matches, the
    tokens do not; only the verified prefix counts (the prompt P computed on the last turn,
    so nothing is read: tests/e2e/test_what_moved.py) and the answer stays exact."""
    stack = stack_reasoning
    api = client(stack.router.base_url)
    cid = f"think-{uuid.uuid4().hex[:8]}"
    messages = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Will it rain on the tea fields tonight?"},
    ]
    for turn in range(1, 4):
        answer, reuse, _ = chat_turn(api, messages, stream=False, cid=cid, max_tokens=40)
        assert answer == reference_chat(stack, messages, 40), f"turn {turn}"
        if turn > 1:  # verified: the prompt P computed on the last turn, which it holds
            assert reuse == "hit;via=prefill-cache", f"turn {turn}: {reuse}"
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"And after {turn} hours?"},
        ]
