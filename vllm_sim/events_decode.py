"""Decoding a KV-event batch as a subscriber reads it: map-shaped events (vllm#42892) or
positional ones (older vLLM), a batch as an array or a map."""

from __future__ import annotations

from typing import Any

import msgspec

# Positional field order of the pre-#42892 array_like events, after the tag. The router's
# subscriber has the same table (router/engines/kv_events.py): written twice because the
# simulator shares no code with the router, so a change to one must be made in the other.
_POSITIONAL_FIELDS: dict[str, tuple[str, ...]] = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


def _decode_event(raw: Any) -> dict[str, Any]:
    if isinstance(raw, dict):
        event = raw  # freshly decoded, ours to fill in
    elif isinstance(raw, list) and raw and isinstance(raw[0], str):
        names = _POSITIONAL_FIELDS.get(raw[0], ())
        event = {"type": raw[0], **dict(zip(names, raw[1:], strict=False))}
    else:
        raise ValueError(f"not a KV event: {raw!r:.80}")
    if not isinstance(event.get("type"), str):
        raise ValueError(f"KV event without a type tag: {raw!r:.80}")
    # Fields dropped by omit_defaults (trailing positions or absent keys) default to None.
    for name in _POSITIONAL_FIELDS.get(event["type"], ()):
        event.setdefault(name, None)
    return event


def decode_batch(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """Decode one batch payload into (ts, events as dicts with "type", data_parallel_rank).

    Accepts map-shaped events (vLLM >= #42892) and positional ones (tag first, older vLLM),
    and a batch given as an array (measured) or as a map; unknown event types pass through.
    """
    try:
        raw = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError as exc:
        raise ValueError(f"KV event batch is not msgpack: {exc}") from exc
    if isinstance(raw, dict):
        raw = [raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")]
    if not isinstance(raw, list) or len(raw) < 2 or not isinstance(raw[1], list):
        raise ValueError(f"not a KV event batch: {raw!r:.80}")
    ts, events = raw[0], raw[1]
    if not isinstance(ts, int | float):
        raise ValueError(f"KV event batch without a timestamp: {raw!r:.80}")
    dp_rank = raw[2] if len(raw) > 2 and isinstance(raw[2], int) else None
    return float(ts), [_decode_event(e) for e in events], dp_rank
