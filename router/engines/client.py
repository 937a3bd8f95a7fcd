"""Upstream HTTP: one pooled aiohttp session to the engines, every call with explicit timeouts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
import msgspec

from router.config import Settings
from router.tracing import trace_headers

JSON_HEADERS = {"Content-Type": "application/json"}


class UpstreamFailure(Exception):
    """An engine could not be reached, timed out, or broke the connection.

    `reached` is False only when the request cannot have reached the engine (the connection
    was never made): only then may a single-use handle be sent elsewhere.
    """

    def __init__(self, message: str, *, reached: bool = True) -> None:
        super().__init__(message)
        self.reached = reached


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
    ) -> aiohttp.ClientResponse:
        """POST and return the response once its status line and headers have arrived."""
        try:
            # asyncio.timeout, not wait_for: no extra Task on every turn.
            async with asyncio.timeout(self._settings.decode_first_byte_timeout):
                return await self.session.post(
                    url,
                    data=msgspec.json.encode(body),
                    headers=self.headers(request_id, extra_headers),
                )
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise UpstreamFailure(f"{url}: {describe(exc)}") from exc


async def iter_chunks(resp: aiohttp.ClientResponse, idle_timeout: float) -> AsyncIterator[bytes]:
    """The response body as it arrives; an engine silent for idle_timeout is cut off."""
    try:
        while True:
            # asyncio.timeout, not wait_for: no Task per chunk on the relay's hot path.
            async with asyncio.timeout(idle_timeout):
                chunk = await resp.content.readany()
            if not chunk:
                return
            yield chunk
    except (aiohttp.ClientError, TimeoutError, OSError) as exc:
        raise UpstreamFailure(describe(exc)) from exc


def failure(url: str, exc: BaseException) -> UpstreamFailure:
    reached = not isinstance(exc, aiohttp.ClientConnectorError)
    return UpstreamFailure(f"{url}: {describe(exc)}", reached=reached)


def describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
