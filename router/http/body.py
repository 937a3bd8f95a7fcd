"""The request body, read incrementally: refused by its declared length before any byte is
read, cut at --max-body-bytes, and bounded in time by --body-timeout."""

from __future__ import annotations

import asyncio

from starlette.requests import ClientDisconnect, Request

from router.errors import BadRequest, ClientGone, PayloadTooLarge, RequestTimeout
from router.http.framing import BODY_ERROR


def _declared_length(request: Request) -> int | None:
    raw = request.headers.get("content-length")
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise BadRequest("Content-Length must be an integer") from None


async def read_body(request: Request, max_bytes: int, timeout: float) -> bytes:
    """The whole body, or a RouterError before more than `max_bytes` of it is buffered;
    ClientGone when the body stops short (a hang-up, or framing the server could not parse)."""
    declared = _declared_length(request)
    if declared is not None and declared > max_bytes:
        raise PayloadTooLarge(f"request body is {declared} bytes; the limit is {max_bytes}")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise PayloadTooLarge(f"request body is over the limit of {max_bytes} bytes")
                chunks.append(chunk)
    except TimeoutError:
        raise RequestTimeout(f"the request body was not received within {timeout:g} s") from None
    except ClientDisconnect:
        why = getattr(request.state, BODY_ERROR, "")
        raise ClientGone(why or "the client hung up before its body was whole") from None
    return b"".join(chunks)
