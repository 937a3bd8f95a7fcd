"""The generation routes: /v1/chat/completions and /v1/completions, JSON and SSE.

Errors before the response starts are JSON bodies with a status; once a stream has started
a failure is one `data: {"error": ...}` event followed by `data: [DONE]`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from vllm_sim import api, dp, handover, shapes
from vllm_sim.dp import Ranks
from vllm_sim.errors import INTERNAL_ERROR, ApiError, KVLoadError
from vllm_sim.faults import Faults, Injection
from vllm_sim.pause import PAUSED_ERROR, PAUSED_STREAM_ERROR, EnginePaused
from vllm_sim.request import GenRequest, RunResult, Step

logger = logging.getLogger("vllm_sim.serving")

_JSON = "application/json"


@dataclass
class Ids:
    response_id: str  # chatcmpl-<base> / cmpl-<base>
    internal: str  # with the engine's random suffix (vllm#27987)
    base: str


def request_ids(request: web.Request, chat: bool) -> Ids:
    base = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    response_id = ("chatcmpl-" if chat else "cmpl-") + base
    # Completions number each prompt (`-0`) before the engine adds its suffix.
    sub = response_id if chat else f"{response_id}-0"
    return Ids(response_id, f"{sub}-{secrets.token_hex(4)}", base)


def json_response(
    body: Any, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=shapes._encode(body), status=status, content_type=_JSON, headers=headers
    )


def require_json(request: web.Request) -> None:
    if request.content_type != _JSON:
        raise ApiError(
            "Unsupported Media Type: Only 'application/json' is allowed",
            status=415,
            err_type="Unsupported Media Type",
        )


class GenerationRoutes:
    def __init__(self, engine: Ranks, faults: Faults) -> None:
        self.engine = engine
        self.faults = faults
        s = engine.settings
        self.model = s.model
        self.stream_kv_params = s.stream_kv_params or s.version.streams_handles
        # vLLM 0.33 (#40186 merged): every content chunk carries "kv_transfer_params": null.
        self.null_kv_key = s.version.streams_handles
        self.echo_request_id = s.enable_request_id_headers
        self.log_requests = s.log_requests

    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def _handle(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if self.log_requests:  # as vLLM's "Received request" line: which id reached it
            logger.info(
                "Received request %s on %s", request.headers.get("X-Request-Id"), request.path
            )
        inj = self.faults.take()
        if inj.fail_status is not None:
            await asyncio.sleep(inj.stall_s)
            err = ApiError(f"injected fault: HTTP {inj.fail_status}", status=inj.fail_status)
            return json_response(err.body(), status=err.status)
        s = self.engine.settings
        try:
            require_json(request)
            body = api.decode_body(await request.read())
            parsed = api.parse(
                self.engine.tok,
                body,
                chat=chat,
                served_model=s.model,
                max_model_len=s.max_model_len,
                default_max_tokens=s.default_max_tokens,
            )
        except ApiError as exc:
            return json_response(exc.body(), status=exc.status)
        ids = request_ids(request, chat)
        headers = {"X-Request-Id": ids.base} if self.echo_request_id else None
        if inj.stall_s:
            await asyncio.sleep(inj.stall_s)
        req = GenRequest(
            request_id=ids.internal,
            prompt=parsed.prompt,
            max_tokens=parsed.max_tokens,
            min_tokens=parsed.min_tokens,
            stop=parsed.stop,
            include_stop_str_in_output=parsed.include_stop_str_in_output,
            kv_params=parsed.kv_transfer_params,
            base_id=ids.base,
            dp_rank=dp.header_rank(request, self.engine.size),
            seed_blocker=handover.request_blocker(body),
        )
        if parsed.stream:
            return await self._stream(request, parsed, req, ids, inj, headers)
        return await self._complete(request, parsed, req, ids, inj, headers)

    async def _complete(
        self,
        request: web.Request,
        p: api.Parsed,
        req: GenRequest,
        ids: Ids,
        inj: Injection,
        headers: dict[str, str] | None,
    ) -> web.StreamResponse:
        res = RunResult()
        try:
            async with contextlib.aclosing(self.engine.generate(req, res)) as steps:
                async for _ in steps:
                    pass
        except KVLoadError:
            return json_response(INTERNAL_ERROR, status=500, headers=headers)
        except EnginePaused:
            return json_response(PAUSED_ERROR, status=503, headers=headers)
        if inj.drop_after_chunks is not None or inj.error_after_chunks is not None:
            # A non-streaming response has no chunks: drop/error faults cut it off entirely.
            abort_connection(request)
            return web.Response(status=500)
        usage = shapes.usage(len(p.prompt), len(res.output_ids), res.cached_tokens)
        common: dict[str, Any] = {
            "response_id": ids.response_id,
            "created": int(time.time()),
            "model": self.model,
            "finish_reason": res.finish_reason,
            "stop_reason": res.stop_reason,
            "token_ids": list(res.output_ids) if p.return_token_ids else None,
            "prompt_token_ids": p.prompt if p.return_token_ids else None,
            "usage_": usage,
            "kv_transfer_params": res.kv_transfer_params,
        }
        if p.chat:
            reasoning = res.reasoning or None
            body = shapes.chat_response(content=res.content, reasoning=reasoning, **common)
        else:
            body = shapes.completion_response(text=res.reasoning + res.content, **common)
        return json_response(body, headers=headers)

    async def _stream(
        self,
        request: web.Request,
        p: api.Parsed,
        req: GenRequest,
        ids: Ids,
        inj: Injection,
        headers: dict[str, str] | None,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", **(headers or {})}
        )
        await resp.prepare(request)
        out = Sink(request, resp, inj, shapes.sse, _chat_error)
        maker = shapes.ChunkMaker(ids.response_id, int(time.time()), self.model, p.chat)
        res = RunResult()
        first = True
        try:
            async with contextlib.aclosing(self.engine.generate(req, res)) as steps:
                async for step in steps:
                    if first and p.chat:
                        role = maker.role(p.prompt if p.return_token_ids else None)
                        if not await out.send(role):
                            return resp
                    chunk = self._token_chunk(maker, p, step, res, first)
                    first = False
                    if not await out.send(chunk):
                        return resp
        except KVLoadError:
            await out.raw(shapes.stream_error())
            await out.raw(shapes.DONE)
            return resp
        except EnginePaused:
            await out.raw(shapes.sse(PAUSED_STREAM_ERROR))
            await out.raw(shapes.DONE)
            return resp
        except ConnectionResetError:
            return resp  # the client went away; aclosing() already freed the request
        if p.include_usage:
            usage = shapes.usage(len(p.prompt), len(res.output_ids), res.cached_tokens)
            if not await out.send(maker.usage(usage)):
                return resp
        await out.raw(shapes.DONE)
        return resp

    def _token_chunk(
        self, maker: shapes.ChunkMaker, p: api.Parsed, step: Step, res: RunResult, first: bool
    ) -> dict[str, Any]:
        text = step.content if p.chat else step.reasoning + step.content
        chunk = maker.token(
            content=text,
            reasoning=step.reasoning if p.chat else "",
            token_ids=step.token_ids if p.return_token_ids else None,
            finish_reason=step.finish_reason,
            stop_reason=step.stop_reason,
            prompt_token_ids=p.prompt if (first and p.return_token_ids) else None,
        )
        if self.stream_kv_params and step.finish_reason is not None:
            # vLLM PR #40186: the final chunk carries the params (top-level key).
            chunk["kv_transfer_params"] = res.kv_transfer_params
        elif self.null_kv_key:
            chunk["kv_transfer_params"] = None
        return chunk


class Sink:
    """Writes SSE events, applying drop/error faults after K events. `encode` frames one event;
    `error` is what an injected error writes in place of event K (chat and Responses differ)."""

    def __init__(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        inj: Injection,
        encode: Callable[[dict[str, Any]], bytes],
        error: Callable[[dict[str, Any]], bytes],
    ) -> None:
        self.request = request
        self.resp = resp
        self.inj = inj
        self.encode = encode
        self.error = error
        self.sent = 0

    async def send(self, event: dict[str, Any]) -> bool:
        """Send one event; False once a fault ended the stream."""
        if self.inj.error_after_chunks is not None and self.sent >= self.inj.error_after_chunks:
            await self.raw(self.error(event))
            return False
        if self.inj.drop_after_chunks is not None and self.sent >= self.inj.drop_after_chunks:
            # As a process that dies after its last chunk left: those chunks arrive first (a
            # reset that lands with them makes aiohttp's reader drop them, which a loaded
            # machine turned into a flaky test).
            await asyncio.sleep(0.05)
            abort_connection(self.request)
            return False
        await self.raw(self.encode(event))
        self.sent += 1
        return True

    async def raw(self, data: bytes) -> None:
        await self.resp.write(data)


def _chat_error(_event: dict[str, Any]) -> bytes:
    return shapes.stream_error() + shapes.DONE


def abort_connection(request: web.Request) -> None:
    """Close the connection without finishing the response (a crashed or dropped engine)."""
    transport = request.transport
    if transport is not None:
        transport.abort()
