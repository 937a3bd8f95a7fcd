"""The prefix verdict (message digests), placement reasons and the store circuit breaker."""

from __future__ import annotations

import contextlib
import time
from typing import Any

import pytest

from router.config import Settings
from router.connectors.legs.pd import _reader
from router.engines.identity import REFUSALS_TO_PAUSE
from router.engines.pool import Pool
from router.services import StoreGuard
from router.turn.claim import Claim, prefix_verdict, tokenize_body
from router.turn.decide.extends import ByTokens, Check, Prefix, digest_check
from router.turn.decide.sendable import claimed_reuse, decode_blocker
from router.turn.incoming import Incoming
from router.turn.outcomes import Reason, Reuse
from router.turn.state import Turn
from sessions import model as sm
from sessions.store import StoreError
from tests.support.services import make_services

SYSTEM = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": "is it raining?"}
ANSWER = {"role": "assistant", "content": " yes it is"}


def _placement_reason(pool: Pool, state: sm.SessionState) -> str:
    """Why the decision core keeps the state's handle from P ("" when it may be sent)."""
    return str(decode_blocker(pool.find("decode", state.decode), state) or "")


def chat(messages: list[dict[str, Any]]) -> Incoming:
    return Incoming("chat", {"messages": messages}, False, "c", "default", False)


def completion(prompt: Any) -> Incoming:
    return Incoming("completions", {"prompt": prompt}, False, "c", "default", False)


def chat_state() -> sm.SessionState:
    prompt = [SYSTEM, USER]
    return sm.SessionState(
        api="chat",
        prompt_digest=sm.conversation_digest("chat", prompt),
        prompt_len=2,
        prefix_digest=sm.conversation_digest("chat", [*prompt, ANSWER]),
        prefix_len=3,
    )


@pytest.mark.parametrize(
    ("messages", "verdict"),
    [
        ([SYSTEM, USER, ANSWER, {"role": "user", "content": "and now?"}], "extends"),
        ([SYSTEM, USER, {**ANSWER, "refusal": None}, {"role": "user", "content": "x"}], "extends"),
        (
            [
                SYSTEM,
                USER,
                {"role": "assistant", "content": " yes it was"},
                {"role": "user", "content": "x"},
            ],
            "diverges-late",
        ),
        (
            [
                {"role": "system", "content": "be long"},
                USER,
                ANSWER,
                {"role": "user", "content": "x"},
            ],
            "mismatch",
        ),
        (
            [
                SYSTEM,
                {"role": "user", "content": "other"},
                ANSWER,
                {"role": "user", "content": "x"},
            ],
            "mismatch",
        ),
        ([SYSTEM, USER], "mismatch"),  # regenerate
        ([SYSTEM, USER, ANSWER], "mismatch"),  # nothing new
        (
            [SYSTEM, USER, {"role": "user", "content": "x"}, {"role": "user", "content": "y"}],
            "mismatch",
        ),  # the answer was replaced by a user message
    ],
)
def test_chat_prefix_verdicts(messages: list[dict[str, Any]], verdict: str) -> None:
    assert prefix_verdict(chat(messages), chat_state()) == verdict


def test_completion_prefix_verdicts() -> None:
    prompt, out = "The weather", " is fine today"
    state = sm.SessionState(
        api="completions",
        prompt_digest=sm.text_digest("completions", prompt),
        prompt_len=len(prompt),
        prefix_digest=sm.text_digest("completions", prompt + out),
        prefix_len=len(prompt + out),
    )
    assert prefix_verdict(completion(prompt + out + " and"), state) == "extends"
    assert prefix_verdict(completion(prompt + " was bad and"), state) == "diverges-late"
    assert prefix_verdict(completion("A weather" + out + " and"), state) == "mismatch"
    assert prefix_verdict(completion([1, 2, 3]), state) == "extends"


HIT = Reuse.hit(32)
MISMATCH = Reuse.miss(Reason.PREFIX_MISMATCH)
TOKENS = sm.SessionState(token_count=32, block_size=16, block_digests=["a", "b"])


