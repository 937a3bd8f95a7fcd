"""The render routes (vLLM's `entrypoints/scale_out/render`, 0.32 and 0.33): a request
rendered to what the engine would compute, as a `GenerateRequest` for `/inference/v1/generate`,
without running it. Registered on every generating engine but served only with
`--enable-scale-out`; without it each answers 403 PermissionDeniedError (measured on vLLM 0.32
CPU; the same code in 0.33). The simulator renders with its own template, so the token ids are
exactly its generation routes' prompts."""

from __future__ import annotations

import uuid
from typing import Any

from aiohttp import web

from vllm_sim import api
from vllm_sim import responses_api as rapi
from vllm_sim.dp import Ranks
from vllm_sim.serving import json_response, require_json

PATHS = ("/v1/chat/completions/render", "/v1/completions/render", "/v1/responses/render")
# vLLM's answer on every scale-out route of an engine started without --enable-scale-out.
DISABLED = {
    "error": {
        "message": "Scale-out endpoints are disabled. Restart vllm serve with "
        "--enable-scale-out to enable them.",
        "type": "PermissionDeniedError",
        "param": None,
        "code": 403,
    }
}


def _generate_request(
    request_id: str, prompt: list[int], max_tokens: int, stream: bool, model: str, kv: Any
) -> dict[str, Any]:
    """vLLM's GenerateRequest as 0.32 dumps it (sampling params reduced to max_tokens)."""
    return {
        "request_id": request_id,
        "token_ids": prompt,
        "token_offsets": None,
        "features": None,
        "content_parts": None,
        "sampling_params": {"max_tokens": max_tokens},
        "model": model,
        "reasoning_ended": None,
        "reasoning_parser_kwargs": None,
        "return_token_ids": None,
        "output_mode": "tokens",
        "stream": stream,
        "stream_options": None,
        "cache_salt": None,
        "priority": 0,
        "kv_transfer_params": kv,
        "ec_transfer_params": None,
    }


class RenderRoutes:
    def __init__(self, ranks: Ranks) -> None:
        self.ranks = ranks

    def _base(self, request: web.Request) -> str:
        return request.headers.get("X-Request-Id") or uuid.uuid4().hex

    async def _parsed(self, request: web.Request, chat: bool) -> api.Parsed:
        require_json(request)
        s = self.ranks.settings
        return api.parse(
            self.ranks.tok,
            api.decode_body(await request.read()),
            chat=chat,
            served_model=s.model,
            max_model_len=s.max_model_len,
            default_max_tokens=s.default_max_tokens,
        )

    async def chat(self, request: web.Request) -> web.Response:
        p = await self._parsed(request, chat=True)
        rid = f"chatcmpl-{self._base(request)}"
        model = self.ranks.settings.model
        return json_response(
            _generate_request(rid, p.prompt, p.max_tokens, p.stream, model, p.kv_transfer_params)
        )

    async def completions(self, request: web.Request) -> web.Response:
        """A list: one GenerateRequest per prompt (the simulator serves one)."""
        p = await self._parsed(request, chat=False)
        rid = f"cmpl-{self._base(request)}-0"
        model = self.ranks.settings.model
        return json_response(
            [_generate_request(rid, p.prompt, p.max_tokens, p.stream, model, p.kv_transfer_params)]
        )

    async def responses(self, request: web.Request) -> web.Response:
        require_json(request)
        s = self.ranks.settings
        p = rapi.parse(
            self.ranks.tok,
            api.decode_body(await request.read()),
            served_model=s.model,
            max_model_len=s.max_model_len,
            default_max_tokens=s.default_max_tokens,
        )
        rid = p.request_id or f"resp_{uuid.uuid4().hex[:16]}"
        return json_response(
            _generate_request(rid, p.prompt, p.max_tokens, p.stream, s.model, p.kv_transfer_params)
        )


async def _disabled(request: web.Request) -> web.Response:
    return json_response(DISABLED, status=403)


def add_routes(app: web.Application, ranks: Ranks) -> None:
    r = app.router
    if not ranks.settings.enable_scale_out:
        for path in PATHS:
            r.add_post(path, _disabled)
        return
    routes = RenderRoutes(ranks)
    r.add_post("/v1/chat/completions/render", routes.chat)
    r.add_post("/v1/completions/render", routes.completions)
    r.add_post("/v1/responses/render", routes.responses)
