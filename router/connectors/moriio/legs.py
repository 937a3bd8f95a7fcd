"""A turn over MoRI-IO (`--kv-connector moriio`, vLLM's moriio_toy_proxy_server.py).

Both legs carry one request id that names both peers' announced ZMQ addresses
(params.py). P's data-parallel rank is chosen per conversation (ranks.py)
and pinned with X-data-parallel-rank; D is told it as `remote_dp_rank`. READ mode: P first,
then D with P's engine id, block ids and transfer id (D reads P's blocks). WRITE mode: both
legs at once (connectors/legs/calls.py's concurrent dispatch; P writes into D's blocks). The
mode is the one the instances announced (announce.py). Nothing is committed for a failed
turn: a failed leg ends the turn in one clear error (no redo: a MoRI-IO engine that lost a
transfer frees its blocks on its own timeout)."""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import Response

from router.connectors.legs.calls import (
    BothFailed,
    both,
    call_prefill,
    keep_affinity,
    prefill_request,
)
from router.connectors.legs.decode import open_decode, respond
from router.connectors.moriio import params
from router.connectors.moriio.announce import Peer, Peers
from router.engines.client import EngineStream
from router.engines.pool import Instance, Role
from router.errors import EngineReply, Unavailable, UpstreamError, UpstreamFailure
from router.turn.state import Turn

log = logging.getLogger("kvbaton.legs")


def _pick(turn: Turn, peers: Peers, role: Role, prefer: str) -> tuple[Instance, Peer]:
    """A usable instance of `role` that announced itself (only those have ZMQ addresses)."""
    pool = turn.svc.pool
    silent = [i.url for i in pool.instances(role) if not peers.of(i.url)]
    inst = pool.pick(role, prefer=prefer, exclude=silent)
    peer = peers.of(inst.url)
    if peer is None:
        raise Unavailable(f"{inst.url} has not announced itself over --moriio-register")
    inst.dp_size = peer.dp_size  # the announced size decides its ranks (engines/ranks.py)
    return inst, peer


async def _prefill(
    turn: Turn, inst: Instance, headers: dict[str, str], kv: dict[str, Any]
) -> dict[str, Any]:
    """P's leg; its kv_transfer_params (raises EngineReply for its 4xx, UpstreamFailure)."""
    answer = await call_prefill(turn, inst, prefill_request(turn, kv), headers)
    got = answer.raise_unless_ok(inst.url).get("kv_transfer_params")
    return got if isinstance(got, dict) else {}


async def serve(turn: Turn, peers: Peers) -> Response:
    svc = turn.svc
    state = turn.claim.state
    keep_affinity(turn)  # no D->P handle
    p_inst, p_peer = _pick(turn, peers, "prefill", state.prefill if state else "")
    d_inst, d_peer = _pick(turn, peers, "decode", state.decode if state else "")
    turn.leg_id = params.request_id(p_peer.zmq_address, d_peer.zmq_address)
    log.info("turn %s: MoRI-IO legs as %s", turn.request_id, turn.leg_id)
    p_headers = turn.leg_headers(p_inst)  # chooses P's rank (the conversation's, else next)
    rank = turn.ranks.get("prefill", -1)
    transfer_id = params.new_transfer_id()
    p_kv = params.p_params(transfer_id, d_peer.dp_size, d_peer.tp_size)
    turn.decode = d_inst
    try:
        if peers.mode == "WRITE":
            kv = params.d_params(transfer_id, p_peer.dp_size, p_peer.tp_size, rank, {})
            stream = await _write(turn, p_inst, d_inst, p_headers, p_kv, kv)
        else:
            answered = await _prefill(turn, p_inst, p_headers, p_kv)
            why = params.read_handoff(answered, transfer_id)
            if why:
                raise UpstreamFailure(f"{p_inst.url}: {why}")
            kv = params.d_params(transfer_id, p_peer.dp_size, p_peer.tp_size, rank, answered)
            stream = await open_decode(turn, d_inst, kv)
    except UpstreamFailure as exc:
        raise UpstreamError(f"MoRI-IO turn failed: {exc}") from None
    svc.pool.record_success(p_inst)
    turn.prefill = p_inst
    return await respond(turn, d_inst, stream)


async def _write(
    turn: Turn,
    p_inst: Instance,
    d_inst: Instance,
    p_headers: dict[str, str],
    p_kv: dict[str, Any],
    d_kv: dict[str, Any],
) -> EngineStream:
    """WRITE mode: P and D at once (P writes into the blocks D registered)."""

    async def prefill() -> None:
        await _prefill(turn, p_inst, p_headers, p_kv)

    try:
        return await both(prefill(), open_decode(turn, d_inst, d_kv))
    except BothFailed as exc:
        for leg in (exc.p_exc, exc.d_exc):
            if isinstance(leg, EngineReply | UpstreamFailure):
                raise leg from None
        raise
