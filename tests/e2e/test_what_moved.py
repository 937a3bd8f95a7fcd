"""A plain `hit` means KV moved from D to P (issue 50, item 3): every turn that says `hit`
made the P that served it count more `external_kv_transfer` prompt tokens, and a turn whose
verified prefix P already held says `hit;via=prefill-cache`.

The shape that broke it: a reasoning model whose reasoning the client drops from the history
(vllm#43094). D holds prompt, reasoning and answer; the next prompt has the answer without
the reasoning, so the verified prefix ends where the reasoning began: the prompt P computed
on the last turn. A read would bring P nothing. Checked with the engines' KV events and
without them (the router remembers what that P computed), by conversation id and by history,
and when P holds all but less than its `kv_recompute_threshold` (it then reads nothing)."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from harness.chat import chat_turn, client
from harness.stack import Stack, start_stack
from tests.e2e.conftest import pulled
from tests.e2e.helpers import SYSTEM, events_flags, spec, wait_in_sync

THINK = ("--reasoning-tokens", "12")
# vLLM's defaults with bidirectional_kv_xfer: P skips a read of fewer than 64 tokens.
ENGINE = ("--bidirectional", *THINK)
LONG = " ".join([SYSTEM] * 4)


@dataclass
class Seen:
    reuse: str
    pulled: float  # external_kv_transfer tokens the P counted during the turn


class Conversation:
    """A chat conversation through the SDK: each answer goes back as the assistant message,
    without its reasoning (dropped, as clients of reasoning models do) unless `keep`."""

    def __init__(self, st: Stack, cid: str | None, *, keep: bool = False) -> None:
        self.st, self.cid, self.keep = st, cid, keep
        self.api = client(st.router.base_url)
        self.messages = [{"role": "system", "content": f"{cid or uuid.uuid4().hex} {LONG}"}]
        self.seen: list[Seen] = []

    def ask(self, question: str, max_tokens: int = 40) -> Seen:
        self.messages.append({"role": "user", "content": question})
        before = sum(pulled(p.url) for p in self.st.ps)
        answer, reuse, body = chat_turn(
            self.api, self.messages, cid=self.cid, max_tokens=max_tokens
        )
        if self.keep:
            answer = (body["choices"][0]["message"].get("reasoning") or "") + answer
        seen = Seen(reuse, sum(pulled(p.url) for p in self.st.ps) - before)
        self.seen.append(seen)
        self.messages.append({"role": "assistant", "content": answer})
        assert_hits_moved(self.seen)
        return seen

    def reuses(self, questions: list[str], max_tokens: int = 40) -> list[str]:
        return [self.ask(q, max_tokens).reuse for q in questions]


def assert_hits_moved(seen: list[Seen]) -> None:
    """Every plain `hit` moved tokens from D; nothing else did."""
    for n, s in enumerate(seen, 1):
        if s.reuse == "hit":
            assert s.pulled > 0, f"turn {n} says hit but P read nothing from D: {seen}"
        else:
            assert s.pulled == 0, f"turn {n} says {s.reuse} but P read from D: {seen}"


QUESTIONS = [
    "Will it rain on the tea fields tonight?",
    "And after one hour?",
    "And after two hours?",
    "And after three hours?",
]


@pytest.fixture(scope="module")
def with_events(redis_url_session: str) -> Iterator[Stack]:
    """Two P and a D publishing KV events, a router subscribed."""
    from harness.router import router

    ports = [events_flags() for _ in range(3)]
    with start_stack(
        prefill=[(*ENGINE, *ports[0]), (*ENGINE, *ports[1])],
        decode=[(*ENGINE, *ports[2])],
        reference=None,
        routers=[],
        redis=redis_url_session,
        name="moved-ev",
    ) as st:
        args = [
            a
            for e, p in zip(st.engines, ports, strict=True)
            for a in ("--kv-events", spec(e.url, p))
        ]
        with router([p.url for p in st.ps], [st.d.url], *args, redis_url=redis_url_session) as r:
            st.routers.append(r)
            wait_in_sync(st, timeout=60)  # a loaded machine subscribes slowly
            yield st


@pytest.fixture(scope="module")
def without_events(redis_url_session: str) -> Iterator[Stack]:
    """One P and one D, no KV events: only what the router remembers of each turn."""
    with start_stack(
        prefill=[ENGINE], decode=[ENGINE], reference=None, redis=redis_url_session, name="moved"
    ) as st:
        yield st


def test_reasoning_dropped_is_served_from_ps_cache_with_kv_events(with_events: Stack) -> None:
    reuses = Conversation(with_events, f"ev-{uuid.uuid4().hex[:8]}").reuses(QUESTIONS)
    assert reuses == ["miss;reason=no-session", *["hit;via=prefill-cache"] * 3]


def test_a_read_p_skips_is_not_a_hit_with_kv_events(with_events: Stack) -> None:
    """P's events say it holds all of the verified prefix but D's short answer: the handle
    is sent, P skips a read under its threshold, and says so by its cached count."""
    short = Conversation(with_events, f"evs-{uuid.uuid4().hex[:8]}", keep=True)
    assert short.reuses(QUESTIONS[:2], max_tokens=20)[1] == "hit;via=prefill-cache"
    long = Conversation(with_events, f"evl-{uuid.uuid4().hex[:8]}", keep=True)
    assert long.reuses(QUESTIONS[:2], max_tokens=120)[1] == "hit"


def test_reasoning_dropped_is_served_from_ps_cache_without_kv_events(
    without_events: Stack,
) -> None:
    reuses = Conversation(without_events, f"noev-{uuid.uuid4().hex[:8]}").reuses(QUESTIONS)
    assert reuses == ["miss;reason=no-session", *["hit;via=prefill-cache"] * 3]


def test_a_session_found_by_history_says_the_same(without_events: Stack) -> None:
    reuses = Conversation(without_events, None).reuses(QUESTIONS)
    assert reuses[1:] == ["hit;via=prefill-cache;id=history"] * 3


def test_a_read_p_skips_is_not_a_hit(without_events: Stack) -> None:
    """With the reasoning kept, the verified prefix runs into D's answer: P holds all of it
    but the answer, reads that when it is at least its threshold (64 tokens), else
    recomputes it and reads nothing, which its cached count shows."""
    short = Conversation(without_events, f"s-{uuid.uuid4().hex[:8]}", keep=True)
    assert short.reuses(QUESTIONS[:2], max_tokens=20)[1] == "hit;via=prefill-cache"
    long = Conversation(without_events, f"l-{uuid.uuid4().hex[:8]}", keep=True)
    assert long.reuses(QUESTIONS[:2], max_tokens=120)[1] == "hit"


def test_a_cache_p_lost_is_a_miss_that_says_so(without_events: Stack) -> None:
    """P's cache was reset after the turn it computed: no handle was sent (the router
    expected P to hold the prefix), and P's count says it held none of it: a miss."""
    st = without_events
    talk = Conversation(st, f"lost-{uuid.uuid4().hex[:8]}")
    assert talk.reuses(QUESTIONS[:2])[1] == "hit;via=prefill-cache"
    req = urllib.request.Request(st.p.url + "/reset_prefix_cache", data=b"", method="POST")
    urllib.request.urlopen(req, timeout=5).close()
    assert talk.ask(QUESTIONS[2]).reuse == "miss;reason=recomputed"
    assert talk.ask(QUESTIONS[3]).reuse == "hit;via=prefill-cache"
