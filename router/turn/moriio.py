"""A turn over MoRI-IO (`--kv-connector moriio`, vLLM's moriio_toy_proxy_server.py).

Both legs carry one request id that names both peers' announced ZMQ addresses
(router/connectors/moriio.py). P's data-parallel rank is chosen per conversation (ranks.py)
and pinned with X-data-parallel-rank; D is told it as `remote_dp_rank`. READ mode: P first,
then D with P's engine id, block ids and transfer id (D reads P's blocks). WRITE mode: both
legs at once (router/turn/push.py's concurrent dispatch; P writes into D's blocks). The mode
is the one the instances announced (engines/announce.py). Nothing is committed for a failed
turn: a failed leg ends the turn in one clear error (no redo: a MoRI-IO engine that lost a
transfer frees its blocks on its own timeout)."""

from __future__ import annotations

import logging
from typing import Any

from starlette.responses import Response

from router.connectors import moriio
from router.engines.announce import Peer
from router.engines.client import EngineStream
from router.engines.pool import Instance, Role
from router.errors import EngineReply, Unavailable, UpstreamError, UpstreamFailure
from router.turn import push
from router.turn.prefill import parse_answer
from router.turn.push import OpenDecode, Respond
from router.turn.rewrite import PATHS, prefill_body
from router.turn.state import Turn

log = logging.getLogger("kvbaton.legs")


def _peer(turn: Turn, inst: Instance) -> Peer:
    peers = turn.svc.peers
    peer = peers.of(inst.url) if peers is not None else None
    if peer is None:
        raise Unavailable(f"{inst.url} has not announced itself over --moriio-register")
    return peer


def _pick(turn: Turn, role: Role, prefer: str) -> tuple[Instance, Peer]:
    """A usable instance of `role` that announced itself (only those have ZMQ addresses)."""
    peers = turn.svc.peers
    pool = turn.svc.pool
    silent = [i.url for i in pool.instances(role) if peers is None or not peers.of(i.url)]
    inst = pool.pick(role, prefer=prefer, exclude=silent)
    peer = _peer(turn, inst)
    inst.dp_size = peer.dp_size  # the announced size decides its ranks (engines/ranks.py)
    return inst, peer


async def _prefill(
    turn: Turn, inst: Instance, headers: dict[str, str], params: dict[str, Any]
) -> dict[str, Any]:
    """P's leg; its kv_transfer_params (raises EngineReply for its 4xx, UpstreamFailure)."""
    svc, inc = turn.svc, turn.inc
    body = prefill_body(inc.body, params, api=inc.api)
    if inc.api == "responses":
        body["store"] = False
    with svc.pool.busy(inst):
        status, raw = await svc.engines.post_json(
            inst.url + PATHS[inc.api],
            body,
            request_id=turn.leg_id,
            extra_headers=headers,
            timeout=svc.settings.prefill_timeout,
        )
    if 400 <= status < 500:
        raise EngineReply(status, raw)
    parsed = parse_answer(raw)
    if status != 200 or parsed is None or svc.connector.prefill_failed(status, parsed):
        raise UpstreamFailure(f"{inst.url} answered {status}: {raw[:200]!r}")
    kv = parsed.get("kv_transfer_params")
    return kv if isinstance(kv, dict) else {}


async def serve(turn: Turn, open_decode: OpenDecode, respond: Respond) -> Response:
    svc = turn.svc
    push.verdict(turn)  # no D->P handle: a continued conversation gets affinity
    state = turn.claim.state
    p_inst, p_peer = _pick(turn, "prefill", state.prefill if state else "")
    d_inst, d_peer = _pick(turn, "decode", state.decode if state else "")
    mode = svc.peers.mode if svc.peers is not None else ""
    turn.leg_id = moriio.request_id(p_peer.zmq_address, d_peer.zmq_address)
    log.info("turn %s: MoRI-IO legs as %s", turn.request_id, turn.leg_id)
    p_headers = turn.leg_headers(p_inst)  # chooses P's rank (the conversation's, else next)
    rank = turn.ranks.get("prefill", -1)
    transfer_id = moriio.new_transfer_id()
    p_kv = moriio.p_params(transfer_id, d_peer.dp_size, d_peer.tp_size)
    turn.decode = d_inst
    try:
        if mode == "WRITE":
            stream = await _write(turn, p_inst, d_inst, p_headers, p_kv, rank, p_peer, open_decode)
        else:
            answered = await _prefill(turn, p_inst, p_headers, p_kv)
            why = moriio.read_handoff(answered, transfer_id)
            if why:
                raise UpstreamFailure(f"{p_inst.url}: {why}")
            kv = moriio.d_params(transfer_id, p_peer.dp_size, p_peer.tp_size, rank, answered)
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
    rank: int,
    p_peer: Peer,
    open_decode: OpenDecode,
) -> EngineStream:
    """WRITE mode: P and D at once, through push.py's concurrent dispatch."""
    kv = moriio.d_params(p_kv["transfer_id"], p_peer.dp_size, p_peer.tp_size, rank, {})

    async def prefill() -> None:
        await _prefill(turn, p_inst, p_headers, p_kv)

    async def decode() -> EngineStream:
        return await open_decode(turn, d_inst, kv)

    try:
        return await push.both(prefill(), decode())
    except push.PushFailed as exc:
        for leg in (exc.p_exc, exc.d_exc):
            if isinstance(leg, EngineReply | UpstreamFailure):
                raise leg from None
        raise
