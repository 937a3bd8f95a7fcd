"""The Responses route: POST /v1/responses, JSON and named SSE events, on the same engine.

Errors before the response starts are JSON bodies with a status. A failed KV load on a
stream closes the connection after the events already sent, as vLLM 0.32 does (its
GenerationError event fails validation in the Responses stream generator).
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from vllm_sim import api, dp, handover
from vllm_sim import responses_api as rapi
from vllm_sim import responses_shapes as rs
from vllm_sim.dp import Ranks
from vllm_sim.errors import INTERNAL_ERROR, ApiError, KVLoadError
from vllm_sim.faults import Faults, Injection
from vllm_sim.pause import PAUSED_ERROR, EnginePaused
from vllm_sim.request import GenRequest, RunResult
from vllm_sim.serving import Sink, abort_connection, json_response, require_json


@dataclass(frozen=True)
class _Call:
    """One request as the route sees it."""

    parsed: rapi.ResponsesParsed
    response_id: str
    created_at: int
    inj: Injection
    headers: dict[str, str] | None

    def response(
        self,
        model: str,
        output: list[dict[str, Any]],
        status: str,
        usage: dict[str, Any] | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        messages: tuple[list[dict[str, Any]], list[dict[str, Any]]] | None = None,
    ) -> dict[str, Any]:
        return rs.response_object(
            response_id=self.response_id,
            created_at=self.created_at,
            model=model,
            echo=self.parsed.echo,
            max_output_tokens=self.parsed.max_tokens,
            output=output,
            status=status,
            usage_=usage,
            kv_transfer_params=kv_transfer_params,
            messages=messages,
        )


class ResponsesRoute:
    def __init__(self, engine: Ranks, faults: Faults) -> None:
        self.engine = engine
        self.faults = faults
        self.model = engine.settings.model
        self.reasoning_tokens = engine.settings.reasoning_tokens
        self.echo_request_id = engine.settings.enable_request_id_headers

    async def create(self, request: web.Request) -> web.StreamResponse:
        inj = self.faults.take()
        if inj.fail_status is not None:
            await asyncio.sleep(inj.stall_s)
            err = ApiError(f"injected fault: HTTP {inj.fail_status}", status=inj.fail_status)
            return json_response(err.body(), status=err.status)
        s = self.engine.settings
        try:
            require_json(request)
            body = api.decode_body(await request.read())
            parsed = rapi.parse(
                self.engine.tok,
                body,
                served_model=s.model,
                max_model_len=s.max_model_len,
                default_max_tokens=s.default_max_tokens,
            )
        except ApiError as exc:
            return json_response(exc.body(), status=exc.status)
        response_id = parsed.request_id or rs.new_id("resp")
        echoed = request.headers.get("X-Request-Id") or response_id
        headers = {"X-Request-Id": echoed} if self.echo_request_id else None
        call = _Call(parsed, response_id, int(time.time()), inj, headers)
        if inj.stall_s:
            await asyncio.sleep(inj.stall_s)
        req = GenRequest(
            # The engine appends random_uuid()[:8] to the request id (vllm#27987).
            request_id=f"{response_id}-{secrets.token_hex(4)}",
            prompt=parsed.prompt,
            max_tokens=parsed.max_tokens,
            stop=parsed.stop,
            include_stop_str_in_output=parsed.include_stop_str_in_output,
            kv_params=parsed.kv_transfer_params,
            base_id=request.headers.get("X-Request-Id", ""),
            dp_rank=dp.header_rank(request, self.engine.size),
            seed_blocker=handover.request_blocker(body),
        )
        if parsed.stream:
            return await self._stream(request, call, req)
        return await self._complete(request, call, req)

    def _usage(self, call: _Call, res: RunResult) -> dict[str, Any]:
        out = len(res.output_ids)
        return rs.usage(
            len(call.parsed.prompt), out, res.cached_tokens, min(self.reasoning_tokens, out)
        )

    def _messages(
        self, call: _Call, res: RunResult
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
        """enable_response_messages: the prompt's and the output's text and token ids."""
        if not call.parsed.response_messages:
            return None
        prompt = call.parsed.prompt
        tok = self.engine.tok
        return rs.raw_messages(
            tok.decode(prompt), prompt, res.reasoning + res.content, list(res.output_ids)
        )

    async def _complete(
        self, request: web.Request, call: _Call, req: GenRequest
    ) -> web.StreamResponse:
        res = RunResult()
        try:
            async with contextlib.aclosing(self.engine.generate(req, res)) as steps:
                async for _ in steps:
                    pass
        except KVLoadError:
            return json_response(INTERNAL_ERROR, status=500, headers=call.headers)
        except EnginePaused:
            return json_response(PAUSED_ERROR, status=503, headers=call.headers)
        if call.inj.drop_after_chunks is not None or call.inj.error_after_chunks is not None:
            abort_connection(request)  # no chunks to count: the response never comes
            return web.Response(status=500)
        output = rs.output_items(res.reasoning, res.content, parser=self.reasoning_tokens > 0)
        body = call.response(
            self.model,
            output,
            rs.status_of(res.finish_reason),
            self._usage(call, res),
            res.kv_transfer_params,  # vllm#37424: top-level, non-streaming
            self._messages(call, res),
        )
        return json_response(body, headers=call.headers)

    async def _stream(
        self, request: web.Request, call: _Call, req: GenRequest
    ) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", **(call.headers or {})}
        )
        await resp.prepare(request)
        out = Sink(request, resp, call.inj, rs.sse_event, _error_event)
        events = rs.EventStream()
        initial = call.response(self.model, [], "in_progress")
        for kind in ("response.created", "response.in_progress"):
            if not await out.send(events.lifecycle(kind, initial)):
                return resp
        res = RunResult()
        try:
            async with contextlib.aclosing(self.engine.generate(req, res)) as steps:
                async for step in steps:
                    for event in events.delta(step.reasoning, step.content):
                        if not await out.send(event):
                            return resp
        except (KVLoadError, EnginePaused):
            abort_connection(request)
            return resp
        except ConnectionResetError:
            return resp  # the client went away; aclosing() already freed the request
        for event in events.close():
            if not await out.send(event):
                return resp
        final = call.response(
            self.model,
            events.output,
            rs.status_of(res.finish_reason),
            self._usage(call, res),
            # Stock vLLM 0.32 carries the handle here (no --stream-kv-params needed).
            res.kv_transfer_params,
            self._messages(call, res),
        )
        await out.send(events.lifecycle("response.completed", final))
        return resp


def _error_event(event: dict[str, Any]) -> bytes:
    return rs.sse_event(rs.error_event(event["sequence_number"]))
