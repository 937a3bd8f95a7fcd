"""OpenAI-format error bodies from the router's exception types."""

from __future__ import annotations

import json

import pytest

from router import errors
from router.errors import (
    BadRequest,
    NotFound,
    PayloadTooLarge,
    RouterError,
    Unauthorized,
    Unavailable,
    UnsupportedMediaType,
    UpstreamError,
)


@pytest.mark.parametrize(
    ("cls", "status", "type_", "code"),
    [
        (RouterError, 500, "internal_error", None),
        (BadRequest, 400, "invalid_request_error", None),
        (Unauthorized, 401, "authentication_error", None),
        (NotFound, 404, "not_found_error", None),
        (PayloadTooLarge, 413, "invalid_request_error", "payload_too_large"),
        (UnsupportedMediaType, 415, "invalid_request_error", "unsupported_media_type"),
        (UpstreamError, 502, "upstream_error", None),
        (Unavailable, 503, "service_unavailable", None),
    ],
)
def test_status_type_code(
    cls: type[RouterError], status: int, type_: str, code: str | None
) -> None:
    exc = cls("boom")
    assert (exc.status, exc.type, exc.code, exc.param, exc.message) == (
        status,
        type_,
        code,
        None,
        "boom",
    )
    assert str(exc) == "boom"
    assert isinstance(exc, RouterError)
    assert json.loads(errors.error_bytes(exc)) == {
        "error": {"message": "boom", "type": type_, "param": None, "code": code}
    }


def test_code_and_param_override_per_instance() -> None:
    exc = NotFound("no model", code="model_not_found", param="model")
    assert (exc.code, exc.param) == ("model_not_found", "model")
    assert NotFound.code is None  # the class default is untouched
    assert json.loads(errors.error_bytes(exc))["error"] == {
        "message": "no model",
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("m", "t"), {"message": "m", "type": "t", "param": None, "code": None}),
        (("m", "t", 500), {"message": "m", "type": "t", "param": None, "code": 500}),
        (
            ('é "q"\n', "t", "c", "p"),
            {"message": 'é "q"\n', "type": "t", "param": "p", "code": "c"},
        ),
    ],
)
def test_error_body(args: tuple[str, ...], expected: dict[str, object]) -> None:
    assert json.loads(errors.error_body(*args)) == {"error": expected}  # type: ignore[arg-type]


def test_sse_error_event_is_one_data_event() -> None:
    event = errors.sse_error_event("D failed", code=502)
    assert event.startswith(b"data: {") and event.endswith(b"}\n\n")
    assert event.count(b"\n") == 2
    assert json.loads(event[6:]) == {
        "error": {"message": "D failed", "type": "upstream_error", "param": None, "code": 502}
    }
    assert json.loads(errors.sse_error_event("x", "other")[6:])["error"]["type"] == "other"
