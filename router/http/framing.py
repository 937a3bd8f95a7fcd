"""Requests Hypercorn cannot parse (a chunk size `ZZ`, a bad request line): its own answer is an
empty 400, so this protocol class answers in the OpenAI error format, with the request id of
the turn the request began (the app then logs the one line, router/http/body.py)."""

from __future__ import annotations

from typing import Any

import h11
import hypercorn.protocol
from hypercorn.protocol.h11 import H11Protocol

from router.errors import error_body
from router.turn.run import new_request_id

# Where the request's scope state says why its body could not be read (read by body.py).
BODY_ERROR = "body_error"
REQUEST_ID = "request_id"  # the endpoint's `request.state.request_id`
WHY = "malformed HTTP request: its framing (request line, headers or chunked encoding) "


class OpenAIErrorsH11(H11Protocol):
    async def _send_error_response(self, status_code: int) -> None:
        state = _request_state(self)
        request_id = state.setdefault(REQUEST_ID, new_request_id())
        message = f"{WHY}could not be parsed (HTTP {status_code})"
        # h11 reports a peer that closed mid-body the same way: then nobody reads the answer.
        closed = getattr(self.connection, "_receive_buffer_closed", False)
        state[BODY_ERROR] = "the client closed the connection mid-request" if closed else message
        body = error_body(message, "invalid_request_error", "malformed_request")
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            (b"x-request-id", request_id.encode()),
            *self.config.response_headers("h11"),
        ]
        await self._send_h11_event(h11.Response(status_code=status_code, headers=headers))
        await self._send_h11_event(h11.Data(data=body))
        await self._send_h11_event(h11.EndOfMessage())


def _request_state(protocol: H11Protocol) -> dict[str, Any]:
    """The scope state of the request in progress (a throwaway dict when there is none: the
    request line itself could not be parsed)."""
    scope = getattr(protocol.stream, "scope", None) if protocol.stream is not None else None
    if not isinstance(scope, dict):
        return {}
    state: dict[str, Any] = scope.setdefault("state", {})
    return state


def install() -> None:
    """Make Hypercorn's HTTP/1.1 connections use OpenAIErrorsH11 (Hypercorn has no setting for
    its error responses; its connection wrapper looks the class up by this name)."""
    hypercorn.protocol.H11Protocol = OpenAIErrorsH11  # type: ignore[attr-defined]
