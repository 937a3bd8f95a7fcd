"""The whole turn, claim to commit, through the fake engines and the in-memory store: hits,
failover, refused handles, the ids fallback and the decode retry, in milliseconds."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest

from router.engines.identity import REFUSALS_TO_PAUSE
from router.errors import UpstreamError, UpstreamFailure
from router.turn.decide import attempts, keep
from router.turn.decide.attempts import AfterPrefill, Attempt, Next
from router.turn.decide.keep import Answered, Ending
from router.turn.outcomes import Reason
from tests.unit.fake_engines import Call, FakeEngines
from tests.unit.turns import (
    D1,
    D2,
    P1,
    P2,
    answer,
    conversation,
    crowd_prefill,
    expected_answer,
    handle_sent,
    second_turn,
    services,
    state_of,
    turn,
)


async def test_a_conversation_hits_from_turn_two_and_p_gets_d_s_handle() -> None:
    engines = FakeEngines()
    svc = services(engines)
    seen = await conversation(svc, 3)
    assert [h["x-kv-reuse"] for _, h, _ in seen] == ["miss;reason=no-session", "hit", "hit"]
    p_legs = [c for c in engines.calls if c.url.startswith("http://p") and "/v1/" in c.url]
    assert [handle_sent(c) for c in p_legs] == [False, True, True]
    # The hit's P leg is the verified prompt as token ids on /v1/completions.
    assert p_legs[1].url.endswith("/v1/completions") and isinstance(p_legs[1].body["prompt"], list)
    # Each turn's calls to P and D carry that turn's request id, as its response does.
    ids = [c.request_id for c in engines.calls]
    assert set(ids) == {"r0", "r1", "r2"} and ids == sorted(ids)
    assert [h["x-request-id"] for _, h, _ in seen] == ["r0", "r1", "r2"]
    hits = svc.metrics.reuse.labels("hit", "")._value.get()
    assert hits == 2


async def test_a_prefill_that_cannot_be_reached_fails_over_and_keeps_the_handle() -> None:
    engines = FakeEngines()
    svc = services(engines)
    await conversation(svc, 1)
    state = await state_of(svc)
    prefer = state.prefill
    # Its /tokenize answered (the verified prefix is in hand), then its P leg cannot connect.
    engines.scripts[prefer] = lambda call: (
        UpstreamFailure("refused", reached=False) if "/v1/" in call.url else None
    )
    messages = second_turn("and then?")
    status, headers, body = await turn(svc, messages)
    assert (status, headers["x-kv-reuse"]) == (200, "hit"), "never reached: the handle is intact"
    other = P2 if prefer == P1 else P1
    assert handle_sent(engines.calls_to(other, "/v1/")[-1])
    assert svc.pool.find("prefill", prefer).failures == 1  # type: ignore[union-attr]
    assert answer(body) == expected_answer(messages)


async def test_a_refused_handle_is_redone_as_a_miss_on_the_same_prefill() -> None:
    engines = FakeEngines()
    svc = services(engines)

    def refuse_handles(call: Call) -> int | None:
        if "/v1/" in call.url and handle_sent(call):
            return 500
        return None

    engines.scripts[P1] = engines.scripts[P2] = refuse_handles
    seen = await conversation(svc, 1 + REFUSALS_TO_PAUSE)
    reuse = [h["x-kv-reuse"] for _, h, _ in seen]
    assert reuse[1:] == ["miss;reason=handle-rejected"] * REFUSALS_TO_PAUSE
    assert all(status == 200 for status, _, _ in seen)
    d = svc.pool.find("decode", (await state_of(svc)).decode)
    assert d is not None and sum(r.count for r in d.ident.refused_by.values()) >= 1
    assert all(i.failures == 0 for i in svc.pool.instances("prefill")), "a refusal is no fault"


async def test_a_prefill_that_refuses_token_ids_gets_the_body_and_ids_stop() -> None:
    engines = FakeEngines()
    svc = services(engines)

    def no_ids(call: Call) -> int | None:
        return 400 if isinstance(call.body.get("prompt"), list) else None

    engines.scripts[P1] = engines.scripts[P2] = no_ids
    seen = await conversation(svc, 3)
    assert [h["x-kv-reuse"] for _, h, _ in seen] == ["miss;reason=no-session", "hit", "hit"]
    assert not svc.ids_leg_on() and "answered 400" in svc.ids_leg_off
    ids_legs = [c for c in engines.calls if isinstance(c.body.get("prompt"), list)]
    assert len(ids_legs) == 1, "after the first refusal P gets the body"


async def test_a_decode_that_fails_before_its_first_byte_is_redone_on_another() -> None:
    engines = FakeEngines()
    svc = services(engines)
    await conversation(svc, 1)
    state = await state_of(svc)
    engines.scripts[state.decode] = lambda call: 503 if "/v1/" in call.url else None
    messages = second_turn("more?")
    status, headers, body = await turn(svc, messages)
    assert (status, headers["x-kv-reuse"]) == (200, "miss;reason=decode-retried")
    assert answer(body) == expected_answer(messages)
    p_legs = [c for c in engines.calls[-6:] if c.url.startswith("http://p") and "/v1/" in c.url]
    assert [handle_sent(c) for c in p_legs] == [True, False], "a new P leg, as a miss"


async def test_every_prefill_failing_is_a_502_with_the_turn_s_request_id() -> None:
    engines = FakeEngines()
    engines.scripts[P1] = engines.scripts[P2] = lambda call: UpstreamFailure("down")
    svc = services(engines)
    with pytest.raises(UpstreamError, match="every prefill instance failed"):
        await turn(svc, [{"role": "user", "content": "hi"}], request_id="r-err")
    assert {c.request_id for c in engines.calls} == {"r-err"}


async def test_a_prefill_4xx_to_the_client_s_body_is_relayed() -> None:
    engines = FakeEngines()
    engines.scripts[P1] = engines.scripts[P2] = lambda call: 400
    svc = services(engines)
    status, headers, body = await turn(svc, [{"role": "user", "content": "hi"}])
    assert status == 400 and body["error"]["message"] == "scripted"
    assert headers["x-request-id"] == "rid"


async def test_a_prefill_leg_that_times_out_on_a_hung_decode_s_handle_blames_the_decode() -> None:
    """P waits on the handle's D until the prefill timeout (a hung D). The turn is redone as a
    miss on the same P, and P is not counted as failing (a hung D used to eject every P)."""
    engines = FakeEngines()
    svc = services(engines)
    await conversation(svc, 1)

    def hang_on_handles(call: Call) -> UpstreamFailure | None:
        if "/v1/" in call.url and handle_sent(call):
            return UpstreamFailure("timed out")  # reached: P may be reading
        return None

    engines.scripts[P1] = engines.scripts[P2] = hang_on_handles
    messages = second_turn("and now?")
    status, headers, body = await turn(svc, messages)
    assert (status, headers["x-kv-reuse"]) == (200, "miss;reason=handle-rejected")
    assert answer(body) == expected_answer(messages)
    assert all(p.failures == 0 for p in svc.pool.instances("prefill"))
    p_legs = [c for c in engines.calls if "/v1/" in c.url and c.url.startswith("http://p")]
    assert [handle_sent(c) for c in p_legs[-2:]] == [True, False]
    assert p_legs[-1].url.split("/v1/")[0] == p_legs[-2].url.split("/v1/")[0], "the same P"


async def test_a_busy_prefill_429_goes_to_another_and_is_relayed_only_when_all_are_busy() -> None:
    engines = FakeEngines()
    engines.scripts[P1] = lambda call: 429 if "/v1/" in call.url else None
    # The same prompt each turn: D's cache holds it, so the decode plan would skip P.
    svc = services(engines, decode_local_max_tokens=0)
    for _ in range(3):
        status, headers, _ = await turn(svc, [{"role": "user", "content": "hi"}])
        assert status == 200
    assert len(engines.calls_to(P1, "/v1/")) >= 1, "P1 was tried"
    assert svc.pool.find("prefill", P1).failures == 0  # type: ignore[union-attr]
    engines.scripts[P2] = engines.scripts[P1]
    status, headers, _ = await turn(svc, [{"role": "user", "content": "hi"}])
    assert status == 429 and headers["x-request-id"] == "rid"
    assert all(p.usable for p in svc.pool.instances("prefill")), "busy is not broken"


def _fail_first_decode(failed: list[str]) -> Callable[[Call], int | None]:
    def script(call: Call) -> int | None:
        if "/v1/" in call.url and not failed:
            failed.append(call.url)
            return 500
        return None

    return script


async def test_a_decode_redo_goes_to_another_prefill() -> None:
    """D may have failed on P's params (forged or stale): the redone P leg goes elsewhere."""
    engines = FakeEngines()
    svc = services(engines)
    failed: list[str] = []
    engines.scripts[D1] = engines.scripts[D2] = _fail_first_decode(failed)
    status, _, _ = await turn(svc, [{"role": "user", "content": "hi"}])
    assert status == 200 and len(failed) == 1
    p_legs = [c.url.split("/v1/")[0] for c in engines.calls if c.url.startswith("http://p")]
    assert len(p_legs) == 2 and p_legs[0] != p_legs[1]


