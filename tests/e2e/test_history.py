"""Clients that send no conversation id: the history itself names the session (`hit;id=history`),
answers equal a from-scratch engine's, and branches and look-alikes never share a handle."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from harness.chat import chat_turn, client
from tests.e2e.conftest import Stack, pulled, reference_chat

HIT = "hit;id=history"


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_five_turn_chat_without_id_hits_by_history(stack: Stack, stream: bool) -> None:
    api = client(stack.router.base_url)
    messages = [{"role": "system", "content": f"History {uuid.uuid4().hex} mode {stream}."}]
    for turn in range(1, 6):
        messages.append({"role": "user", "content": f"Question {turn}: will it rain?"})
        before = pulled(stack.p.url)
        answer, reuse, _ = chat_turn(api, messages, stream=stream, cid=None)
        assert answer == reference_chat(stack, messages, 24), f"turn {turn}"
        if turn == 1:
            assert reuse == "miss;reason=no-session"
        else:
            assert reuse == HIT, f"turn {turn}: {reuse}"
            assert pulled(stack.p.url) > before, f"turn {turn}: P pulled nothing"
        messages.append({"role": "assistant", "content": answer})


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_five_turn_completions_without_id(stack: Stack, stream: bool) -> None:
    api = client(stack.router.base_url)
    ref = client(stack.ref.url + "/v1")
    prompt = f"Report {uuid.uuid4().hex}: the weather for the coming week, day by day, says"
    for turn in range(1, 6):
        kwargs: dict[str, Any] = {"model": "sim-model", "prompt": prompt, "max_tokens": 24}
        if stream:
            with api.completions.with_streaming_response.create(stream=True, **kwargs) as resp:
                reuse = resp.headers["x-kv-reuse"]
                text = "".join(c.choices[0].text for c in resp.parse() if c.choices)
        else:
            raw = api.completions.with_raw_response.create(**kwargs)
            reuse, text = raw.headers["x-kv-reuse"], raw.parse().choices[0].text
        expected = ref.completions.create(model="sim-model", prompt=prompt, max_tokens=24)
        assert text == expected.choices[0].text, f"turn {turn}"
        assert reuse == ("miss;reason=no-session" if turn == 1 else HIT), f"turn {turn}"
        prompt = prompt + text + f" and then on day {turn} it"


def test_tenants_with_identical_histories_never_share_a_handle(stack: Stack) -> None:
    """Same history under two bearer tokens: each tenant finds only its own session."""
    first = [{"role": "user", "content": f"Tenant test {uuid.uuid4().hex}: sunny?"}]
    a, b = (
        client(stack.router.base_url, api_key="tenant-a"),
        client(stack.router.base_url, api_key="tenant-b"),
    )
    answer, reuse, _ = chat_turn(a, first, cid=None)
    assert reuse == "miss;reason=no-session"
    follow = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "And?"}]
    # Tenant b never committed this history: it cannot find a's session.
    answer_b, reuse_b, _ = chat_turn(b, follow, cid=None)
    assert reuse_b == "miss;reason=no-session"
    assert answer_b == reference_chat(stack, follow, 24)
    # a's handle was left alone for a.
    answer_a, reuse_a, _ = chat_turn(a, follow, cid=None)
    assert reuse_a == HIT
    assert answer_a == reference_chat(stack, follow, 24)


def test_look_alikes_and_regenerate_answer_right_and_one_uses_the_handle(stack: Stack) -> None:
    """Two continuations of one history: the first uses the handle, the second is a new
    branch (a miss) that is found by its own history next turn; a regenerate and an edited
    history answer like the reference and read nothing unverified."""
    api = client(stack.router.base_url)
    base = [{"role": "user", "content": f"Branch test {uuid.uuid4().hex}: tea or coffee?"}]
    a1, reuse, _ = chat_turn(api, base, cid=None)
    assert reuse == "miss;reason=no-session"
    one = [*base, {"role": "assistant", "content": a1}, {"role": "user", "content": "Why tea?"}]
    two = [*base, {"role": "assistant", "content": a1}, {"role": "user", "content": "Why not?"}]
    ans1, r1, _ = chat_turn(api, one, cid=None)
    assert (r1, ans1) == (HIT, reference_chat(stack, one, 24))
    ans2, r2, _ = chat_turn(api, two, cid=None)  # the session moved on: a new branch
    assert (r2, ans2) == ("miss;reason=prefix-mismatch", reference_chat(stack, two, 24))
    # Regenerate branch one's last turn: the session holds its answer already.
    regen, r3, _ = chat_turn(api, one, cid=None)
    assert (r3, regen) == ("miss;reason=prefix-mismatch", reference_chat(stack, one, 24))
    # Both branches continue, each by its own history.
    for msgs, ans in ((one, regen), (two, ans2)):
        nxt = [*msgs, {"role": "assistant", "content": ans}, {"role": "user", "content": "More."}]
        out, reuse_n, _ = chat_turn(api, nxt, cid=None)
        assert (reuse_n, out) == (HIT, reference_chat(stack, nxt, 24))
    # An edited earlier answer: nothing matches it, so nothing is read.
    edited = [
        *base,
        {"role": "assistant", "content": a1 + " (edited)"},
        {"role": "user", "content": "Ok."},
    ]
    out, reuse_e, _ = chat_turn(api, edited, cid=None)
    assert (reuse_e, out) == ("miss;reason=no-session", reference_chat(stack, edited, 24))


def test_an_explicit_id_never_uses_the_index(stack: Stack) -> None:
    api = client(stack.router.base_url)
    base = [{"role": "user", "content": f"Explicit {uuid.uuid4().hex}: rain?"}]
    answer, _, _ = chat_turn(api, base, cid=None)
    nxt = [*base, {"role": "assistant", "content": answer}, {"role": "user", "content": "Then?"}]
    _, reuse, _ = chat_turn(api, nxt, cid=f"x-{uuid.uuid4().hex[:8]}")
    assert reuse == "miss;reason=no-session"
