"""The shared vocabulary: a stored reason the router does not know falls back to a named one,
and the abort families spell what the metric and the log line count."""

from __future__ import annotations

import msgspec
import pytest

from sessions.codec import from_fields, to_fields
from sessions.model import SessionState, handle_unusable_reason
from sessions.vocabulary import AbortReason, Reason


@pytest.mark.parametrize(
    ("stored", "reason"),
    [
        ("stream-no-kv-params", Reason.STREAM_NO_KV_PARAMS),
        ("decode-local", Reason.DECODE_LOCAL),
        ("released", Reason.RELEASED),
        ("stored-reason-unknown", Reason.STORED_REASON_UNKNOWN),
        ("from-a-newer-router", Reason.STORED_REASON_UNKNOWN),
        ("Stream-No-KV-Params", Reason.STORED_REASON_UNKNOWN),  # values are exact
        (" no-kv-params", Reason.STORED_REASON_UNKNOWN),
    ],
)
def test_a_stored_reason_is_read_back_as_a_reason(stored: str, reason: Reason) -> None:
    assert Reason.stored(stored) is reason


def test_the_enum_itself_stays_strict() -> None:
    """Only values read back from the store fall back; a reason the code names must exist."""
    with pytest.raises(ValueError):
        Reason("from-a-newer-router")


def test_an_unknown_reason_in_redis_fields_becomes_a_named_miss() -> None:
    """A state written by a newer router (its reason unknown here) decodes, and its turn gets a
    named reason instead of an error."""
    fields = to_fields(SessionState(turn=3, api="chat", no_handle_reason="kv-moved-elsewhere"))
    state = from_fields({k.encode(): v.encode() for k, v in fields.items()})
    assert state.no_handle_reason == "kv-moved-elsewhere"  # kept as stored (admin shows it)
    assert handle_unusable_reason(state, "chat", 0.0) is Reason.STORED_REASON_UNKNOWN
    busy = msgspec.structs.replace(state, inflight="req-1")
    assert handle_unusable_reason(busy, "chat", 0.0) is Reason.BUSY


def test_abort_families() -> None:
    assert AbortReason.finish("abort") == "finish-abort"
    assert AbortReason.finish(None) == AbortReason.finish("") == "finish-missing"
    assert AbortReason.engine(404) == "engine-404"
    assert AbortReason.raised(TimeoutError("slow")) == "TimeoutError"
    assert [str(r) for r in AbortReason] == [
        "client-disconnected",
        "decode-broke",
        "decode-error-event",
        "decode-malformed",
    ]