@pytest.mark.parametrize(
    ("prefix", "by_tokens", "state", "check"),
    [
        (Prefix.EXTENDS, False, TOKENS, HIT),  # the digests decide: the hit stands
        (Prefix.DIVERGES_LATE, False, TOKENS, MISMATCH),
        (Prefix.MISMATCH, True, TOKENS, MISMATCH),  # no token check can save it
        (Prefix.EXTENDS, True, TOKENS, ByTokens.DECIDE),
        (Prefix.DIVERGES_LATE, True, TOKENS, ByTokens.DECIDE),
        (Prefix.EXTENDS, True, sm.SessionState(), Reuse.miss(Reason.NO_TOKEN_DIGESTS)),
    ],
)
def test_digest_checks(
    prefix: Prefix, by_tokens: bool, state: sm.SessionState, check: Check
) -> None:
    assert digest_check(prefix, HIT, by_tokens=by_tokens, state=state) == check


def test_tokenize_body_keeps_rendering_fields() -> None:
    inc = Incoming(
        "chat",
        {"messages": [USER], "chat_template_kwargs": {"x": 1}, "top_p": 0.5},
        False,
        None,
        "default",
        False,
    )
    body = tokenize_body(inc, "m")
    assert body == {
        "model": "m",
        "messages": [USER],
        "add_generation_prompt": True,
        "chat_template_kwargs": {"x": 1},
    }
    assert tokenize_body(completion("hi"), "m") == {"model": "m", "prompt": "hi"}


def test_reuse_header() -> None:
    assert Reuse.hit(3).header() == "hit"
    assert Reuse.miss(Reason.EXPIRED).header() == "miss;reason=expired"
    assert Reuse.miss(Reason.NO_CONVERSATION_ID).header() == "skip;reason=no-conversation-id"


def test_a_stored_reason_this_router_does_not_know_is_a_named_miss() -> None:
    """A state a newer router wrote (or a hand edit) once made the turn raise in Reuse.miss."""
    state = sm.SessionState(turn=2, api="chat", no_handle_reason="kv-moved-elsewhere")
    reuse = claimed_reuse(state, "chat", 0.0, None)
    assert reuse.header() == "miss;reason=stored-reason-unknown"
    assert reuse.labels() == ("miss", "stored-reason-unknown")


async def test_store_guard_opens_and_recovers() -> None:
    now = [100.0]
    guard = StoreGuard(retry_after=2.0, clock=lambda: now[0])
    calls = []

    async def failing() -> int:
        calls.append(1)
        raise StoreError("down")

    async def working() -> int:
        calls.append(2)
        return 7

    for _ in range(3):  # one slow call is not an outage: three in a row are
        assert not guard.is_open
        with pytest.raises(StoreError):
            await guard.call(failing)
    assert guard.is_open
    with pytest.raises(StoreError, match="breaker is open"):
        await guard.call(working)
    assert calls == [1, 1, 1]  # skipped while open: no timeout paid per request
    now[0] += 2.5
    assert await guard.call(working) == 7
    assert guard.failures == 3


async def test_store_guard_opens_on_a_failure_rate_not_on_scattered_failures() -> None:
    now = [100.0]
    guard = StoreGuard(retry_after=2.0, clock=lambda: now[0])

    async def failing() -> int:
        raise StoreError("timed out")

    async def working() -> int:
        return 7

    for _ in range(30):  # one failure in three: never three in a row, a third of the calls
        for op in (working, working, failing):
            with contextlib.suppress(StoreError):
                await guard.call(op)
        now[0] += 0.1
    assert not guard.is_open and guard.failures == 30
    for _ in range(30):  # then two in three, over the 10 s window: over half failed
        for op in (working, failing, failing):
            with contextlib.suppress(StoreError):
                await guard.call(op)
        if guard.is_open:
            break
        now[0] += 0.1
    assert guard.is_open


def test_a_handle_from_before_a_decode_restart_is_not_used() -> None:
    pool = Pool(("http://p1",), ("http://d1",))
    d1 = pool.instances("decode")[0]
    made = sm.SessionState(decode="http://d1", decode_engine_id="e1", decode_started=100.0)
    assert _placement_reason(pool, made) == ""  # nothing known about d1 yet
    d1.ident.started, d1.ident.engine_id = 100.0, "e1"
    assert _placement_reason(pool, made) == ""
    d1.ident.started = 200.0  # the health loop read a new process start time
    assert _placement_reason(pool, made) == "decode-restarted"
    d1.ident.started = 0.0  # no start time known: the engine id of its latest handle decides
    d1.ident.engine_id = "e2"
    assert _placement_reason(pool, made) == "decode-restarted"
    d1.healthy = False
    assert _placement_reason(pool, made) == "decode-unhealthy"
    assert _placement_reason(pool, sm.SessionState(decode="http://gone")) == "decode-removed"


