"""The Redis HASH encoding of a session state: readable, lossless, and strict about garbage."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from sessions.codec import StateDecodeError, from_fields, to_fields
from sessions.model import SessionState

STATE = SessionState(
    turn=3,
    api="chat",
    prefill="http://p1:8000",
    decode="http://d1:8000",
    decode_engine_id="d-engine-1",
    decode_started=1_732_934_000.5,
    kv_transfer_params={"remote_engine_id": "d-engine-1", "remote_block_ids": [4, 5]},
    prefix_digest="ab" * 16,
    prefix_len=5,
    prompt_digest="ef" * 16,
    prompt_len=4,
    token_count=37,
    block_size=16,
    block_digests=("0123456789abcdef", "fedcba9876543210"),
    seq_digest="cd" * 16,
    handle_expires_at=1_732_935_000.25,
    created_at=1_732_934_400.5,
    updated_at=1_732_934_550.125,
    inflight="req-7",
)


def test_fields_are_readable() -> None:
    fields = to_fields(STATE)
    assert fields == {
        "turn": "3",
        "api": "chat",
        "prefill": "http://p1:8000",
        "decode": "http://d1:8000",
        "decode_engine_id": "d-engine-1",
        "decode_started": "1732934000.5",
        "kv_transfer_params": '{"remote_engine_id":"d-engine-1","remote_block_ids":[4,5]}',
        "no_handle_reason": "",
        "prefix_digest": "ab" * 16,
        "prefix_len": "5",
        "prompt_digest": "ef" * 16,
        "prompt_len": "4",
        "token_count": "37",
        "block_size": "16",
        "block_digests": "0123456789abcdef fedcba9876543210",
        "seq_digest": "cd" * 16,
        "handle_expires_at": "1732935000.25",
        "created_at": "1732934400.5",
        "updated_at": "1732934550.125",
        "created": "2024-11-30T02:40:00.500+00:00",
        "updated": "2024-11-30T02:42:30.125+00:00",
        "inflight": "req-7",
        "mac": "",
        "prefill_rank": "",
        "decode_rank": "",
        "prefill_tokens": "0",
    }


def test_round_trip_from_str_and_bytes() -> None:
    fields = to_fields(STATE)
    assert from_fields(fields) == STATE
    assert from_fields({k.encode(): v.encode() for k, v in fields.items()}) == STATE
    assert from_fields(to_fields(SessionState())) == SessionState()
    assert to_fields(SessionState())["kv_transfer_params"] == ""


def test_missing_optional_fields_take_defaults() -> None:
    assert from_fields({"turn": "2"}) == SessionState(turn=2)
    assert from_fields({b"turn": b"1", b"kv_transfer_params": b"null"}) == SessionState(turn=1)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"api": "chat"},  # no turn
        {"turn": "three"},
        {"turn": "-1"},
        {"turn": "1.5"},
        {"turn": "²"},
        {"turn": "1", "token_count": ""},
        {"turn": "1", "created_at": "yesterday"},
        {"turn": "1", "handle_expires_at": "nan"},
        {"turn": "1", "updated_at": "inf"},
        {"turn": "1", "kv_transfer_params": "{not json"},
        {"turn": "1", "kv_transfer_params": "[1, 2]"},
        {b"turn": b"\xff\xfe"},
    ],
)
def test_garbage_is_a_decode_error(fields: dict[Any, Any]) -> None:
    with pytest.raises(StateDecodeError):
        from_fields(fields)
    assert issubclass(StateDecodeError, ValueError)


_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**63 - 1)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_seconds = st.floats(min_value=0, max_value=4e9, allow_nan=False)
_count = st.integers(min_value=0, max_value=2**40)
_hex = st.text(alphabet="0123456789abcdef", min_size=1, max_size=32)

states = st.builds(
    SessionState,
    turn=_count,
    api=st.sampled_from(["chat", "completions", "responses", ""]),
    prefill=st.text(max_size=30),
    decode=st.text(max_size=30),
    decode_engine_id=st.text(max_size=30),
    decode_started=_seconds,
    kv_transfer_params=st.none() | st.dictionaries(st.text(max_size=8), _json, max_size=5),
    no_handle_reason=st.text(max_size=20),
    prefix_digest=st.text(max_size=32),
    prefix_len=_count,
    prompt_digest=st.text(max_size=32),
    prompt_len=_count,
    token_count=_count,
    block_size=_count,
    block_digests=st.lists(_hex, max_size=5).map(tuple),
    seq_digest=st.text(max_size=32),
    handle_expires_at=_seconds,
    created_at=_seconds,
    updated_at=_seconds,
    inflight=st.text(max_size=20),
)


@given(states)
def test_round_trip_property(state: SessionState) -> None:
    fields = to_fields(state)
    assert all(isinstance(v, str) for v in fields.values())
    assert from_fields(fields) == state
    # What Redis hands back: UTF-8 bytes.
    assert from_fields({k.encode(): v.encode() for k, v in fields.items()}) == state


def test_data_parallel_ranks_round_trip_and_old_sessions_decode() -> None:
    ranked = msgspec.structs.replace(STATE, prefill_rank=0, decode_rank=3)
    fields = to_fields(ranked)
    assert (fields["prefill_rank"], fields["decode_rank"]) == ("0", "3")
    assert from_fields(fields) == ranked
    assert to_fields(STATE)["decode_rank"] == ""  # no rank chosen
    old = {k: v for k, v in to_fields(STATE).items() if not k.endswith("_rank")}
    assert from_fields(old).decode_rank == -1  # stored before the fields existed
    with pytest.raises(StateDecodeError):
        from_fields({**fields, "decode_rank": "-2"})
