"""Admin API pieces without I/O: the key check and the conversation view (no raw handle)."""

from __future__ import annotations

import pytest

from router.errors import NotFound, Unauthorized
from router.http.admin import authorize, conversation_view
from sessions.model import SessionState


def test_authorize() -> None:
    authorize("k3y", "Bearer k3y")
    authorize("k3y", "bearer   k3y ")
    with pytest.raises(NotFound, match="disabled"):
        authorize("", "Bearer ")
    for header in (None, "", "Bearer", "Bearer k3", "Basic k3y", "k3y", "Bearer k3yy", "Bearer ké"):
        with pytest.raises(Unauthorized):
            authorize("k3y", header)


def test_conversation_view_hides_the_handle() -> None:
    params = {"remote_block_ids": [[1, 2]], "remote_engine_id": "e", "remote_host": "10.0.0.9"}
    state = SessionState(
        turn=3,
        api="chat",
        decode="http://d:1",
        kv_transfer_params=params,
        token_count=48,
        block_size=16,
        block_digests=("a", "b", "c"),
        handle_expires_at=1100.0,
        created_at=900.0,
        updated_at=1000.0,
    )
    view = conversation_view(state, now=1000.0)
    assert view["handle"] == {
        "present": True,
        "tokens": 48,
        "expires_at": 1100.0,
        "expires_in_s": 100.0,
        "claimed_by": "",
    }
    assert view["verified_blocks"] == 3 and view["turn"] == 3
    assert "10.0.0.9" not in str(view) and "remote_block_ids" not in str(view)
    empty = conversation_view(SessionState(turn=1, no_handle_reason="stream-no-kv-params"), 0.0)
    assert empty["handle"]["present"] is False and empty["handle"]["expires_in_s"] is None
    assert empty["no_handle_reason"] == "stream-no-kv-params"
