"""Push mode's kv_transfer_params (pure): which params make a push leg (P's or D's), and the
params P returns after its write."""

from __future__ import annotations

from typing import Any

from vllm_sim.transfer import Leg, PushPeer


def classify(params: dict[str, Any] | None) -> Leg | None:
    """A push leg (None: not one; the pull rules apply)."""
    if not params or not isinstance(params.get("transfer_id"), str):
        return None
    transfer_id = params["transfer_id"]
    if params.get("do_remote_prefill"):
        peer = _peer(params, transfer_id)
        if peer is None:
            return Leg("push_broken", False)
        return Leg("push_consumer", False, push=peer)
    if params.get("do_remote_decode"):
        return Leg("push_producer", True, push=PushPeer("", "", 0, 1, 1, "", transfer_id))
    return None


def _peer(params: dict[str, Any], transfer_id: str) -> PushPeer | None:
    engine_id, host, port = (
        params.get(k) for k in ("remote_engine_id", "remote_host", "remote_port")
    )
    request_id = params.get("remote_request_id")
    if not (isinstance(engine_id, str) and isinstance(host, str) and isinstance(request_id, str)):
        return None
    if not isinstance(port, int) or isinstance(port, bool):
        return None
    tp, pp = params.get("tp_size", 1), params.get("pp_size", 1)
    if not isinstance(tp, int) or not isinstance(pp, int):
        return None
    return PushPeer(engine_id, host, port, tp, pp, request_id, transfer_id)


def producer_params(engine_id: str, host: str, port: int, num_tokens: int) -> dict[str, Any]:
    """P's returned params in push mode: its coordinates (what a router learns them from),
    `transfer_mode: "push"` (vllm#50620) and no blocks (they were written to D)."""
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": [],
        "remote_engine_id": engine_id,
        "remote_host": host,
        "remote_port": port,
        "tp_size": 1,
        "pp_size": 1,
        "remote_num_tokens": num_tokens,
        "transfer_mode": "push",
    }
