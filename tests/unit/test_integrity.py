"""The session HMAC (sessions/integrity.py) and the router's handle checks (decide/sendable.py)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from router.connectors.nixl.connector import NixlPull
from router.turn.decide.sendable import handle_check
from router.turn.outcomes import Reason
from sessions.integrity import authentic, sign
from sessions.model import SessionState
from tests.unit.handles import HANDLE

KEY = "kvbaton:conv:{t:c}"
A, B = "secret-a-0123456789", "secret-b-0123456789"
STATE = SessionState(
    turn=2,
    api="chat",
    decode="http://d1",
    decode_engine_id="d-engine",
    kv_transfer_params=HANDLE,
    prefix_digest="p" * 32,
    token_count=10,
    block_size=4,
    block_digests=("a", "b"),
    seq_digest="s",
    handle_expires_at=1000.0,
)


def test_a_signed_state_verifies_and_rotation_keeps_old_signatures() -> None:
    signed = sign([A], KEY, STATE)
    assert signed.mac and authentic([A], KEY, signed)
    assert authentic([B, A], KEY, signed), "the new secret first, the old one still verifies"
    assert not authentic([B], KEY, signed), "the old secret dropped"
    assert not authentic([A], "kvbaton:conv:{t:other}", signed), "bound to its key"
    assert authentic([], KEY, STATE) and sign([], KEY, STATE) == STATE  # unsigned


@pytest.mark.parametrize(
    "change",
    [
        {"kv_transfer_params": {**HANDLE, "remote_block_ids": [[2, 3, 4]]}},
        {"kv_transfer_params": {**HANDLE, "remote_num_tokens": 12}},
        {"decode": "http://d2"},
        {"decode_engine_id": "other"},
        {"prefix_digest": "q" * 32},
        {"prompt_digest": "x"},
        {"block_digests": ("a", "c")},
        {"seq_digest": "t"},
        {"token_count": 12},
        {"handle_expires_at": 99999.0},
        {"turn": 3},
    ],
)
def test_every_trusted_field_is_covered(change: dict[str, Any]) -> None:
    signed = sign([A], KEY, STATE)
    assert not authentic([A], KEY, msgspec.structs.replace(signed, **change))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({}, None),
        ({"kv_transfer_params": {"remote_block_ids": "x"}}, Reason.HANDLE_INVALID),
        ({"kv_transfer_params": {**HANDLE, "remote_num_tokens": 100000}}, Reason.HANDLE_INVALID),
        ({"kv_transfer_params": {**HANDLE, "remote_num_tokens": "12"}}, Reason.HANDLE_INVALID),
        ({"token_count": 12}, Reason.HANDLE_INVALID),
        ({"decode_engine_id": "another"}, Reason.HANDLE_INVALID),
        ({"decode_engine_id": "d-engine_dp1"}, None),  # another rank of the same process
        ({"kv_transfer_params": {**HANDLE, "remote_block_ids": [[1, 2]]}}, Reason.HANDLE_INVALID),
        ({"kv_transfer_params": {**HANDLE, "remote_block_ids": [[1, 2, 3, 4]]}}, None),
        (
            {"kv_transfer_params": {**HANDLE, "remote_block_ids": [[1, 2, 3, 4, 5]]}},
            Reason.HANDLE_INVALID,
        ),
    ],
)
def test_handle_check(change: dict[str, Any], reason: Reason | None) -> None:
    state = msgspec.structs.replace(STATE, **change)
    assert handle_check(NixlPull(), state) == reason
