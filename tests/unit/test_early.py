"""P's /tokenize sent during the claim: when, to which P, and that a request not needed is
cancelled without a stray error."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from router.config import Settings
from router.services import Services
from router.turn import early
from router.turn.incoming import Incoming
from sessions.keys import conversation_key
from tests.support.services import make_services

HISTORY = [
    {"role": "user", "content": "rain?"},
    {"role": "assistant", "content": "no"},
    {"role": "user", "content": "sure?"},
]


def _svc(prefill: tuple[str, ...] = ("http://p1",), **kw: Any) -> Services:
    return make_services(Settings(prefill=prefill, decode=("http://d",), **kw))


def _inc(messages: list[dict[str, str]], cid: str | None = "c") -> Incoming:
    return Incoming("chat", {"messages": messages}, False, cid, "default", False)


async def _started(svc: Services, inc: Incoming) -> early.EarlyTokens | None:
    """early.start for a conversation whose hint, if any, the test has set."""
    tokens = early.start(svc, inc, "req")
    if tokens is not None:
        tokens.cancel()  # no engine behind these URLs
    return tokens


@pytest.mark.parametrize(
    ("messages", "cid", "kw"),
    [
        (HISTORY[:1], "c", {}),  # a first turn: no answer to verify yet
        (HISTORY, None, {}),  # no conversation id: the session is found by the history
        (HISTORY, "c", {"reuse": False}),
        (HISTORY, "c", {"verify_prefix": "text"}),
    ],
    ids=["first-turn", "no-id", "no-reuse", "verify-by-text"],
)
async def test_only_a_likely_hit_verified_by_tokens_tokenizes_early(
    messages: list[dict[str, str]], cid: str | None, kw: dict[str, Any]
) -> None:
    svc = _svc(**kw)
    early.remember(svc, conversation_key("default", "c"), "http://p1")
    assert await _started(svc, _inc(messages, cid)) is None


async def test_only_after_a_turn_that_left_a_handle_to_its_p() -> None:
    svc = _svc(("http://p1", "http://p2"))
    key = conversation_key("default", "c")
    assert await _started(svc, _inc(HISTORY)) is None  # nothing known of this conversation
    early.remember(svc, key, "http://p2")  # its last turn here left a handle, P was p2
    hinted = await _started(svc, _inc(HISTORY))
    assert hinted is not None and hinted.url == "http://p2"
    early.remember(svc, key, None)  # the next one left none (a stream from stock vLLM)
    assert await _started(svc, _inc(HISTORY)) is None
    early.remember(svc, key, "http://p2")
    for inst in svc.pool.instances("prefill"):
        if inst.url == "http://p2":
            svc.pool.remove(inst)
    assert await _started(svc, _inc(HISTORY)) is None  # that P is gone: no guess


@pytest.mark.parametrize(
    ("d_inflight", "idle_inflight", "asked"),
    [(0, 2, False), (1, 2, False), (2, 2, True), (0, 0, True)],
    ids=["idle", "nearly-idle", "busy", "pull-first"],
)
async def test_not_when_the_turn_most_likely_runs_on_an_idle_d(
    d_inflight: int, idle_inflight: int, asked: bool
) -> None:
    svc = _svc(decode_local_idle_inflight=idle_inflight)
    (d,) = svc.pool.instances("decode")
    d.outstanding = d_inflight
    early.remember(svc, conversation_key("default", "c"), "http://p1", 0, "http://d")
    assert (await _started(svc, _inc(HISTORY)) is not None) is asked


def test_hints_are_bounded_oldest_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(early, "MAX_HINTS", 3)
    svc = _svc()
    for key in ("a", "b", "c"):
        early.remember(svc, key, f"http://{key}")
    early.remember(svc, "a", "http://a2")  # a is the newest now
    early.remember(svc, "d", "http://d")
    assert svc.prefill_hints == {
        "c": ("http://c", 0, ""),
        "a": ("http://a2", 0, ""),
        "d": ("http://d", 0, ""),
    }
    early.remember(svc, None, "http://x")  # a turn without a session key
    assert len(svc.prefill_hints) == 3


async def test_ids_count_only_for_the_p_they_were_asked_of() -> None:
    async def ids() -> list[int] | None:
        return [1, 2, 3]

    tokens = early.EarlyTokens("http://p1", asyncio.create_task(ids()))
    assert await tokens.tokens_for("http://p1") == (True, [1, 2, 3])
    pending = early.EarlyTokens("http://p1", asyncio.create_task(asyncio.sleep(5, [1])))
    assert await pending.tokens_for("http://p2") == (False, None)
    await asyncio.sleep(0)
    assert pending.task.cancelled()


async def test_a_failed_request_not_needed_leaves_no_stray_error() -> None:
    seen: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, ctx: seen.append(ctx))

    async def fails() -> list[int] | None:
        raise RuntimeError("P went away")

    tokens = early.EarlyTokens("http://p1", asyncio.create_task(fails()))
    await asyncio.sleep(0)
    assert tokens.task.done()
    tokens.cancel()  # the turn did not need it
    del tokens
    gc.collect()
    assert seen == []