@pytest.mark.parametrize(
    ("attempt", "after"),
    [
        (Attempt(200, True, True, False, False), AfterPrefill(Next.DONE)),
        (Attempt(400, False, True, True, True), AfterPrefill(Next.AS_BODY)),
        (Attempt(500, False, True, True, False), AfterPrefill(Next.AS_MISS, handle_used=True)),
        (Attempt(400, False, True, True, False), AfterPrefill(Next.AS_MISS, handle_used=True)),
        (Attempt(400, False, True, False, False), AfterPrefill(Next.RELAY)),
        # A timeout carrying a handle (a hung D): the D's fault, redone here as a miss.
        (Attempt(None, False, True, True, False), AfterPrefill(Next.AS_MISS, handle_used=True)),
        (Attempt(429, False, True, False, False), AfterPrefill(Next.ANOTHER_P)),
        (Attempt(None, False, False, True, False), AfterPrefill(Next.ANOTHER_P, failed=True)),
        (Attempt(503, False, True, False, False), AfterPrefill(Next.ANOTHER_P, failed=True)),
    ],
)
def test_after_prefill(attempt: Attempt, after: AfterPrefill) -> None:
    assert attempts.after_prefill(attempt) == after


# A streamed turn that kept D's handle, then one fact changed at a time.
KEPT = Answered(
    handle=True,
    reuse_on=True,
    tool_calls=False,
    stream=True,
    sent_ids=[1, 2],
    d_prompt_ids=[1, 2],
    token_ids_wanted=True,
    token_ids_needed=True,
)


