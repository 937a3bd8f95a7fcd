"""NixlConnector (pull mode) `kv_transfer_params`: the null handoff, hit params, truncation,
the handle check. Pure: connector.py puts them behind the connector seam."""

from __future__ import annotations

import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, TypeGuard

import msgspec

from sessions.model import PinSize

# What vLLM's toy_proxy_server.py sends P on a miss: "keep the blocks for a remote decoder".
NULL_HANDOFF: Mapping[str, Any] = MappingProxyType(
    {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
)
# What D gets on a turn it runs alone (the decode plan): nothing to read, but params all the
# same. vLLM's request_finished returns none for a request without params; with these, a D
# with bidirectional_kv_xfer keeps its blocks and returns its handle, as after a P/D turn, so
# that a later turn that cannot run on D alone can still pull them (§4.3 of the protocol notes).
ALONE: Mapping[str, Any] = MappingProxyType({"do_remote_prefill": False, "do_remote_decode": False})


def miss_params() -> dict[str, Any]:
    return dict(NULL_HANDOFF)


def _copy(params: Mapping[str, Any]) -> dict[str, Any]:
    # vLLM writes private markers (_remote_blocks_processed, _p_side_truncated) into the
    # same dict; they are engine state and must never be sent.
    out = {k: v for k, v in params.items() if not k.startswith("_")}
    groups = out.get("remote_block_ids")
    if isinstance(groups, list):
        out["remote_block_ids"] = [list(g) if isinstance(g, list) else g for g in groups]
    return out


def hit_params(handle: Mapping[str, Any]) -> dict[str, Any]:
    """D's cached handle as P's params: unchanged except the two direction flags.

    remote_num_tokens (vllm#32553), tp/dcp/pp sizes, remote_blocks_expiry_time (vllm#47021)
    and transfer_mode (vllm#50620) pass through: P needs them to read D's blocks.
    """
    out = _copy(handle)
    out["do_remote_decode"] = True
    out["do_remote_prefill"] = False
    return out


def release_body(handle: Mapping[str, Any], model: str) -> dict[str, Any] | None:
    """A one-token P request that carries D's handle and reads none of it: P's scheduler finds
    min(remote_num_tokens, prompt) - cached = 0 tokens to load, so it queues an empty read,
    whose only effect is the notification that frees D's pinned blocks (vLLM 0.32-0.33,
    `update_state_after_alloc` with no external tokens; any kv_recompute_threshold). P pins
    its own one block for kv_lease_duration (30 s). None: not a handle (nothing to free)."""
    if not is_handle(handle):
        return None
    kv = hit_params(handle)
    kv["remote_num_tokens"] = 0  # nothing to read: the free-only notification
    return {
        "model": model,
        "prompt": [0],  # token ids: a text prompt may gain a BOS token (and a second block)
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": kv,
    }


def release_prefilled_body(params: Mapping[str, Any], model: str) -> dict[str, Any] | None:
    """A one-token D request that carries P's params, for a prefill no D will read (D refused
    the turn): D reads one token's block and notifies P, which
    frees every block of that request at once instead of after kv_lease_duration (30 s).
    None: not P's params."""
    if not is_handle(params) or params.get("do_remote_prefill") is not True:
        return None
    return {
        "model": model,
        "prompt": [0],
        "max_tokens": 1,
        "stream": False,
        "kv_transfer_params": _copy(params),
    }


def truncate(params: Mapping[str, Any], num_tokens: int, block_size: int) -> dict[str, Any]:
    """The handle reduced to its first `num_tokens` tokens (a block-aligned prefix).

    Measured on vLLM 0.32: remote_num_tokens=N and every group cut to ceil(N / block_size)
    blocks makes P pull exactly that prefix. Groups are cut as full-attention lists; a
    sliding-window group (clipped by vLLM) must not be truncated this way.
    """
    held = params.get("remote_num_tokens")
    if not _is_int(held):
        raise ValueError("the handle has no integer remote_num_tokens")
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    if num_tokens == held:
        return _copy(params)
    if not 0 < num_tokens < held or num_tokens % block_size:
        raise ValueError(
            f"num_tokens={num_tokens} must be a positive multiple of block_size={block_size} "
            f"below remote_num_tokens={held}, or equal to it"
        )
    keep = -(-num_tokens // block_size)
    out = _copy(params)
    groups = out.get("remote_block_ids")
    if isinstance(groups, list):
        out["remote_block_ids"] = [g[:keep] if isinstance(g, list) else g for g in groups]
    out["remote_num_tokens"] = num_tokens
    return out


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _block_ids_ok(groups: object) -> bool:
    # One list per KV-cache group; at least one block somewhere.
    if not isinstance(groups, list) or not groups:
        return False
    ids = _block_ids(groups)
    return ids is not None and any(ids)


# vLLM appends `_dp<rank>` to each data-parallel engine's id (vllm-pd-protocol.md, engine_id).
_DP_RANK = re.compile(r"_dp(\d+)$")
_JSON = msgspec.json.Encoder().encode


def pinned(handle: Mapping[str, Any]) -> PinSize:
    """What D pins for a handle it returned: every block of every group, its remote_num_tokens
    (0 for what a handle does not say), and those blocks by name, `<DP rank>:<block id>`.

    vLLM allocates every KV-cache group's blocks from its engine's one BlockPool, so an id names
    one block of D whichever group lists it, and the group is not in the name (a block that a
    stale entry lists under one group and a live handle under another is one block); each
    data-parallel rank is an engine with a pool of its own, so its rank is (0 without data
    parallelism)."""
    groups = handle.get("remote_block_ids")
    blocks = 0
    if isinstance(groups, list):
        blocks = sum(len(g) for g in groups if isinstance(g, list))
    tokens = handle.get("remote_num_tokens")
    ids = _block_ids(groups)
    held = ""
    if ids:
        engine = handle.get("remote_engine_id")
        rank = _DP_RANK.search(engine) if isinstance(engine, str) else None
        p = f"{rank.group(1) if rank else 0}:"
        # "[12,13,40]" written in C, then "0:12 0:13 0:40": 30 us for 1,024 blocks (130 one by one)
        held = " ".join(p + _JSON(g)[1:-1].decode().replace(",", " " + p) for g in ids if g)
    return PinSize(blocks, tokens if _is_int(tokens) and tokens > 0 else 0, held)


def _block_ids(groups: object) -> list[list[int]] | None:
    try:
        return msgspec.convert(groups, list[list[int]])  # in C: a long handle has many ids
    except msgspec.ValidationError:
        return None


def is_handle(params: object) -> bool:
    """A usable P- or D-produced dict (not the null handoff, not `null`, not garbage)."""
    if not isinstance(params, Mapping) or not _block_ids_ok(params.get("remote_block_ids")):
        return False
    for key in ("remote_engine_id", "remote_request_id", "remote_host"):
        value = params.get(key)
        if not isinstance(value, str) or not value:
            return False
    port = params.get("remote_port")
    if not _is_int(port) or not 0 < port < 65536:
        return False
    tokens = params.get("remote_num_tokens")
    if tokens is None:
        # Engines before vllm#32553 do not send it; D-produced handles always do.
        return params.get("do_remote_decode") is not True
    return _is_int(tokens) and tokens >= 0
