"""MoRI-IO (vLLM's MoRIIOConnector) in the simulator: registration, request-id addressing,
data-parallel ranks, READ and WRITE, mapped onto the simulator's pull and push rules.

The contract (vLLM's moriio_connector.py and moriio_toy_proxy_server.py, reference 3.5):

- The instance announces itself to the proxy (`--moriio-proxy HOST:PORT`) every
  `--moriio-ping-interval` seconds over a ZMQ DEALER: msgpack `{type: "P"|"D", http_address,
  zmq_address, dp_size, tp_size, transfer_mode}`, zmq_address `host:IP,handshake:PORT,
  notify:PORT` (here: the side channel's host and rank 0's port; rank r listens on PORT + r).
- The peers' addresses come from the request id only (`___prefill_addr_<P>___decode_addr_
  <D>_<32 hex>`): a D whose id names no P, or the wrong one, fails its KV load.
- READ: P prefills, pins its blocks under the transfer id and answers `remote_engine_id`
  (its rank's `<id>_dp<r>`), `remote_block_ids`, `transfer_id`; D reads them from the
  address in the id, at port + `remote_dp_rank`. A wrong rank reaches another rank's engine
  id: the read is refused (an error, never a silent success).
- WRITE: P and D at once; D registers its blocks with P (at the id's address + rank, the
  push rules of vllm_sim/push.py), P writes them after its prefill.
"""

from __future__ import annotations

import asyncio
import logging
import re
from typing import Any

import msgspec

from vllm_sim.errors import KVLoadError

logger = logging.getLogger(__name__)

MODES = ("READ", "WRITE")
# The engine id D registers under in WRITE mode: MoRI-IO's D is never told P's engine id.
ANY_ENGINE = "moriio:any-engine"
_PREFILL = re.compile(r"___prefill_addr_(.+?)___decode_addr_")
_DECODE = re.compile(r"___decode_addr_(.+)_[0-9a-f]{32}(?:-.*)?$")


def zmq_address(host: str, port: int) -> str:
    return f"host:{host},handshake:{port},notify:{port}"


def parse_address(address: str) -> tuple[str, int]:
    """`host:IP,handshake:PORT,notify:PORT` -> (host, handshake port); ValueError if not."""
    parts = dict(seg.partition(":")[::2] for seg in address.split(","))
    try:
        return parts["host"].strip(), int(parts["handshake"])
    except (KeyError, ValueError):
        raise ValueError(f"malformed MoRI-IO zmq_address {address!r}") from None


def peer(request_id: str, producer: bool) -> tuple[str, int]:
    """The other side's (host, handshake port), from the request id; KVLoadError if absent."""
    match = (_DECODE if producer else _PREFILL).search(request_id)
    try:
        if match is None:
            raise ValueError(f"request id {request_id!r} names no MoRI-IO peer address")
        return parse_address(match.group(1))
    except ValueError as exc:
        raise KVLoadError(str(exc)) from None


def _rank(params: dict[str, Any]) -> int:
    rank = params.get("remote_dp_rank", 0)
    return rank if isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0 else 0


def as_rules(params: dict[str, Any] | None, base_id: str, mode: str) -> dict[str, Any] | None:
    """MoRI-IO params as the simulator's pull (READ) or push (WRITE) rules read them."""
    if not params:
        return params
    transfer_id = params.get("transfer_id")
    if not isinstance(transfer_id, str):
        return {}  # vLLM's MoRI-IO scheduler needs a transfer id: no transfer
    if params.get("do_remote_decode"):  # P
        return {
            "do_remote_decode": True,
            **({"transfer_id": transfer_id} if mode == "WRITE" else {}),
        }
    if not params.get("do_remote_prefill"):
        return {}
    host, port = peer(base_id, producer=False)
    port += _rank(params)
    if mode == "WRITE":
        return {
            "do_remote_prefill": True,
            "transfer_id": transfer_id,
            "remote_engine_id": ANY_ENGINE,
            "remote_host": host,
            "remote_port": port,
            "remote_request_id": base_id,
            "tp_size": params.get("remote_tp_size", 1),
        }
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": params.get("remote_engine_id"),
        "remote_request_id": transfer_id,  # P pinned its blocks under the transfer id
        "remote_host": host,
        "remote_port": port,
        "remote_block_ids": params.get("remote_block_ids"),
    }


def pin_id(params: dict[str, Any] | None, request_id: str) -> str:
    transfer_id = (params or {}).get("transfer_id")
    return transfer_id if isinstance(transfer_id, str) else request_id


def finished(params: dict[str, Any] | None, transfer_id: object) -> dict[str, Any] | None:
    """request_finished's dict as MoRI-IO's P returns it (D returns none)."""
    if params is None or not params.get("do_remote_prefill"):
        return None
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_block_ids": params.get("remote_block_ids"),
        "remote_engine_id": params.get("remote_engine_id"),
        "tp_size": 1,
        "transfer_id": transfer_id,
    }


async def announce(
    proxy: str, role: str, http_address: str, address: str, dp_size: int, mode: str, every: float
) -> None:
    """Announce this instance to the proxy until cancelled (vLLM's MoRIIO _ping loop)."""
    import zmq
    import zmq.asyncio

    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{proxy}")
    msg = {
        "type": "P" if role == "prefill" else "D",
        "http_address": http_address,
        "zmq_address": address,
        "dp_size": dp_size,
        "tp_size": 1,
        "transfer_mode": mode,
    }
    try:
        while True:
            await sock.send(msgspec.msgpack.encode(msg))
            await asyncio.sleep(every)
    finally:
        sock.close()