@pytest.mark.parametrize(
    ("changes", "end"),
    [
        ({}, Ending(keep_handle=True)),
        ({"reuse_on": False}, Ending(False, Reason.REUSE_DISABLED)),
        ({"tool_calls": True}, Ending(False, Reason.TOOL_CALLS)),
        ({"handle": False}, Ending(False, Reason.STREAM_NO_KV_PARAMS)),
        ({"handle": False, "stream": False}, Ending(False, Reason.NO_KV_PARAMS)),
        ({"handle": False, "local": True}, Ending(False, Reason.DECODE_LOCAL)),
        ({"d_prompt_ids": [1, 3]}, Ending(False, Reason.PROMPT_IDS_DIFFER, ids_differ=True)),
        ({"d_prompt_ids": None}, Ending(False, Reason.NO_TOKEN_IDS)),
        ({"d_prompt_ids": None, "token_ids_needed": False}, Ending(keep_handle=True)),
    ],
)
def test_ending(changes: dict[str, object], end: Ending) -> None:
    assert keep.ending(replace(KEPT, **changes)) == end  # type: ignore[arg-type]


async def test_the_decode_plan_runs_the_turn_on_d_alone_and_keeps_its_tokens() -> None:
    engines = FakeEngines()
    svc = services(engines, decode_local_max_inflight=1)
    await conversation(svc, 1)
    first = await state_of(svc)
    crowd_prefill(svc)
    calls = len(engines.calls)
    messages = second_turn("and then?")
    status, headers, body = await turn(svc, messages, request_id="r1")
    assert (status, headers["x-kv-reuse"]) == (200, "hit;via=decode")
    assert answer(body) == expected_answer(messages)
    legs = [c for c in engines.calls[calls:] if "/v1/" in c.url]
    assert [c.url.split("/v1/")[0] for c in legs] == [first.decode], "D alone, no P leg"
    # Nothing to read, params all the same: a bidirectional D keeps its blocks and returns
    # its handle, as after a P/D turn (vLLM's request_finished returns none without params).
    alone = {"do_remote_prefill": False, "do_remote_decode": False}
    assert legs[0].body["kv_transfer_params"] == alone and legs[0].body["return_token_ids"]
    state = await state_of(svc)
    assert state.kv_transfer_params is not None and state.no_handle_reason == ""
    assert state.kv_transfer_params["remote_engine_id"] == first.decode_engine_id
    assert (state.decode, state.prefill) == (first.decode, first.prefill)
    assert state.token_count > first.token_count and state.block_digests
    # The next turn finds what D's cache holds by those digests: the decode plan again.
    messages += [{"role": "assistant", "content": answer(body)}, {"role": "user", "content": "ok"}]
    status, headers, _ = await turn(svc, messages, request_id="r2")
    assert (status, headers["x-kv-reuse"]) == (200, "hit;via=decode")


