"""Every exception type of the router, and the one place they become OpenAI-format error bodies.

`RouterError`s reach the client (mapped by `http/app.py`, with the turn's request id); the
others are failures the turn handles (an engine that could not be reached, a bad start).
"""

from __future__ import annotations

import msgspec

_encode = msgspec.json.Encoder().encode


class RouterError(Exception):
    """A failure the client sees as an OpenAI-format error with `status`."""

    status: int = 500
    type: str = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code


class BadRequest(RouterError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(RouterError):
    status = 401
    type = "authentication_error"


class NotFound(RouterError):
    """An unknown model (OpenAI answers 404 for it)."""

    status = 404
    type = "not_found_error"


class UnknownResponse(NotFound):
    """A response id this tenant has no stored response for (OpenAI answers 404 with an
    invalid_request_error)."""

    type = "invalid_request_error"


class RequestTimeout(RouterError):
    """The client did not send its whole body in time (--body-timeout)."""

    status = 408
    type = "invalid_request_error"
    code = "request_timeout"


class PayloadTooLarge(RouterError):
    status = 413
    type = "invalid_request_error"
    code = "payload_too_large"


class UnsupportedMediaType(RouterError):
    status = 415
    type = "invalid_request_error"
    code = "unsupported_media_type"


class Conflict(RouterError):
    """The request conflicts with the pool as it is (an instance already in another role)."""

    status = 409
    type = "invalid_request_error"


class Unprocessable(RouterError):
    """A well-formed request the router refuses (an instance that does not fit)."""

    status = 422
    type = "invalid_request_error"


class UpstreamError(RouterError):
    """An engine failed and no other path is left."""

    status = 502
    type = "upstream_error"


class Unavailable(RouterError):
    """No healthy instance, or the router is shutting down."""

    status = 503
    type = "service_unavailable"


class EngineReply(RouterError):
    """An engine's own 4xx answer (the client's request was invalid), relayed as it is."""

    def __init__(self, status: int, body: bytes, retry_after: int | None = None) -> None:
        super().__init__(f"engine answered {status}")
        self.status = status
        self.body = body
        self.retry_after = retry_after  # seconds, as the Retry-After header (a paused fleet)


class UpstreamFailure(Exception):
    """An engine could not be reached, timed out, or broke the connection.

    `reached` is False only when the request cannot have reached the engine (the connection
    was never made): only then may a single-use handle be sent elsewhere. `stalled`: the
    engine stopped sending in the middle of its answer (--decode-idle-timeout). `busy`: the
    engine refused the request while paused (vLLM 0.33's 503): not counted against its health.
    """

    def __init__(
        self, message: str, *, reached: bool = True, stalled: bool = False, busy: bool = False
    ) -> None:
        super().__init__(message)
        self.reached = reached
        self.stalled = stalled
        self.busy = busy


class MalformedAnswer(Exception):
    """An engine answered 200 with something other than what the API promises: not the JSON
    object (an HTML page, half a body), or a stream cut without its terminator or with an
    event that is not JSON. `sample` is a short prefix of what came, for the log."""

    def __init__(self, message: str, sample: bytes = b"") -> None:
        super().__init__(message)
        self.sample = sample[:SAMPLE_BYTES]


SAMPLE_BYTES = 120  # of a malformed answer, logged


class StartupError(RuntimeError):
    """The engines do not form a valid deployment (e.g. different models)."""


class DemoError(RuntimeError):
    """A part of the `kvbaton demo` stack failed to start or answer; the message says which."""


class ConfigError(ValueError):
    """The configuration is invalid; the message says which setting and why."""


class ClientGone(Exception):
    """The request body ended before it was whole: the client hung up, or the server could not
    parse its framing and has answered it already. No response can reach the client."""


def error_body(
    message: str, type: str, code: str | int | None = None, param: str | None = None
) -> bytes:
    """`{"error": {...}}`, the body OpenAI and vLLM send with a 4xx/5xx status."""
    return _encode({"error": {"message": message, "type": type, "param": param, "code": code}})


def error_bytes(exc: RouterError) -> bytes:
    return error_body(exc.message, exc.type, exc.code, exc.param)


def sse_error_event(
    message: str, type: str = "upstream_error", code: str | int | None = None
) -> bytes:
    """The one event that ends a stream which fails after its 200 was sent (as vLLM does)."""
    return b"data: " + error_body(message, type, code) + b"\n\n"
