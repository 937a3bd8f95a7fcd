"""The prefill leg: P with the claimed handle or the null handoff, with retries that never
send one P's params twice."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from router import handoff
from router.backends import Instance
from router.errors import RouterError, UpstreamError
from router.rewrite import prefill_body
from router.tracing import span
from router.upstream import UpstreamFailure

if TYPE_CHECKING:
    from router.turn import Turn

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
    rejected_handle: bool


def _parse(raw: bytes) -> dict[str, Any] | None:
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    return body if isinstance(body, dict) else None


async def prefill(turn: Turn, inst: Instance) -> Prefilled:
    """Run the P leg; a rejected handle is retried once as a miss, a failed P on another P."""
    svc, inc = turn.svc, turn.inc
    params = turn.claim.params
    rejected = False
    tried: list[str] = []
    while True:
        body = prefill_body(inc.body, params or handoff.miss_params(), api=inc.api)
        if inc.api == "responses":
            body["store"] = False  # P's one-token response is never worth keeping
        started = time.monotonic()
        reached = True
        with svc.pool.busy(inst), span("kvbaton.prefill", instance=inst.url, hit=bool(params)):
            try:
                status, raw = await svc.upstream.post_json(
                    inst.url + PATHS[inc.api],
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
        if status == 200 and parsed is not None and not handoff.prefill_failed(status, parsed):
            svc.pool.record_success(inst)
            p_params = parsed.get("kv_transfer_params")
            if not handoff.is_handle(p_params):
                # P answered without a handoff: D prefills locally (never the P-leg dict).
                log.info("prefill %s returned no kv_transfer_params; D recomputes", inst.url)
                p_params = None
            return Prefilled(inst, p_params, rejected)
        if params is not None and (status != 0 or reached):
            # P refused the handle (a failed or declined D->P read answers 500 under
            # kv_load_failure_policy=fail, vLLM #34896), or may still be reading it (a
            # timeout): drop it and redo as a miss. A handle is never sent to two P legs.
            log.warning(
                "prefill %s rejected the handle (%s); retrying as a miss", inst.url, failure
            )
            params, rejected = None, True
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
