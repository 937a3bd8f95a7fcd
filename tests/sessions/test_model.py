"""The session rules, as tables: prefix checks, token verification, handle usability, next state."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from sessions.digests import head_at, next_head
from sessions.model import (
    Finished,
    SessionState,
    block_digests,
    conversation_digest,
    conversation_heads,
    handle_unusable_reason,
    next_state,
    prefix_extends,
    sequence_digest,
    text_digest,
    verified_tokens,
)

SYSTEM = {"role": "system", "content": "You are terse."}
U1 = {"role": "user", "content": "What is 2+2?"}
A1 = {"role": "assistant", "content": "4"}
U2 = {"role": "user", "content": "And 3+3?"}
HISTORY = [SYSTEM, U1, A1]
PARAMS = {
    "do_remote_decode": False,
    "do_remote_prefill": True,
    "remote_engine_id": "d-engine-1",
    "remote_block_ids": [1, 2, 3],
    "remote_request_id": "req-1",
    "remote_host": "10.0.0.2",
    "remote_port": 5600,
    "tp_size": 1,
    "remote_num_tokens": 10,
}


def chat_state(history: list[dict[str, Any]] = HISTORY) -> SessionState:
    return SessionState(
        turn=1,
        api="chat",
        prefix_digest=conversation_digest("chat", history),
        prefix_len=len(history),
    )


@pytest.mark.parametrize(
    ("messages", "extends"),
    [
        ([*HISTORY, U2], True),  # faithful extension
        ([*HISTORY, U2, {"role": "assistant", "content": "6"}, U2], True),
        ([*HISTORY, {"role": "assistant", "content": "four"}], True),  # prefill continuation
        (HISTORY, False),  # nothing new: not a strict extension
        ([SYSTEM, U1], False),  # regenerated turn: the last answer dropped
        ([SYSTEM, U1, {"role": "assistant", "content": "Four."}, U2], False),  # edited answer
        ([SYSTEM, {"role": "user", "content": "What is 2+3?"}, A1, U2], False),  # edited question
        ([{"role": "system", "content": "Be verbose."}, U1, A1, U2], False),  # new system prompt
        ([U1, A1, U2, U2], False),  # system prompt removed
        ([{**SYSTEM, "refusal": None}, U1, {**A1, "tool_calls": []}, U2], True),  # echo noise
    ],
)
def test_prefix_extends_chat(messages: list[dict[str, Any]], extends: bool) -> None:
    state = chat_state()
    assert prefix_extends(state, "chat", items=messages) is extends
    # The same from the items' heads (computed once per turn by the router).
    heads = conversation_heads("chat", messages)
    assert prefix_extends(state, "chat", items=messages, heads=heads) is extends
    assert head_at("chat", heads, 0) == conversation_digest("chat", [])
    assert next_head("chat", heads, U2) == conversation_digest("chat", [*messages, U2])
    assert next_head("chat", [], U2) == conversation_digest("chat", [U2])


def test_prefix_extends_text_and_guards() -> None:
    state = SessionState(
        api="completions", prefix_digest=text_digest("completions", "Once upon"), prefix_len=9
    )
    assert prefix_extends(state, "completions", text="Once upon a time")
    assert not prefix_extends(state, "completions", text="Once upon")
    assert not prefix_extends(state, "completions", text="Twice upon a time")
    assert not prefix_extends(state, "chat", text="Once upon a time")  # api differs
    assert not prefix_extends(state, "completions")  # neither items nor text
    assert not prefix_extends(chat_state(), "responses", items=[*HISTORY, U2])
    assert not prefix_extends(SessionState(api="chat"), "chat", items=[U1])  # nothing recorded


BS = 4
D_SEQ = list(range(100, 110))  # D holds KV for 10 tokens: blocks [0:4], [4:8], tail 8..9


def token_state(seq: list[int] = D_SEQ, block_size: int = BS) -> SessionState:
    return SessionState(
        token_count=len(seq),
        block_size=block_size,
        block_digests=block_digests(seq, block_size),
        seq_digest=sequence_digest(seq),
    )


@pytest.mark.parametrize(
    ("prompt", "verified"),
    [
        ([*D_SEQ, 1, 2, 3], 10),  # full match: all of D's tokens, the partial block included
        ([*D_SEQ, 1], 10),  # full match, one token left for the reader
        ([*D_SEQ[:9], 999, 1, 2], 8),  # diverges mid-block in the tail: two full blocks
        ([*D_SEQ[:6], 999, *D_SEQ[7:], 5], 4),  # diverges in block 1
        ([999, *D_SEQ[1:], 5], 0),  # diverges in block 0
        (D_SEQ, 8),  # not longer than D's: the full blocks that leave >= 1 token to compute
        (D_SEQ[:8], 4),  # prompt ends on D's block boundary: last block left for the reader
        (D_SEQ[:9], 8),
        (D_SEQ[:5], 4),
        (D_SEQ[:4], 0),
        ([], 0),
    ],
)
def test_verified_tokens(prompt: list[int], verified: int) -> None:
    assert verified_tokens(token_state(), prompt) == verified


def test_verified_tokens_without_blocks_or_state() -> None:
    assert verified_tokens(token_state(block_size=0), [*D_SEQ, 1]) == 0
    assert verified_tokens(SessionState(block_size=BS), [1, 2, 3, 4, 5, 6]) == 0
    aligned = list(range(8))
    # D's sequence block-aligned and the prompt longer: the whole of it.
    assert verified_tokens(token_state(aligned), [*aligned, 1]) == 8


def test_verified_tokens_never_reaches_the_last_prompt_token() -> None:
    state = token_state()
    for n in range(len(D_SEQ) + 3):
        prompt = [*D_SEQ, 7, 7, 7][:n]
        got = verified_tokens(state, prompt)
        assert got <= max(n - 1, 0)
        assert got == len(D_SEQ) or got % BS == 0


NOW = 1_000.0
USABLE = SessionState(api="chat", kv_transfer_params=PARAMS, handle_expires_at=NOW + 1)


@pytest.mark.parametrize(
    ("state", "api", "reason"),
    [
        (USABLE, "chat", None),
        (None, "chat", "no-session"),
        (
            msgspec.structs.replace(USABLE, kv_transfer_params=None, inflight="req-9"),
            "chat",
            "busy",
        ),
        (
            msgspec.structs.replace(
                USABLE, kv_transfer_params=None, no_handle_reason="stream-no-kv-params"
            ),
            "chat",
            "stream-no-kv-params",
        ),
        (
            msgspec.structs.replace(
                USABLE, kv_transfer_params=None, no_handle_reason="from-a-newer-router"
            ),
            "chat",
            "stored-reason-unknown",
        ),
        (msgspec.structs.replace(USABLE, kv_transfer_params=None), "chat", "no-handle"),
        (msgspec.structs.replace(USABLE, kv_transfer_params={}), "chat", "no-handle"),
        (USABLE, "responses", "api-mismatch"),
        (msgspec.structs.replace(USABLE, handle_expires_at=NOW), "chat", "expired"),
        (msgspec.structs.replace(USABLE, handle_expires_at=0.0), "chat", "expired"),
    ],
)
def test_handle_unusable_reason(state: SessionState | None, api: str, reason: str | None) -> None:
    assert handle_unusable_reason(state, api, NOW) == reason


def advance(
    prev: SessionState | None,
    *,
    block_size: int = BS,
    now: float = NOW,
    handle_ttl: float = 400.0,
    **overrides: Any,
) -> SessionState:
    facts: dict[str, Any] = {
        "api": "chat",
        "prefill": "http://p1:8000",
        "decode": "http://d1:8000",
        "kv_transfer_params": PARAMS,
        "no_handle_reason": "",
        "prefix_digest": "ab" * 16,
        "prefix_len": 4,
        "token_ids": list(range(11)),
    }
    done = Finished(**{**facts, **overrides})
    return next_state(prev, done, block_size=block_size, now=now, handle_ttl=handle_ttl)


def test_next_state_first_turn() -> None:
    params = dict(PARAMS)
    tokens = list(range(11))
    state = advance(None, kv_transfer_params=params, token_ids=tokens)
    assert state == SessionState(
        turn=1,
        api="chat",
        prefill="http://p1:8000",
        decode="http://d1:8000",
        decode_engine_id="d-engine-1",
        kv_transfer_params=PARAMS,
        prefix_digest="ab" * 16,
        prefix_len=4,
        token_count=10,
        block_size=BS,
        block_digests=block_digests(tokens[:10], BS),
        seq_digest=sequence_digest(tokens[:10]),
        handle_expires_at=NOW + 400.0,
        created_at=NOW,
        updated_at=NOW,
    )
    assert len(state.block_digests) == 2
    assert params == PARAMS and tokens == list(range(11))  # arguments untouched
    assert state.kv_transfer_params is not params  # and not aliased
    assert verified_tokens(state, [*tokens, 5]) == 10


def test_next_state_records_the_prompt_digest() -> None:
    assert (advance(None).prompt_digest, advance(None).prompt_len) == ("", 0)
    state = advance(None, prompt_digest="cd" * 16, prompt_len=3)
    assert (state.prompt_digest, state.prompt_len) == ("cd" * 16, 3)


def test_next_state_keeps_created_and_counts_turns() -> None:
    prev = msgspec.structs.replace(advance(None, now=10.0), turn=4, inflight="req-1")
    state = advance(prev, now=50.0)
    assert (state.turn, state.created_at, state.updated_at, state.inflight) == (5, 10.0, 50.0, "")


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # No handle (stock vLLM streaming): affinity and the prefix stay, nothing to read.
        (
            {"kv_transfer_params": None, "no_handle_reason": "stream-no-kv-params"},
            {"token_count": 0, "block_digests": (), "seq_digest": "", "handle_expires_at": 0.0},
        ),
        ({"token_ids": None}, {"token_count": 10, "block_digests": (), "seq_digest": ""}),
        # Fewer token ids than D claims to hold: cannot vouch for any of them.
        ({"token_ids": list(range(9))}, {"block_digests": (), "seq_digest": ""}),
        (
            {"kv_transfer_params": {**PARAMS, "remote_num_tokens": None}},
            {"token_count": 0, "block_digests": ()},
        ),
        ({"kv_transfer_params": {**PARAMS, "remote_num_tokens": True}}, {"token_count": 0}),
        ({"kv_transfer_params": {"remote_num_tokens": 4}}, {"decode_engine_id": ""}),
        ({"no_handle_reason": "ignored"}, {"no_handle_reason": ""}),
        ({"block_size": 0}, {"block_digests": (), "block_size": 0}),
    ],
)
def test_next_state_edges(overrides: dict[str, Any], expected: dict[str, Any]) -> None:
    state = advance(None, **overrides)
    assert {name: getattr(state, name) for name in expected} == expected
    assert (state.prefill, state.decode, state.prefix_len) == (
        "http://p1:8000",
        "http://d1:8000",
        4,
    )


def test_next_state_without_handle_reports_why() -> None:
    state = advance(None, kv_transfer_params=None, no_handle_reason="stream-no-kv-params")
    assert state.kv_transfer_params is None and state.decode_engine_id == ""
    assert handle_unusable_reason(state, "chat", NOW) == "stream-no-kv-params"


def _held(n: int) -> dict[str, Any]:
    return {**PARAMS, "remote_num_tokens": n}


def test_next_state_takes_the_shared_blocks_digests_from_the_previous_turn() -> None:
    tokens = list(range(100, 140))
    prev = advance(None, kv_transfer_params=_held(20), token_ids=tokens[:21])
    state = advance(prev, kv_transfer_params=_held(36), token_ids=tokens[:37])
    assert state.block_digests == block_digests(tokens[:36], BS)
    assert state.seq_digest == sequence_digest(tokens[:36])
    # Taken, not hashed again: a previous state's digests (of its sequence, by its sequence
    # digest) are passed on, and the chain goes on from its last one.
    marked = msgspec.structs.replace(prev, block_digests=block_digests([0] * 20, BS))
    state = advance(marked, kv_transfer_params=_held(36), token_ids=tokens[:37])
    known = len(marked.block_digests)
    assert known == 5 and len(state.block_digests) == 9
    assert state.block_digests[:known] == marked.block_digests
    assert state.block_digests[known:] != block_digests(tokens[:36], BS)[known:]


@pytest.mark.parametrize(
    "change",
    [
        {"token_ids": [*range(100, 119), 7, 120]},  # D's sequence is not the previous one's
        {"block_digests": ("a", "b")},  # a stored digest that is not one
        {"block_size": BS * 2, "block_digests": block_digests(range(100, 120), BS * 2)},
        {"token_count": 41},  # held more than the new sequence has
    ],
)
def test_next_state_hashes_every_block_when_the_previous_ones_do_not_apply(
    change: dict[str, Any],
) -> None:
    tokens = list(range(100, 140))
    made = {"token_ids": change.pop("token_ids", tokens[:21])}
    prev = advance(None, kv_transfer_params=_held(20), **made)
    change.setdefault("block_digests", prev.block_digests)
    prev = msgspec.structs.replace(prev, **change)
    state = advance(prev, kv_transfer_params=_held(36), token_ids=tokens[:37])
    assert state.block_digests == block_digests(tokens[:36], BS)