def test_a_handle_from_the_new_process_is_used_whichever_sign_of_the_restart_came_first() -> None:
    """The new D's first handle can come back before the health loop reads its new start time:
    stamped with the old time, it would read as made before the restart once the new time is
    read, and the conversation would miss again on a good handle."""
    pool = Pool(("http://p1",), ("http://d1",))
    d1 = pool.instances("decode")[0]
    d1.ident.note_started(100.0)
    d1.ident.note_engine_id("e1")
    old = sm.SessionState(decode="http://d1", decode_engine_id="e1", decode_started=100.0)
    d1.ident.note_engine_id("e2")  # a turn's handle: the restarted process's engine id
    assert d1.ident.handle_started == 0.0, "the start time on file is the old process's"
    new = sm.SessionState(decode="http://d1", decode_engine_id="e2", decode_started=0.0)
    assert (_placement_reason(pool, old), _placement_reason(pool, new)) == ("decode-restarted", "")
    d1.ident.note_started(200.0)  # now the health loop reads the new start time
    assert (d1.ident.engine_id, d1.ident.restarts, d1.ident.handle_started) == ("e2", 1, 200.0)
    assert (_placement_reason(pool, old), _placement_reason(pool, new)) == ("decode-restarted", "")
    stamped = sm.SessionState(decode="http://d1", decode_engine_id="e2", decode_started=200.0)
    assert _placement_reason(pool, stamped) == ""


def test_the_data_parallel_ranks_of_one_decode_are_one_process() -> None:
    """A D with internal data parallelism makes handles on each rank, with vLLM's `_dp<rank>`
    after the process's engine id: a handle from another rank is not from before a restart."""
    pool = Pool(("http://p1",), ("http://d1",))
    d1 = pool.instances("decode")[0]
    d1.ident.note_started(100.0)
    d1.ident.note_engine_id("4c1f_dp0")
    d1.ident.note_engine_id("4c1f_dp1")
    assert (d1.ident.engine_id, d1.ident.handle_started) == ("4c1f", 100.0), "not a restart"
    ranks = [
        sm.SessionState(decode="http://d1", decode_engine_id=f"4c1f_dp{r}", decode_started=100.0)
        for r in (0, 1, 12)
    ]
    assert [_placement_reason(pool, s) for s in ranks] == ["", "", ""]
    d1.ident.note_engine_id("9e0a_dp1")  # the restarted process
    assert d1.ident.handle_started == 0.0
    assert [_placement_reason(pool, s) for s in ranks] == ["decode-restarted"] * 3


def test_a_hit_goes_to_a_prefill_that_has_not_been_refusing_the_decode() -> None:
    settings = Settings(prefill=("http://p1", "http://p2"), decode=("http://d1",))
    svc = make_services(settings)
    pool = svc.pool
    state = sm.SessionState(decode="http://d1", prefill="http://p1")
    hit = Claim("k", state, Reuse.hit(0), params={"remote_engine_id": "e1"}, claimed=True)
    turn = Turn(
        svc, Incoming("chat", {"messages": [USER]}, False, "c", "default", False), "r", hit, 0.0
    )
    p1, p2 = pool.instances("prefill")
    d1 = pool.instances("decode")[0]
    assert _reader(turn, d1, p1) is p1
    now = time.monotonic()
    for _ in range(REFUSALS_TO_PAUSE):
        d1.ident.note_refused(p1.url, now)
    assert _reader(turn, d1, p1) is p2 and turn.claim.reuse.outcome == "hit"
    for _ in range(REFUSALS_TO_PAUSE):
        d1.ident.note_refused(p2.url, now)
    assert _reader(turn, d1, p1) is p1
    assert (turn.claim.reuse.outcome, turn.claim.reuse.reason) == ("miss", "reads-paused")
    assert turn.claim.params is None and turn.claim.claimed, "the handle is used up, not sent"
