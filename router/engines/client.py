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


class _Watchdog:
    """Cancels the reading task once one read has waited `timeout` seconds: one timer per
    idle period instead of one `asyncio.timeout` per chunk (a timer pushed and cancelled for
    every chunk of every stream cost about 17 us of CPU per paced chunk, measured)."""

    def __init__(self, timeout: float) -> None:
        self.loop = asyncio.get_running_loop()
        self.waiting_since: float | None = None  # set while a read is pending
        self._task = asyncio.current_task()
        self._timeout = timeout
        self._fired = False
        self._handle = self.loop.call_later(timeout, self._check)

    def _check(self) -> None:
        since, now = self.waiting_since, self.loop.time()
        if since is not None and now - since >= self._timeout and self._task is not None:
            self._fired = True
            self._task.cancel()  # the task is suspended in that read: it raises there
            return
        left = self._timeout - (now - since) if since is not None else self._timeout
        self._handle = self.loop.call_later(left, self._check)

    def fired(self) -> bool:
        """Whether this watchdog cancelled the read (then the cancel is taken back)."""
        if self._fired and self._task is not None:
            self._task.uncancel()
        return self._fired

    def close(self) -> None:
        self._handle.cancel()


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
        content = self._resp.content
        dog = _Watchdog(idle_timeout)
        try:
            while True:
                dog.waiting_since = dog.loop.time()
                try:
                    chunk = await content.readany()
                except asyncio.CancelledError:
                    if dog.fired():
                        why = f"timed out: silent for {idle_timeout:g} s mid-answer (stalled)"
                        raise UpstreamFailure(why, stalled=True) from None
                    raise
                dog.waiting_since = None
                if not chunk:
                    return
                yield chunk
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise UpstreamFailure(describe(exc)) from exc
        finally:
            dog.close()

    def release(self) -> None:
        self._resp.release()

    def close(self) -> None:
        self._resp.close()


KEEPALIVE_S = 4.0


class Upstream:
    """The engines' client. Opened and closed by the app's lifespan."""

    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._session: aiohttp.ClientSession | None = None
        self._base_headers = dict(JSON_HEADERS)
        if settings.engine_api_key:
            self._base_headers["Authorization"] = f"Bearer {settings.engine_api_key}"

    async def open(self) -> None:
        # vLLM's server (uvicorn) closes a connection idle for 5 s (--timeout-keep-alive): one
        # kept longer may be reused just as the server closes it ("Can not write request
        # body", seen on a /tokenize in the real-vLLM tier), so pooled ones go after 4 s.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S, ttl_dns_cache=300)
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
            # Connected, and no whole answer within `timeout`: the engine stalled (or is far
            # too slow to serve), as a stream silent past --decode-idle-timeout.
            if isinstance(exc, TimeoutError) and not isinstance(
                exc, aiohttp.ConnectionTimeoutError
            ):
                why = f"{url}: no whole answer within {timeout:g} s (stalled)"
                raise UpstreamFailure(why, stalled=True) from exc
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
