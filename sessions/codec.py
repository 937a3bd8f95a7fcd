"""A session state's Redis HASH encoding: one human-readable field per attribute (readable
with `redis-cli HGETALL`), decoded strictly: garbage is a StateDecodeError (pure)."""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import msgspec

from sessions.model import SessionState

_JSON = msgspec.json.Encoder()


class StateDecodeError(ValueError):
    """A stored hash that is not a session state; stores turn it into StoreError."""


# The Redis HASH encoding: one field per attribute, in this order (HGETALL keeps it).
_INT_FIELDS = ("turn", "prefix_len", "prompt_len", "token_count", "block_size", "prefill_tokens")
_RANK_FIELDS = ("prefill_rank", "decode_rank")
_FLOAT_FIELDS = ("decode_started", "handle_expires_at", "created_at", "updated_at")
_STR_FIELDS = (
    "api",
    "prefill",
    "decode",
    "decode_engine_id",
    "no_handle_reason",
    "prefix_digest",
    "prompt_digest",
    "seq_digest",
    "inflight",
    "mac",
)


def handle_id(params: Mapping[str, Any]) -> str:
    """The digest that names a handle: SHA-1 of its stored text (`kv_transfer_params` as
    to_fields writes it), as the Redis scripts compute it with `redis.sha1hex`."""
    return hashlib.sha1(_JSON.encode(params), usedforsecurity=False).hexdigest()


def _iso(ts: float) -> str:
    try:
        return datetime.fromtimestamp(ts, UTC).isoformat(timespec="milliseconds")
    except (OverflowError, ValueError, OSError):
        return ""


def to_fields(state: SessionState) -> dict[str, str]:
    """The HASH fields of a state, all human-readable strings."""
    params = state.kv_transfer_params
    return {
        "turn": str(state.turn),
        "api": state.api,
        "prefill": state.prefill,
        "decode": state.decode,
        "decode_engine_id": state.decode_engine_id,
        "decode_started": repr(state.decode_started),
        "kv_transfer_params": "" if params is None else _JSON.encode(params).decode(),
        "no_handle_reason": state.no_handle_reason,
        "prefix_digest": state.prefix_digest,
        "prefix_len": str(state.prefix_len),
        "prompt_digest": state.prompt_digest,
        "prompt_len": str(state.prompt_len),
        "token_count": str(state.token_count),
        "block_size": str(state.block_size),
        "block_digests": " ".join(state.block_digests),
        "seq_digest": state.seq_digest,
        "handle_expires_at": repr(state.handle_expires_at),
        "created_at": repr(state.created_at),
        "updated_at": repr(state.updated_at),
        "created": _iso(state.created_at),
        "updated": _iso(state.updated_at),
        "inflight": state.inflight,
        "mac": state.mac,
        "prefill_rank": "" if state.prefill_rank < 0 else str(state.prefill_rank),
        "decode_rank": "" if state.decode_rank < 0 else str(state.decode_rank),
        "prefill_tokens": str(state.prefill_tokens),
    }


def _parse_int(name: str, raw: str) -> int:
    if not raw.isascii() or not raw.isdigit():
        raise StateDecodeError(f"field {name!r} is not a non-negative integer: {raw[:40]!r}")
    return int(raw)


def _parse_float(name: str, raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise StateDecodeError(f"field {name!r} is not a finite number: {raw[:40]!r}")
    return value


def _parse_params(raw: str) -> dict[str, Any] | None:
    if raw in ("", "null"):
        return None
    try:
        value = msgspec.json.decode(raw)
    except msgspec.DecodeError as exc:
        raise StateDecodeError(f"field 'kv_transfer_params' is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise StateDecodeError("field 'kv_transfer_params' is not a JSON object")
    return value


# Mapping is invariant in its key type: spell out what redis-py and to_fields produce.
Fields = Mapping[bytes, bytes] | Mapping[str, str] | Mapping[bytes | str, bytes | str]


def from_fields(fields: Fields) -> SessionState:
    """Decode HASH fields; raises StateDecodeError on anything that is not a state."""
    try:
        # Inline, not a helper per value (two calls per field were a third of the decode);
        # UnicodeDecodeError is a ValueError.
        raw = {
            (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
            for k, v in fields.items()
        }
    except ValueError as exc:
        raise StateDecodeError(f"hash is not UTF-8: {exc}") from None
    if "turn" not in raw:
        raise StateDecodeError("hash has no 'turn' field")
    values: dict[str, Any] = {name: raw[name] for name in _STR_FIELDS if name in raw}
    for name in _INT_FIELDS:
        if name in raw:
            values[name] = _parse_int(name, raw[name])
    for name in _FLOAT_FIELDS:
        if name in raw:
            values[name] = _parse_float(name, raw[name])
    values["kv_transfer_params"] = _parse_params(raw.get("kv_transfer_params", ""))
    values["block_digests"] = tuple(raw.get("block_digests", "").split())
    for name in _RANK_FIELDS:  # "" or absent (older sessions): no rank
        if raw.get(name):
            values[name] = _parse_int(name, raw[name])
    return SessionState(**values)
