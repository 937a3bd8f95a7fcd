"""A context that cannot fit (issue 32, item 4): a prompt plus `max_tokens` over D's
max_model_len is refused before P (which would pin the prompt's blocks for a D that then
refuses it), known from the hit's own token count, a byte bound, or P's /tokenize near the
limit; and when the router could not know, D's refusal frees what P pinned at once."""

from __future__ import annotations

import json
from typing import Any

import pytest

from harness.chat import JSON, MODEL, post
from harness.metrics import metric
from harness.procs import wait_until
from tests.reliability.conftest import ENGINE_KEY, Stack
from tests.reliability.helpers import Conversation, assert_openai_error, new_cid, router

MAX_MODEL_LEN = 8192  # the simulators' default
AUTH = {**JSON, "Authorization": f"Bearer {ENGINE_KEY}"}


def prompt_tokens(stack: Stack, messages: list[dict[str, str]]) -> int:
    """The prompt's length as the engines count it (P's own /tokenize)."""
    body = {"model": MODEL, "messages": messages, "add_generation_prompt": True}
    reply = post(stack.p.url + "/tokenize", body, headers=AUTH)
    assert reply.status == 200, reply.body
    count: int = reply.json()["count"]
    return count


def work(stack: Stack) -> tuple[float, float]:
    """Prompt tokens every engine computed, and the blocks the P's pin for a D."""
    engines = [*stack.ps, *stack.ds]
    computed = sum(metric(e.url, "vllm:prompt_tokens_total") for e in engines)
    pinned = sum(metric(e.url, "vllm_sim:pinned_blocks") for e in stack.ps)
    return computed, pinned


def words(count: int) -> str:
    return " ".join(["the", "of", "and", "to"][i % 4] for i in range(count))  # one token each


def refused_before_p(
    stack: Stack, body: dict[str, Any], key: str = "max_tokens", *, slack: float = 0
) -> None:
    """`slack`: tokens (and blocks) other work may cost meanwhile (a hit's released handle)."""
    before = work(stack)
    reply = post(stack.url + "/v1/chat/completions", body)
    error = assert_openai_error(reply, 400)
    assert reply.headers.get("x-request-id"), reply.headers
    assert error["param"] == key and error["code"] == "context_length_exceeded", error
    assert f"maximum context length is {MAX_MODEL_LEN}" in error["message"]
    after = work(stack)
    assert after[0] - before[0] <= slack and after[1] - before[1] <= slack, (before, after)


@pytest.mark.parametrize(
    ("length", "key"),
    [(10, "max_tokens"), (7000, "max_tokens"), (7000, "max_completion_tokens")],
    ids=["short-prompt", "long-prompt", "max-completion-tokens"],
)
def test_a_prompt_that_cannot_fit_with_its_max_tokens_is_refused_before_p(
    main: Stack, length: int, key: str
) -> None:
    messages = [{"role": "user", "content": words(length)}]
    room = MAX_MODEL_LEN - prompt_tokens(main, messages)
    body = {"model": MODEL, "messages": messages, key: room + 1, "conversation_id": new_cid("fit")}
    refused_before_p(main, body, key)
    # One token less fits: served (a long prompt, so that P's /tokenize decided).
    if length > 10:
        body[key] = 4
        reply = post(main.url + "/v1/chat/completions", body)
        assert reply.status == 200, reply.body[:300]


def test_a_hit_that_cannot_fit_is_refused_with_its_own_token_count(main: Stack) -> None:
    conv = Conversation(main.url, main.ref, new_cid("fit-hit"))
    conv.turn()
    assert conv.turn().reuse == "hit"
    messages = [*conv.messages, {"role": "user", "content": "and now?"}]
    room = MAX_MODEL_LEN - prompt_tokens(main, messages)
    body = {"model": MODEL, "messages": messages, "max_tokens": room + 1}
    # The turn took the handle and sends P none: it is released, a one-token read of nothing
    # that P leases one block for (docs/architecture.md, Pinned handles).
    refused_before_p(main, {**body, "conversation_id": conv.cid}, slack=1)


def test_what_d_refuses_after_all_leaves_nothing_pinned_on_p(main: Stack) -> None:
    """A router that does not know D's context length (--no-check-models) sends P the turn;
    D refuses it, and P's blocks are freed at once, not after its 30 s lease (but one: D's
    own one-block pin of the freeing request is released through a P, which leases it)."""
    ps, ds = [p.url for p in main.ps], [d.url for d in main.ds]
    flags = ["--engine-api-key", ENGINE_KEY, "--no-check-models", "--model", MODEL]
    flags += ["--block-size", "16"]
    with router(ps, ds, *flags, redis_url=main.redis_url, name="rel-fit-blind") as r:
        messages = [{"role": "user", "content": words(300)}]
        body = {"model": MODEL, "messages": messages, "max_tokens": MAX_MODEL_LEN - 10}
        computed, pinned = work(main)
        reply = post(r.url + "/v1/chat/completions", body)
        assert reply.status == 400, reply.body[:300]  # D's own refusal, relayed
        assert work(main)[0] > computed, "P prefilled it (the router could not know)"
        wait_until(lambda: work(main)[1] <= pinned + 1, "P's blocks freed", timeout=5)


def tokenize_calls(stack: Stack) -> float:
    return sum(
        metric(p.url, "http_requests_total", handler="/tokenize", status="2xx") for p in stack.ps
    )


def test_a_later_turn_is_bounded_by_its_state_not_p_tokenize(main: Stack) -> None:
    """Issue 49: a later turn whose body's bytes leave doubt (3.6 bytes a token here) but
    whose conversation state bounds its tokens (D's count for the verified prefix, plus the
    bytes after it) asks no /tokenize on the way to P. Verified by digests: no pull needs
    P's tokens either, so the turn makes no /tokenize call at all."""
    ps, ds = [p.url for p in main.ps], [d.url for d in main.ds]
    flags = ["--engine-api-key", ENGINE_KEY, "--verify-prefix", "digest"]
    with router(ps, ds, *flags, redis_url=main.redis_url, name="rel-fit-state") as r:
        conv = Conversation(r.url, main.ref, new_cid("fit-state"))
        conv.headers = AUTH
        conv.messages.append({"role": "system", "content": words(2300)})
        want = 1000
        conv.turn(max_tokens=want)
        body_bytes = len(json.dumps(conv.messages))
        assert body_bytes + 64 + want > MAX_MODEL_LEN, "the byte bound would leave no doubt"
        before = tokenize_calls(main)
        assert conv.turn(max_tokens=want).reuse == "hit"
        assert tokenize_calls(main) == before, "P's /tokenize was asked"
