"""MoRI-IO (vLLM's MoRIIOConnector, `moriio_toy_proxy_server.py`) behind the connector seam.

The peers find each other through the request id, not through `kv_transfer_params`: it embeds
both instances' announced ZMQ addresses (`___prefill_addr_<P>___decode_addr_<D>_<uid>`) and
goes in X-Request-Id to both legs. P gets `remote_dp_size`/`remote_tp_size` (D's) and a
transfer id; D gets P's sizes, the rank P's leg was pinned to (`remote_dp_rank`) and, in READ
mode, P's engine id and block ids from P's answer. Legs: legs.py.

MoRI-IO has no D->P handle, so a conversation gets affinity (same P, same D, same ranks)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

TRANSFER_PREFIX = "tx"  # MoRIIOConstants.TRANSFER_PREFIX
# What an instance announces as its zmq_address: "host:IP,handshake:PORT,notify:PORT".
_ZMQ_ADDRESS = re.compile(r"^host:[^,]+,handshake:\d+,notify:\d+$")


def valid_zmq_address(address: object) -> bool:
    return isinstance(address, str) and _ZMQ_ADDRESS.match(address) is not None


def request_id(prefill_zmq: str, decode_zmq: str) -> str:
    """The toy proxy's request id: both peers' addresses and a 32-hex uid."""
    return f"___prefill_addr_{prefill_zmq}___decode_addr_{decode_zmq}_{uuid.uuid4().hex}"


def new_transfer_id() -> str:
    return f"{TRANSFER_PREFIX}-{uuid.uuid4()}"


def p_params(transfer_id: str, d_dp_size: int, d_tp_size: int) -> dict[str, Any]:
    return {
        "remote_dp_size": d_dp_size,
        "remote_tp_size": d_tp_size,
        "transfer_id": transfer_id,
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
    }


def d_params(
    transfer_id: str, p_dp_size: int, p_tp_size: int, p_rank: int, prefilled: Mapping[str, Any]
) -> dict[str, Any]:
    """D's params; `prefilled` is P's answer's params in READ mode, {} in WRITE mode."""
    out: dict[str, Any] = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": prefilled.get("remote_engine_id"),
        "remote_block_ids": prefilled.get("remote_block_ids"),
        "transfer_id": prefilled.get("transfer_id", transfer_id),
        "remote_dp_size": p_dp_size,
        "remote_tp_size": p_tp_size,
    }
    if p_rank >= 0:
        out["remote_dp_rank"] = p_rank
    return out


def read_handoff(params: object, transfer_id: str) -> str:
    """Why P's READ-mode answer cannot be handed to D ("" if it can)."""
    if not isinstance(params, Mapping):
        return "P's answer has no kv_transfer_params"
    if not isinstance(params.get("remote_engine_id"), str):
        return "P's kv_transfer_params have no remote_engine_id"
    groups = params.get("remote_block_ids")
    if not isinstance(groups, list) or not groups:
        return "P's kv_transfer_params have no remote_block_ids"
    if params.get("transfer_id") != transfer_id:
        return f"P answered transfer id {params.get('transfer_id')!r}, not {transfer_id!r}"
    return ""
