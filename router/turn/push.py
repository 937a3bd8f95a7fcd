"""A turn in push mode (`--kv-connector nixl-push`, vLLM's push demo proxy): P and D are called
concurrently with one request id and a fresh transfer id on every dispatch (retries too).

P gets the client's request with `max_tokens=1` and the null handoff plus the transfer id; D
gets the client's request with P's coordinates (engine id, side-channel host and port, tp and
pp sizes), `remote_request_id` (this turn's request id) and the transfer id, no block ids. D
registers the blocks it lacks with P, P writes them. Our response starts only once P has
answered and D's status is in, so a failed leg is redone (a new transfer id) or ends in one
clear error, and nothing is committed for a failed turn.

Failure paths: P fails while D waits for the write (D would give up after its
push_registration_timeout): D's request is closed and the turn redone on another P. D fails
while P holds blocks (P frees them after kv_lease_duration): P's request is closed and the
turn redone on another D. The client leaves: both legs are closed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Coroutine
from typing import Any

from starlette.responses import Response

from router.engines import coords, ranks
from router.engines.client import EngineStream
from router.engines.discovery import learn_coordinates
from router.engines.pool import Instance
from router.errors import EngineReply, Unavailable, UpstreamError, UpstreamFailure
from router.tracing import span
from router.turn import decide
from router.turn.outcomes import Reason
from router.turn.prefill import parse_answer
from router.turn.rewrite import PATHS, prefill_body
from router.turn.state import Turn

log = logging.getLogger("kvbaton.legs")

OpenDecode = Callable[[Turn, Instance, dict[str, Any] | None], Coroutine[Any, Any, EngineStream]]
Respond = Callable[[Turn, Instance, EngineStream], Coroutine[Any, Any, Response]]

# Verdicts about the session itself, which push mode keeps; every other one (they are about
# a handle, which push mode never has) becomes push-affinity.
_SESSION_REASONS = frozenset(
    {
        Reason.NO_SESSION,
        Reason.BUSY,
        Reason.STORE_UNAVAILABLE,
        Reason.CORRUPT_STATE,
        Reason.HANDLE_UNAUTHENTICATED,
        Reason.PREFIX_MISMATCH,
        Reason.API_MISMATCH,
        Reason.NO_CONVERSATION_ID,
        Reason.REUSE_DISABLED,
    }
)


def new_transfer_id() -> str:
    return f"xfer-{uuid.uuid4()}"


def verdict(turn: Turn) -> None:
    """No D->P reuse for push (vllm#46473): a continued conversation says push-affinity."""
    reason = turn.claim.reuse.reason
    if turn.claim.state is not None and reason not in _SESSION_REASONS:
        turn.claim = turn.claim.miss(Reason.PUSH_AFFINITY)


async def _pick_prefill(turn: Turn, prefer: str, failed: list[str]) -> Instance:
    """A usable P whose coordinates are known (those unknown are probed first, at most once
    per coords.PROBE_EVERY_S each)."""
    svc = turn.svc
    unknown = [i for i in svc.pool.instances("prefill") if i.kv.coords is None and i.usable]
    if unknown and not any(i.kv.coords and i.usable for i in svc.pool.instances("prefill")):
        await asyncio.gather(*(learn_coordinates(svc, i) for i in unknown))  # none to use yet
    else:  # learned in the background: a P that does not answer must not delay this turn
        for inst in unknown:
            if inst.kv.probe is None or inst.kv.probe.done():
                inst.kv.probe = asyncio.create_task(learn_coordinates(svc, inst))
    blind = [i.url for i in svc.pool.instances("prefill") if i.kv.coords is None]
    for exclude in ([*failed, *blind], blind) if failed else ([*blind],):
        with contextlib.suppress(Unavailable):
            return svc.pool.pick("prefill", prefer=prefer, exclude=exclude)
    raise Unavailable(
        "no usable prefill instance with known push coordinates (see /status: "
        "instances.prefill[].kv.reason)"
    )


def _free_prefill(turn: Turn, exclude: list[str], reply: EngineReply) -> Instance:
    """Another P with known coordinates than those excluded; none: the client gets the 429."""
    pool = turn.svc.pool
    blind = [i.url for i in pool.instances("prefill") if i.kv.coords is None]
    try:
        return pool.pick("prefill", exclude=[*exclude, *blind])
    except Unavailable:
        raise reply from None


def _pick_decode(turn: Turn, prefer: str, failed: list[str]) -> Instance:
    try:
        return turn.svc.pool.pick("decode", prefer=prefer, exclude=failed)
    except Unavailable:
        if not failed:
            raise
        return turn.svc.pool.pick("decode", prefer=prefer)


async def _prefill(turn: Turn, inst: Instance, transfer_id: str) -> None:
    """P's leg; raises EngineReply (its 4xx) or UpstreamFailure. Learns P's coordinates from
    its answer, so a P restarted with a new engine id is addressed right on the next turn."""
    svc, inc = turn.svc, turn.inc
    body = prefill_body(inc.body, coords.p_params(transfer_id), api=inc.api)
    headers = turn.leg_headers(inst)
    known = inst.kv.coords
    rank = ranks.rank_of(known.engine_id) if known is not None else -1
    if rank >= 0:  # D was told this rank's engine id and port: P's leg must run there
        headers[ranks.HEADER] = str(rank)
        turn.ranks["prefill"] = rank
    if inc.api == "responses":
        body["store"] = False
    started = time.monotonic()
    outcome = "error"
    try:
        with svc.pool.busy(inst), span("kvbaton.prefill", instance=inst.url, hit=False):
            status, raw = await svc.engines.post_json(
                inst.url + PATHS[inc.api],
                body,
                request_id=turn.request_id,
                extra_headers=headers,
                timeout=svc.settings.prefill_timeout,
            )
        parsed = parse_answer(raw)
        if 400 <= status < 500:
            outcome = "rejected"
            raise EngineReply(status, raw)
        if status != 200 or parsed is None or svc.connector.prefill_failed(status, parsed):
            raise UpstreamFailure(f"{inst.url} answered {status}: {raw[:200]!r}")
        outcome = "ok"
    finally:
        svc.metrics.upstream.labels("prefill", inst.url, outcome).observe(
            time.monotonic() - started
        )
    coords.learn(inst.kv, parsed.get("kv_transfer_params"), "response", f"prefill {inst.url}")


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


async def _dispatch(
    turn: Turn, p_inst: Instance, d_inst: Instance, open_decode: OpenDecode
) -> EngineStream:
    """Both legs at once, with a new transfer id."""
    assert p_inst.kv.coords is not None
    transfer_id = new_transfer_id()
    kv = coords.d_params(p_inst.kv.coords, turn.request_id, transfer_id)
    return await both(_prefill(turn, p_inst, transfer_id), open_decode(turn, d_inst, kv))


async def both(
    prefill: Coroutine[Any, Any, None], decode: Coroutine[Any, Any, EngineStream]
) -> EngineStream:
    """P's and D's legs at once (push and MoRI-IO WRITE mode). D's stream, or PushFailed with
    the failure that ends the dispatch (P's first: a D that waited for a write that never
    came fails because of P); the client leaving closes both legs."""
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
    raise PushFailed(p_exc, d_exc)


class PushFailed(Exception):
    def __init__(self, p_exc: BaseException | None, d_exc: BaseException | None) -> None:
        super().__init__(str(p_exc or d_exc))
        self.p_exc, self.d_exc = p_exc, d_exc


def _blame(failed: PushFailed) -> tuple[str, UpstreamFailure]:
    """Which leg failed (P first); an engine's own 4xx or a router bug is raised as is."""
    for leg, exc in (("prefill", failed.p_exc), ("decode", failed.d_exc)):
        if isinstance(exc, EngineReply):
            raise exc
        if isinstance(exc, UpstreamFailure):
            return leg, exc
    raise failed.p_exc or failed.d_exc or UpstreamError("push dispatch failed")


async def serve(turn: Turn, open_decode: OpenDecode, respond: Respond) -> Response:
    """The whole push-mode turn, from placement to the response."""
    svc = turn.svc
    verdict(turn)
    state = turn.claim.state
    failed_p: list[str] = []
    failed_d: list[str] = []
    busy: list[str] = []  # P instances that answered 429 this turn
    p_inst = await _pick_prefill(turn, state.prefill if state else "", failed_p)
    d_inst = _pick_decode(turn, state.decode if state else "", failed_d)
    while True:
        turn.decode = d_inst
        try:
            resp = await _dispatch(turn, p_inst, d_inst, open_decode)
        except PushFailed as exc:
            if isinstance(exc.p_exc, EngineReply) and exc.p_exc.status == 429:
                busy.append(p_inst.url)  # P is busy, not failing: another P, or relay its 429
                p_inst = _free_prefill(turn, [*failed_p, *busy], exc.p_exc)
                continue
            leg, why = _blame(exc)
            inst = p_inst if leg == "prefill" else d_inst
            svc.pool.record_failure(inst, str(why))
            (failed_p if leg == "prefill" else failed_d).append(inst.url)
            log.warning("push %s on %s failed: %s; redoing the turn", leg, inst.url, why)
            if not decide.redo_decode(len(failed_p) + len(failed_d)):
                raise UpstreamError(f"push turn failed twice; last ({leg}): {why}") from None
            if leg == "prefill":
                p_inst = await _pick_prefill(turn, "", failed_p)
            else:
                d_inst = _pick_decode(turn, "", failed_d)
            continue
        svc.pool.record_success(p_inst)
        turn.prefill = p_inst
        return await respond(turn, d_inst, resp)
