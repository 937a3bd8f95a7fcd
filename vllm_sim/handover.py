"""vllm#51919's handover features, as this simulator models them: first-token seeding (P ships
the token it sampled; D emits it when its KV load completes instead of computing it) and
parking (D admits a request before P answers; `POST /v1/pd_kv_ready` hands it P's params)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web

from vllm_sim.config import SimSettings
from vllm_sim.errors import ApiError
from vllm_sim.faults import Faults
from vllm_sim.metrics import Counters
from vllm_sim.output import OutputText
from vllm_sim.request import GenRequest
from vllm_sim.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

# Why D computes token 1 itself although P sent it (vllm#51919's fallbacks), as the reason
# label of vllm_sim:seed_fallbacks_total.
LOGPROBS = "logprobs"
STRUCTURED = "structured_output"
SPECULATIVE = "speculative_decoding"
LOAD_FAILED = "load_failed"
FINISHES = "finishes_request"
PREEMPTED = "preempted"  # never here: admission reserves every block up front (no preemption)

_LOGPROB_KEYS = ("logprobs", "top_logprobs", "prompt_logprobs")
_STRUCTURED_KEYS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def request_blocker(body: Mapping[str, Any]) -> str:
    """What in a request rules seeding out ("" : nothing): logprobs of any kind, or a
    structured output (the seeded token never went through D's grammar)."""
    # `logprobs: 0` on completions still asks for the sampled token's logprob.
    if any(body.get(k) is not None and body.get(k) is not False for k in _LOGPROB_KEYS):
        return LOGPROBS
    fmt = body.get("response_format")
    text = body.get("text")
    text_fmt = text.get("format") if isinstance(text, Mapping) else None
    structured = any(body.get(k) is not None for k in _STRUCTURED_KEYS)
    structured = structured or body.get("structured_outputs") is not None
    for spec in (fmt, text_fmt):
        if isinstance(spec, Mapping) and spec.get("type") not in (None, "text"):
            structured = True
    return STRUCTURED if structured else ""


def seeded_token(params: Mapping[str, Any] | None) -> int | None:
    """P's token 1 from `first_token_ids` (exactly one non-negative id; else None)."""
    ids = (params or {}).get("first_token_ids")
    if not isinstance(ids, list) or len(ids) != 1:
        return None
    token = ids[0]
    return token if isinstance(token, int) and not isinstance(token, bool) and token >= 0 else None


def is_parked_leg(params: Mapping[str, Any] | None) -> bool:
    """vllm-router#207's early D request: a D leg whose params are not ready yet."""
    if not params:
        return False
    return params.get("remote_ready") is False and bool(params.get("do_remote_prefill"))


@dataclass
class Parking:
    """Requests parked until their P's params arrive, by the X-Request-Id they came with (the
    id the router gave both legs); one table per instance (every data-parallel rank)."""

    timeout: float
    _waiting: dict[str, asyncio.Future[dict[str, Any]]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self._waiting)

    def ids(self) -> list[str]:
        return sorted(self._waiting)

    async def wait(self, base_id: str) -> dict[str, Any] | None:
        """P's params once delivered; None when the park timeout passed first (D then
        prefills locally). Cancelled (the client left), the request is simply gone."""
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        if base_id in self._waiting:
            raise ValueError(f"request {base_id} is already parked")
        self._waiting[base_id] = fut
        try:
            return await asyncio.wait_for(fut, self.timeout)
        except TimeoutError:
            return None
        finally:
            self._waiting.pop(base_id, None)

    def deliver(self, base_id: str, params: dict[str, Any]) -> bool:
        """Hand P's params to the parked request; False if none waits under that id."""
        fut = self._waiting.pop(base_id, None)
        if fut is None or fut.done():
            return False
        fut.set_result(params)
        return True


def ready_body(body: object) -> tuple[str, dict[str, Any]]:
    """A /v1/pd_kv_ready body: `{"request_id": X-Request-Id of D's request,
    "kv_transfer_params": P's params}`; ValueError with the message for a 400."""
    if not isinstance(body, Mapping):
        raise ValueError("the body must be a JSON object")
    request_id = body.get("request_id")
    params = body.get("kv_transfer_params")
    if not isinstance(request_id, str) or not request_id:
        raise ValueError("'request_id' (the parked request's X-Request-Id) is required")
    if not isinstance(params, dict) or not params:
        raise ValueError("'kv_transfer_params' (P's params) must be a non-empty object")
    return request_id, params


def local_params(parked: Mapping[str, Any]) -> dict[str, Any]:
    """A parked request whose params never came prefills locally: a D leg with nothing to
    load (a bidirectional D still returns its handle)."""
    return {"do_remote_prefill": False, "do_remote_decode": bool(parked.get("do_remote_decode"))}


def seed_for(
    settings: SimSettings,
    counters: Counters,
    tok: Tokenizer,
    req: GenRequest,
    leg_kind: str,
    load_failed: bool,
) -> int | None:
    """vllm#51919's scheduler: P's token 1 when D may emit it without its forward; None when
    there is none, or a fallback applies (counted by reason: D then computes it)."""
    token = seeded_token(req.kv_params) if leg_kind == "pull_prompt" else None
    if not settings.seed_first_token or token is None:
        return None
    reason = req.seed_blocker
    if not reason and settings.num_speculative_tokens > 0:
        reason = SPECULATIVE
    if not reason and load_failed:
        reason = LOAD_FAILED
    if not reason and _finishes(settings, tok, req, token):
        reason = FINISHES
    if reason:
        counters.sim_seed_fallbacks[reason] = counters.sim_seed_fallbacks.get(reason, 0) + 1
        return None
    counters.sim_seeded_first_tokens += 1
    return token


def _finishes(settings: SimSettings, tok: Tokenizer, req: GenRequest, token: int) -> bool:
    """Whether token 1 would end the request: its length limit or a stop string in it."""
    if req.max_tokens <= 1:
        return True
    text = OutputText(
        tok, req.stop, req.include_stop_str_in_output, req.min_tokens, settings.reasoning_tokens
    )
    return text.add(token).stop_reason is not None


def emit(counters: Counters, seed: int, computed: int) -> int:
    """The seeded token, as D emits it. D's own answer from the KV it holds is `computed`: a
    seed that differs (a P that read other KV, or params from another request) is counted,
    and still emitted, as D's scheduler would: the answer shows it."""
    if seed != computed:
        counters.sim_seed_mismatches += 1
        logger.warning("seeded first token %d differs from the KV's own %d", seed, computed)
    return seed


def add_route(app: web.Application, parking: Parking, faults: Faults) -> None:
    """`POST /v1/pd_kv_ready` (with `--pd-kv-ready`): 200 once P's params reach the parked
    request; 404 when none waits under that id (it timed out, or its client left); 400 for a
    body without them, which is also how a router learns that an engine serves the route
    (an engine without it answers 404 to every body)."""

    async def ready(request: web.Request) -> web.Response:
        try:
            body = msgspec.json.decode(await request.read())
        except msgspec.DecodeError:
            body = None
        try:
            request_id, params = ready_body(body)
        except ValueError as exc:
            raise ApiError(str(exc)) from None
        if faults.take_ready_drop():  # lost after its 2xx: the park timeout covers it
            logger.warning("dropping the ready notification for %s (fault)", request_id)
        elif not parking.deliver(request_id, params):
            raise ApiError(f"no request {request_id} is parked", status=404)
        return web.json_response({"request_id": request_id, "status": "ready"})

    app.router.add_post("/v1/pd_kv_ready", ready)
