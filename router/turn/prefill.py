"""The prefill leg: P with the claimed handle or the null handoff, with retries that never
send one P's params twice."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from router.connectors import nixl as handoff
from router.engines.client import UpstreamFailure
from router.engines.pool import Instance
from router.errors import RouterError, UpstreamError
from router.tracing import span
from router.turn.incoming import Incoming
from router.turn.rewrite import ids_prefill_body, prefill_body

if TYPE_CHECKING:
    from router.turn.run import Turn

log = logging.getLogger("kvbaton.legs")

PATHS = {
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
}


class EngineReply(RouterError):
    """An engine's own 4xx answer (the client's request was invalid), relayed as it is."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"engine answered {status}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Prefilled:
    instance: Instance
    params: dict[str, Any] | None
    refused_by: str  # the P that refused the claimed handle ("" if none did)
    prompt_ids: list[int] | None = None  # the prompt as token ids, when P got it that way


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    return body if isinstance(body, dict) else None


def _request(
    inc: Incoming, params: dict[str, Any] | None, ids: list[int] | None
) -> tuple[dict[str, Any], str]:
    """P's body and path: the client's request, or its prompt as token ids on completions."""
    kv = params or handoff.miss_params()
    if ids is not None:
        return ids_prefill_body(inc.body, ids, kv), PATHS["completions"]
    body = prefill_body(inc.body, kv, api=inc.api)
    if inc.api == "responses":
        body["store"] = False  # P's one-token response is never worth keeping
    return body, PATHS[inc.api]


async def prefill(turn: Turn, inst: Instance) -> Prefilled:
    """Run the P leg; a rejected handle is retried once as a miss, a failed P on another P."""
    svc, inc = turn.svc, turn.inc
    params = turn.claim.params
    ids = turn.claim.prompt_ids if svc.ids_leg_on() else None
    refused_by = ""
    refused_ids = 0
    tried: list[str] = []
    while True:
        body, path = _request(inc, params, ids)
        started = time.monotonic()
        reached = True
        with svc.pool.busy(inst), span("kvbaton.prefill", instance=inst.url, hit=bool(params)):
            try:
                status, raw = await svc.upstream.post_json(
                    inst.url + path,
                    body,
                    request_id=turn.request_id,
                    extra_headers=inc.forward_headers,
                    timeout=svc.settings.prefill_timeout,
                )
                failure = f"HTTP {status}"
            except UpstreamFailure as exc:
                status, raw, failure = 0, b"", str(exc)
                reached = exc.reached
        parsed = _parse(raw) if status else None
        outcome = "ok" if status == 200 else "error" if status == 0 or status >= 500 else "rejected"
        svc.metrics.upstream.labels("prefill", inst.url, outcome).observe(
            time.monotonic() - started
        )
        if ids is not None and 400 <= status < 500:
            # P refused the prompt as token ids (it answers 4xx before reading any KV): send
            # the client's body instead; if P takes that, it does not take ids at all.
            log.warning("prefill %s refused the prompt as token ids (HTTP %s)", inst.url, status)
            ids, refused_ids = None, status
            continue
        if status == 200 and parsed is not None and not handoff.prefill_failed(status, parsed):
            svc.pool.record_success(inst)
            if refused_ids:
                svc.switch_ids_leg_off(
                    f"{inst.url} answered {refused_ids} to /v1/completions with token ids "
                    "and 200 to the same prompt as the client sent it"
                )
            p_params = parsed.get("kv_transfer_params")
            if not handoff.is_handle(p_params):
                # P answered without a handoff: D prefills locally (never the P-leg dict).
                log.info("prefill %s returned no kv_transfer_params; D recomputes", inst.url)
                p_params = None
            return Prefilled(inst, p_params, refused_by, ids)
        if params is not None and (status != 0 or reached):
            # P refused the handle (a failed or declined D->P read answers 500 under
            # kv_load_failure_policy=fail, vLLM #34896), or may still be reading it (a
            # timeout): drop it and redo as a miss. A handle is never sent to two P legs.
            log.warning(
                "prefill %s rejected the handle (%s); retrying as a miss", inst.url, failure
            )
            params, refused_by = None, inst.url
            if status != 0:
                continue  # P answered: redo there, as a miss
        if 400 <= status < 500:
            raise EngineReply(status, raw)
        svc.pool.record_failure(inst, failure)
        tried.append(inst.url)
        log.warning("prefill on %s failed (%s); trying another instance", inst.url, failure)
        try:
            inst = svc.pool.pick("prefill", exclude=tried)
        except RouterError:
            raise UpstreamError(f"every prefill instance failed; last: {failure}") from None
