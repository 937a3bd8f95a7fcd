"""What every connector's legs are made of: P's request and its one call (span, load, metric),
the decode pick, and P and D at once (push and MoRI-IO WRITE)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import msgspec

from router.engines.client import EngineStream
from router.engines.pool import Instance
from router.engines.versions import engine_paused
from router.errors import EngineReply, Unavailable, UpstreamError, UpstreamFailure
from router.services import Services
from router.tracing import span
from router.turn.decide import handleless
from router.turn.rewrite import PATHS, ids_prefill_body, prefill_body
from router.turn.state import Turn
from sessions.vocabulary import LegOutcome


def parse_answer(raw: bytes) -> dict[str, Any] | None:
    """An engine's JSON answer as a dict (None: not JSON, or not an object)."""
    try:
        body = msgspec.json.decode(raw)
    except msgspec.DecodeError:
        return None
    return body if isinstance(body, dict) else None


def prefill_request(
    turn: Turn, kv: dict[str, Any], ids: list[int] | None = None
) -> tuple[dict[str, Any], str]:
    """P's body and path: the client's request with `kv`, or its prompt as token ids on
    completions."""
    inc = turn.inc
    if ids is not None:
        return ids_prefill_body(inc.body, ids, kv), PATHS["completions"]
    body = prefill_body(inc.body, kv, api=inc.api)
    if inc.api == "responses":
        body["store"] = False  # P's one-token response is never worth keeping
    return body, PATHS[inc.api]


@dataclass(frozen=True)
class Answer:
    """What one P call got back."""

    status: int | None  # None: no HTTP answer
    raw: bytes
    parsed: dict[str, Any] | None
    failure: str  # what went wrong, for logs and errors ("HTTP <status>" if it answered)
    reached: bool  # False only when the connection was never made
    ok: bool  # 200 and a body that does not say it failed
    stalled: bool = False  # no whole answer within --prefill-timeout: ejected at once

    @property
    def paused(self) -> bool:
        """vLLM 0.33 refused the request while paused (503, retryable): busy, not failed."""
        return self.status is not None and engine_paused(self.status, self.parsed)

    def raise_unless_ok(self, url: str) -> dict[str, Any]:
        """The parsed body; EngineReply for P's own 4xx, UpstreamFailure for the rest."""
        if self.status is not None and 400 <= self.status < 500:
            raise EngineReply(self.status, self.raw)
        if not self.ok or self.parsed is None:
            if self.status is None:
                raise UpstreamFailure(f"{url}: {self.failure}", reached=self.reached)
            raise UpstreamFailure(f"{url} answered {self.status}: {self.raw[:200]!r}")
        return self.parsed


async def call_prefill(
    turn: Turn,
    inst: Instance,
    request: tuple[dict[str, Any], str],
    headers: dict[str, str],
    *,
    hit: bool = False,
) -> Answer:
    """P's leg, sent once: counted as P's load, traced, timed in the upstream metric."""
    svc = turn.svc
    body, path = request
    started = time.monotonic()
    reached, stalled = True, False
    status: int | None
    with svc.pool.busy(inst), span("kvbaton.prefill", instance=inst.url, hit=hit):
        try:
            status, raw = await svc.engines.post_json(
                inst.url + path,
                body,
                request_id=turn.leg_id or turn.request_id,
                extra_headers=headers,
                timeout=svc.settings.prefill_timeout,
            )
            failure = f"HTTP {status}"
        except UpstreamFailure as exc:
            status, raw, failure = None, b"", str(exc)
            reached, stalled = exc.reached, exc.stalled
    parsed = parse_answer(raw) if status is not None else None
    svc.metrics.upstream.labels("prefill", inst.url, _outcome(status)).observe(
        time.monotonic() - started
    )
    ok = status == 200 and parsed is not None and not svc.connector.prefill_failed(status, parsed)
    return Answer(status, raw, parsed, failure, reached, ok, stalled)


def _outcome(status: int | None) -> LegOutcome:
    """The upstream metric's outcome of a P call (status None: no answer)."""
    if status == 200:
        return LegOutcome.OK
    return LegOutcome.ERROR if status is None or status >= 500 else LegOutcome.REJECTED


def keep_affinity(turn: Turn) -> None:
    """A connector without a D->P handle (push, MoRI-IO): a continued conversation's verdict
    says affinity (`handleless.affinity`), and it sends no handle."""
    reuse = handleless.affinity(turn.claim.reuse, turn.claim.state is not None)
    if reuse != turn.claim.reuse:
        turn.rejudge(reuse, drop_handle=True)


def pick_decode(
    svc: Services, prefer: str, failed: list[str], peer: Instance | None = None
) -> Instance:
    """Another D than the ones that failed this turn, or the same one again if it is alone;
    one that can read `peer`'s (P's) blocks, when given (the same NIXL connector version)."""
    try:
        return svc.pool.pick("decode", prefer=prefer, exclude=failed, peer=peer)
    except Unavailable:
        if not failed:
            raise
        return svc.pool.pick("decode", prefer=prefer, peer=peer)


async def _settle(task: asyncio.Task[Any]) -> BaseException | None:
    """Cancel a leg still running; its exception, if it had one."""
    if not task.done():
        task.cancel()
    try:
        result = await task
    except asyncio.CancelledError:
        return None
    except Exception as exc:
        return exc
    if result is not None:
        result.close()  # D's request is cancelled: the turn is redone or ends in an error
    return None


class BothFailed(Exception):
    """A concurrent dispatch failed: P's and D's exceptions (either may be None)."""

    def __init__(self, p_exc: BaseException | None, d_exc: BaseException | None) -> None:
        super().__init__(str(p_exc or d_exc))
        self.p_exc, self.d_exc = p_exc, d_exc

    def blame(self) -> tuple[str, UpstreamFailure]:
        """Which leg failed (P first); an engine's own 4xx or a router bug is raised as is."""
        for leg, exc in (("prefill", self.p_exc), ("decode", self.d_exc)):
            if isinstance(exc, EngineReply):
                raise exc
            if isinstance(exc, UpstreamFailure):
                return leg, exc
        raise self.p_exc or self.d_exc or UpstreamError("the concurrent dispatch failed")


async def both(
    prefill: Coroutine[Any, Any, None], decode: Coroutine[Any, Any, EngineStream]
) -> EngineStream:
    """P's and D's legs at once. D's stream, or BothFailed with the failure that ends the
    dispatch (P's first: a D that waited for a write that never came fails because of P);
    the client leaving closes both legs."""
    p_task = asyncio.create_task(prefill)
    d_task = asyncio.create_task(decode)
    try:
        await asyncio.wait({p_task, d_task}, return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # the client left: close both legs
        await asyncio.shield(asyncio.gather(_settle(p_task), _settle(d_task)))
        raise
    p_exc = p_task.exception() if p_task.done() else None
    d_exc = d_task.exception() if d_task.done() else None
    if p_exc is None and d_exc is None:
        return d_task.result()
    p_exc = p_exc or await _settle(p_task)
    d_exc = d_exc or await _settle(d_task)
    raise BothFailed(p_exc, d_exc)
