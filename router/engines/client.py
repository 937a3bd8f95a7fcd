"""The engine seam: what the router asks of an engine (post JSON, open a stream, get), as a
Protocol, and its aiohttp implementation (one pooled session, every call with explicit
timeouts). Unit tests drive the turn through an in-process fake of the same Protocol."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any, Protocol

import aiohttp
import msgspec

from router.config import Settings
from router.errors import UpstreamFailure
from router.tracing import trace_headers

JSON_HEADERS = {"Content-Type": "application/json"}


class EngineStream(Protocol):
    """An engine's response whose status line and headers have arrived; the body follows."""

    status: int
    content_type: str

    async def read(self) -> bytes:
        """The whole body (an error answer); raises UpstreamFailure."""
        ...

    def chunks(self, idle_timeout: float) -> AsyncIterator[bytes]:
        """The body as it arrives; an engine silent for idle_timeout raises UpstreamFailure."""
        ...

    def release(self) -> None:
        """Done with a body read to its end: the connection goes back to the pool."""
        ...

    def close(self) -> None:
        """Cut the connection: the engine cancels the request."""
        ...


class EngineClient(Protocol):
    """What the router asks of the engines. Every call raises UpstreamFailure when the engine
    cannot be reached, times out or breaks the connection."""

    async def post_json(
        self,
        url: str,
        body: Mapping[str, Any],
        *,
        request_id: str,
        timeout: float,
        extra_headers: Mapping[str, str] | None = None,
    ) -> tuple[int, bytes]: ...

    async def get(self, url: str, *, timeout: float) -> tuple[int, bytes]: ...

    async def open_stream(
        self,
        url: str,
        body: Mapping[str, Any],
        *,
        request_id: str,
        extra_headers: Mapping[str, str] | None = None,
    ) -> EngineStream: ...


class _AiohttpStream:
    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.content_type = resp.headers.get("Content-Type", "text/event-stream")

    async def read(self) -> bytes:
        try:
            return await self._resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise UpstreamFailure(describe(exc)) from exc
        finally:
            self._resp.release()

    async def chunks(self, idle_timeout: float) -> AsyncIterator[bytes]:
        try:
            while True:
                # asyncio.timeout, not wait_for: no Task per chunk on the relay's hot path.
                async with asyncio.timeout(idle_timeout):
                    chunk = await self._resp.content.readany()
                if not chunk:
                    return
                yield chunk
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise UpstreamFailure(describe(exc)) from exc

    def release(self) -> None:
        self._resp.release()

    def close(self) -> None:
        self._resp.close()


class Upstream:
    """The engines' client. Opened and closed by the app's lifespan."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._session: aiohttp.ClientSession | None = None
        self._base_headers = dict(JSON_HEADERS)
        if settings.engine_api_key:
            self._base_headers["Authorization"] = f"Bearer {settings.engine_api_key}"

    async def open(self) -> None:
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, connect=self._settings.connect_timeout),
            auto_decompress=False,
            skip_auto_headers=("User-Agent",),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Upstream.open() was not called")
        return self._session

    def headers(self, request_id: str, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        # traceparent (with OpenTelemetry on) lets vLLM's own spans join the turn's trace.
        return {
            **(extra or {}),
            **trace_headers(),
            **self._base_headers,
            "X-Request-Id": request_id,
        }

    async def post_json(
        self,
        url: str,
        body: Mapping[str, Any],
        *,
        request_id: str,
        timeout: float,
        extra_headers: Mapping[str, str] | None = None,
    ) -> tuple[int, bytes]:
        """POST a JSON body and read the whole answer: (status, body bytes)."""
        try:
            async with self.session.post(
                url,
                data=msgspec.json.encode(body),
                headers=self.headers(request_id, extra_headers),
                timeout=aiohttp.ClientTimeout(
                    total=timeout, connect=self._settings.connect_timeout
                ),
            ) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise failure(url, exc) from exc

    async def get(self, url: str, *, timeout: float) -> tuple[int, bytes]:
        try:
            async with self.session.get(
                url,
                headers=self._base_headers,
                timeout=aiohttp.ClientTimeout(
                    total=timeout, connect=self._settings.connect_timeout
                ),
            ) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise failure(url, exc) from exc

    async def open_stream(
        self,
        url: str,
        body: Mapping[str, Any],
        *,
        request_id: str,
        extra_headers: Mapping[str, str] | None = None,
    ) -> EngineStream:
        """POST and return the response once its status line and headers have arrived."""
        try:
            # asyncio.timeout, not wait_for: no extra Task on every turn.
            async with asyncio.timeout(self._settings.decode_first_byte_timeout):
                resp = await self.session.post(
                    url,
                    data=msgspec.json.encode(body),
                    headers=self.headers(request_id, extra_headers),
                )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise UpstreamFailure(f"{url}: {describe(exc)}") from exc
        return _AiohttpStream(resp)


def failure(url: str, exc: BaseException) -> UpstreamFailure:
    reached = not isinstance(exc, aiohttp.ClientConnectorError)
    return UpstreamFailure(f"{url}: {describe(exc)}", reached=reached)


def describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
