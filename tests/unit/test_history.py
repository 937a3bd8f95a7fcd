"""History-addressed sessions without engines: the candidates, the pick, the index entry, and
whole turns through the fake engines with the switch on and off."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.turn import history
from router.turn.incoming import Api, Incoming
from router.turn.run import run_turn
from router.turn.tenant import DEFAULT_TENANT
from sessions.digests import conversation_digest, text_digest, text_heads
from sessions.keys import history_key
from sessions.model import SessionState
from tests.unit import turns
from tests.unit.fake_engines import FakeEngines
from tests.unit.turns import answer, services

SYS = {"role": "system", "content": "be brief"}
U1, A1, U2 = (
    {"role": "user", "content": "q1"},
    {"role": "assistant", "content": "a1"},
    {
        "role": "user",
        "content": "q2",
    },
)


def incoming(api: Api = "chat", **body: Any) -> Incoming:
    return turns.incoming({"model": "m", **body}, api)


def test_candidates_are_the_strict_prefixes_that_end_with_an_answer() -> None:
    inc = incoming(messages=[SYS, U1, A1, U2, {**A1, "content": "a2"}, U2])
    found = history.candidates(inc)
    assert [c.length for c in found] == [5, 3]  # longest first
    assert found[1].digest == conversation_digest("chat", [SYS, U1, A1])
    assert found[1].key == history_key(DEFAULT_TENANT, found[1].digest)
    # The whole request is never a candidate: a turn must extend what D holds.
    assert history.candidates(incoming(messages=[SYS, U1, A1])) == []
    assert history.candidates(incoming(messages=[SYS, U1, A1, U2])) == [found[1]]
    assert history.candidates(incoming("completions", prompt=[1, 2, 3])) == []


def test_text_heads_are_text_digests_of_aligned_prefixes() -> None:
    text = "x" * 100 + "é" * 100
    heads = text_heads("completions", text, 64, 10)
    assert [n for n, _ in heads] == [192, 128, 64]
    assert all(d == text_digest("completions", text[:n]) for n, d in heads)
    assert text_heads("completions", text, 64, 1) == heads[:1]


def test_pick_takes_the_longest_named_session_and_ignores_garbage() -> None:
    inc = incoming(messages=[SYS, U1, A1, U2, {**A1, "content": "a2"}, U2])
    found = history.candidates(inc)
    sid = history.new_id()
    assert history.pick(inc, found, [None, f"3 {sid}"]) == history.Match(sid, found[1].digest)
    assert history.pick(inc, found, [f"5 {sid}", f"3 {sid}"]) == history.Match(sid, found[0].digest)
    for junk in ("5", f"4 {sid}", "5 user-id", f"x {sid}"):
        assert history.pick(inc, found, [junk, None]) is None


def test_text_pick_and_index_entry_meet() -> None:
    first = "p" * 70
    inc1 = incoming("completions", prompt=first)
    state = SessionState(prefix_digest=text_digest("completions", first + "ans"), prefix_len=73)
    sid = history.new_id()
    entry = history.index_entry(inc1, sid, state, "ans")
    assert entry is not None
    inc2 = incoming("completions", prompt=first + "ans and more")
    found = history.candidates(inc2)
    match = history.pick(inc2, found, [entry[1] if c.key == entry[0] else None for c in found])
    assert match == history.Match(sid, state.prefix_digest)
    short = SessionState(prefix_digest="ab", prefix_len=10)
    assert history.index_entry(incoming("completions", prompt="p"), sid, short, "") is None


async def chat(svc: Any, messages: list[dict[str, Any]], rid: str) -> tuple[str, str]:
    inc = incoming(messages=messages)
    resp = await run_turn(svc, inc, rid)
    return dict(resp.headers)["x-kv-reuse"], answer(msgspec.json.decode(bytes(resp.body)))


@pytest.mark.parametrize("on", [True, False])
async def test_the_switch(on: bool) -> None:
    svc = services(FakeEngines(), history_sessions=on)
    messages: list[dict[str, Any]] = [SYS]
    seen = []
    for i in range(3):
        messages.append({"role": "user", "content": f"question number {i}?"})
        reuse, text = await chat(svc, messages, f"r{i}")
        seen.append(reuse)
        messages.append({"role": "assistant", "content": text})
    if on:
        assert seen == ["miss;reason=no-session", "hit;id=history", "hit;id=history"]
        assert 'reason="id=history"' in svc.metrics.render().decode()
    else:
        assert seen == ["skip;reason=no-conversation-id"] * 3


async def test_a_store_that_fails_still_serves_id_less_turns() -> None:
    svc = services(FakeEngines())
    await svc.store.close()  # every store call raises StoreError now
    messages: list[dict[str, Any]] = [SYS, U1]
    reuse, text = await chat(svc, messages, "r0")
    assert reuse == "miss;reason=no-session" and text  # no lookup: nothing to look up
    reuse, _ = await chat(svc, [*messages, {"role": "assistant", "content": text}, U2], "r1")
    assert reuse == "miss;reason=store-unavailable"