async def test_a_message_long_in_bytes_but_short_in_tokens_takes_the_decode_plan() -> None:
    """The bound from the state counts a token per byte (lacks.py): 100 two-byte characters
    bound it above the limit, but the verification's exact count (one token each here) is
    within it, and decides."""
    engines = FakeEngines()
    svc = services(engines, decode_local_max_inflight=1, decode_local_max_tokens=160)
    await conversation(svc, 1)
    crowd_prefill(svc)
    messages = second_turn("\u00e9" * 100)
    status, headers, body = await turn(svc, messages, request_id="r1")
    assert (status, headers["x-kv-reuse"]) == (200, "hit;via=decode")
    assert answer(body) == expected_answer(messages)


async def test_a_decode_plan_whose_d_fails_first_is_an_ordinary_pd_turn() -> None:
    engines = FakeEngines()
    svc = services(engines, decode_local_max_inflight=1)
    await conversation(svc, 1)
    first = await state_of(svc)
    crowd_prefill(svc)
    failed: list[str] = []
    engines.scripts[first.decode] = _fail_first_decode(failed)
    messages = second_turn("and then?")
    status, headers, body = await turn(svc, messages, request_id="r1")
    assert (status, headers["x-kv-reuse"]) == (200, "miss;reason=decode-local-failed")
    assert answer(body) == expected_answer(messages)
    assert failed == [first.decode + "/v1/chat/completions"]
    state = await state_of(svc)
    assert state.turn == 2 and state.decode != first.decode, "redone on the other D"
    assert state.kv_transfer_params is not None, "an ordinary P/D turn leaves a handle"


async def test_a_failed_decode_plan_and_redo_commit_nothing() -> None:
    engines = FakeEngines()
    svc = services(engines, decode_local_max_inflight=1)
    await conversation(svc, 1)
    first = await state_of(svc)
    crowd_prefill(svc)
    engines.scripts[D1] = engines.scripts[D2] = lambda call: 500 if "/v1/" in call.url else None
    with pytest.raises(UpstreamError):
        await turn(svc, second_turn("and then?"), request_id="r1")
    state = await state_of(svc)
    assert (state.turn, state.inflight) == (first.turn, ""), "nothing committed, claim released"
