"""The simulator's exception types and vLLM's OpenAI-format error body."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    """vLLM's ErrorResponse: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class ApiError(Exception):
    """A request the server rejects before generating (4xx, or a 5xx from fault injection)."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        err_type: str | None = None,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.err_type = err_type or _default_type(status)
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.status, self.param)


def _default_type(status: int) -> str:
    if status == 400:
        return "BadRequestError"
    if status == 404:
        return "NotFoundError"
    if status >= 500:
        return "InternalServerError"
    return HTTPStatus(status).phrase


class KVLoadError(Exception):
    """A failed KV transfer under kv_load_failure_policy="fail" (vLLM #34896): HTTP 500."""


# vLLM's GenerationError surfaces as exactly this body (non-streaming 500 and stream event).
INTERNAL_ERROR = error_body("Internal server error", "InternalServerError", 500)
