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
import uuid

from starlette.responses import Response

from router.connectors.legs.calls import (
    BothFailed,
    both,
    call_prefill,
    keep_affinity,
    pick_decode,
    prefill_request,
)
from router.connectors.legs.decode import open_decode, respond
from router.connectors.nixl_push import coords
from router.connectors.nixl_push.coords import Directory
from router.engines import ranks
from router.engines.client import EngineStream
from router.engines.pool import Instance
from router.errors import EngineReply, Unavailable, UpstreamError
from router.turn.decide import attempts
from router.turn.state import Turn

log = logging.getLogger("kvbaton.legs")


def new_transfer_id() -> str:
    return f"xfer-{uuid.uuid4()}"


async def learn(turn: Turn, known: Directory, inst: Instance, *, force: bool = False) -> None:
    svc = turn.svc
    model = svc.model or inst.model or svc.settings.model
    await known.learn(svc.engines, inst, model, svc.settings.connect_timeout + 5.0, force=force)


async def _pick_prefill(turn: Turn, known: Directory, prefer: str, failed: list[str]) -> Instance:
    """A usable P whose coordinates are known (those unknown are probed first, at most once
    per coords.PROBE_EVERY_S each)."""
    svc = turn.svc
    prefills = svc.pool.instances("prefill")
    unknown = [i for i in prefills if known.of(i.url).coords is None and i.usable]
    if unknown and not any(known.of(i.url).coords and i.usable for i in prefills):
        await asyncio.gather(*(learn(turn, known, i) for i in unknown))  # none to use yet
    else:  # learned in the background: a P that does not answer must not delay this turn
        for inst in unknown:
            k = known.of(inst.url)
            if k.probe is None or k.probe.done():
                k.probe = asyncio.create_task(learn(turn, known, inst))
    blind = _blind(turn, known)
    for exclude in ([*failed, *blind], blind) if failed else ([*blind],):
        with contextlib.suppress(Unavailable):
            return svc.pool.pick("prefill", prefer=prefer, exclude=exclude)
    raise Unavailable(
        "no usable prefill instance with known push coordinates (see /status: "
        "instances.prefill[].kv.reason)"
    )


def _blind(turn: Turn, known: Directory) -> list[str]:
    return [i.url for i in turn.svc.pool.instances("prefill") if known.of(i.url).coords is None]


def _free_prefill(turn: Turn, known: Directory, exclude: list[str], reply: EngineReply) -> Instance:
    """Another P with known coordinates than those excluded; none: the client gets the 429."""
    try:
        return turn.svc.pool.pick("prefill", exclude=[*exclude, *_blind(turn, known)])
    except Unavailable:
        raise reply from None


async def _prefill(turn: Turn, inst: Instance, known: Directory, transfer_id: str) -> None:
    """P's leg; raises EngineReply (its 4xx) or UpstreamFailure. Learns P's coordinates from
    its answer, so a P restarted with a new engine id is addressed right on the next turn."""
    headers = turn.leg_headers(inst)
    told = known.of(inst.url).coords
    rank = ranks.rank_of(told.engine_id) if told is not None else -1
    if rank >= 0:  # D was told this rank's engine id and port: P's leg must run there
        headers[ranks.HEADER] = str(rank)
        turn.ranks["prefill"] = rank
    request = prefill_request(turn, coords.p_params(transfer_id))
    answer = await call_prefill(turn, inst, request, headers)
    parsed = answer.raise_unless_ok(inst.url)
    coords.learn(
        known.of(inst.url), parsed.get("kv_transfer_params"), "response", f"prefill {inst.url}"
    )


async def _dispatch(
    turn: Turn, p_inst: Instance, d_inst: Instance, known: Directory
) -> EngineStream:
    """Both legs at once, with a new transfer id."""
    told = known.of(p_inst.url).coords
    assert told is not None
    transfer_id = new_transfer_id()
    kv = coords.d_params(told, turn.request_id, transfer_id)
    return await both(_prefill(turn, p_inst, known, transfer_id), open_decode(turn, d_inst, kv))


async def serve(turn: Turn, known: Directory) -> Response:
    """The whole push-mode turn, from placement to the response."""
    svc = turn.svc
    state = turn.claim.state
    keep_affinity(turn)  # no D->P handle
    failed_p: list[str] = []
    failed_d: list[str] = []
    busy: list[str] = []  # P instances that answered 429 this turn
    p_inst = await _pick_prefill(turn, known, state.prefill if state else "", failed_p)
    d_inst = pick_decode(svc, state.decode if state else "", failed_d, p_inst)
    while True:
        turn.decode = d_inst
        try:
            resp = await _dispatch(turn, p_inst, d_inst, known)
        except BothFailed as exc:
            if isinstance(exc.p_exc, EngineReply) and exc.p_exc.status == 429:
                busy.append(p_inst.url)  # P is busy, not failing: another P, or relay its 429
                p_inst = _free_prefill(turn, known, [*failed_p, *busy], exc.p_exc)
                continue
            leg, why = exc.blame()
            inst = p_inst if leg == "prefill" else d_inst
            svc.pool.record_failure(inst, str(why))
            (failed_p if leg == "prefill" else failed_d).append(inst.url)
            log.warning("push %s on %s failed: %s; redoing the turn", leg, inst.url, why)
            if not attempts.redo_decode(len(failed_p) + len(failed_d)):
                raise UpstreamError(f"push turn failed twice; last ({leg}): {why}") from None
            if leg == "prefill":
                p_inst = await _pick_prefill(turn, known, "", failed_p)
            else:
                d_inst = pick_decode(svc, "", failed_d, p_inst)
            continue
        svc.pool.record_success(p_inst)
        turn.prefill = p_inst
        return await respond(turn, d_inst, resp)
