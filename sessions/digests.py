"""Digest chains over conversations and token sequences (pure): what D holds, in a few hex chars.

A digest answers "is this exactly what D computed KV for?" without storing the prompt itself.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import msgspec

# What a chat template renders from a message. Everything else (refusal, audio, annotations,
# ids the SDK echoes back) is dropped, so an echoed assistant message matches the recorded one.
_RENDERED_FIELDS = (
    "role",
    "content",
    "name",
    "tool_calls",
    "tool_call_id",
    "function_call",
    "reasoning_content",
    "reasoning",
    "thinking",
)
_PLAIN = frozenset(("role", "content"))
_ENCODER = msgspec.json.Encoder(order="sorted")
_CONV_SIZE = 16  # bytes: 32 hex chars
_BLOCK_SIZE = 8  # bytes: 16 hex chars
_TOKEN_BYTES = 8


def _prune(value: Any) -> Any:
    """A copy of a JSON value with every None-valued mapping entry removed, at any depth."""
    if type(value) is str:  # most values: no ABC check (isinstance of Mapping) for them
        return value
    if isinstance(value, Mapping):
        return {k: _prune(v) for k, v in value.items() if v is not None}
    if isinstance(value, list | tuple):
        return [_prune(v) for v in value]
    return value


def canonical_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """The parts of a chat message that a template renders, with None and empty values dropped.

    `content` is kept apart: "" stays (vLLM renders `[{"type": "text", "text": ""}]` for it in
    the openai content format, but nothing for a missing one), and a string is never made equal
    to a list of text parts, since the two take different paths through the renderer.
    """
    role, content = message.get("role"), message.get("content")
    if type(content) is str and type(role) is str and role and message.keys() <= _PLAIN:
        return {"role": role, "content": content}  # most messages: what the loop makes of them
    out: dict[str, Any] = {}
    for name in _RENDERED_FIELDS:
        value = message.get(name)
        if value is None:
            continue
        if name == "content":
            if value == []:  # vLLM parses None and [] content alike
                continue
        elif value in ("", [], {}):
            continue
        out[name] = _prune(value)
    return out


def _canonical_item(api: str, item: Any) -> Any:
    if api == "chat" and isinstance(item, Mapping):
        return canonical_message(item)
    return _prune(item)


# Each item's digest starts from a copy of this one (cheaper than building one per item).
_CONV_START = hashlib.blake2b(digest_size=_CONV_SIZE)


def _seed(api: str) -> bytes:
    return hashlib.blake2b(api.encode(), digest_size=_CONV_SIZE, person=b"kvbaton-conv").digest()


def _chain(api: str, head: bytes, item: Any) -> bytes:
    digest = _CONV_START.copy()
    digest.update(head)
    digest.update(_ENCODER.encode(_canonical_item(api, item)))
    return digest.digest()


def conversation_digest(api: str, items: Sequence[Any]) -> str:
    """Chained digest over canonical items (chat messages, responses input items), seeded by api."""
    head = _seed(api)
    for item in items:
        head = _chain(api, head, item)
    return head.hex()


def conversation_heads(api: str, items: Sequence[Any]) -> list[str]:
    """`conversation_digest(api, items[:k + 1])` for every k, in one pass over the chain."""
    head = _seed(api)
    heads = []
    for item in items:
        head = _chain(api, head, item)
        heads.append(head.hex())
    return heads


def head_at(api: str, heads: Sequence[str], n: int) -> str:
    """`conversation_digest(api, items[:n])` from the items' `conversation_heads`."""
    return heads[n - 1] if n > 0 else _seed(api).hex()


def next_head(api: str, heads: Sequence[str], item: Any) -> str:
    """`conversation_digest` of the items whose heads these are, and then `item`."""
    return _chain(api, bytes.fromhex(heads[-1]) if heads else _seed(api), item).hex()


def text_digest(api: str, text: str) -> str:
    """Digest of a completions prompt (or any text), seeded by api."""
    data = api.encode() + b"\0" + text.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(data, digest_size=_CONV_SIZE, person=b"kvbaton-text").hexdigest()


def text_heads(api: str, text: str, step: int, limit: int) -> list[tuple[int, str]]:
    """(n, `text_digest(api, text[:n])`) for n = step, 2 step, ... up to len(text), the
    longest `limit` of them, longest first; one pass over the text (blake2b is incremental)."""
    ends = range(step, len(text) + 1, step)[-limit:] if limit > 0 else range(0)
    if not ends:
        return []
    digest = hashlib.blake2b(api.encode() + b"\0", digest_size=_CONV_SIZE, person=b"kvbaton-text")
    done = 0
    heads = []
    for end in ends:
        digest.update(text[done:end].encode("utf-8", "surrogatepass"))
        done = end
        heads.append((end, digest.copy().hexdigest()))
    return heads[::-1]


def pack_token_ids(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian int64, so digests agree across router hosts. One
    struct.pack call: array("q") parses each id as a call's argument would be (1.7% of the
    router's instructions per hit turn); an id out of int64's range is an OverflowError."""
    try:
        return struct.pack(f"<{len(token_ids)}q", *token_ids)
    except struct.error as exc:
        raise OverflowError(f"token ids are not int64: {exc}") from exc


# Each block's digest starts from a copy of this one: built with its keyword arguments per
# block, blake2b cost a 300-token prompt's 18 blocks 19 us against 12.6 us (measured).
_BLOCK_START = hashlib.blake2b(digest_size=_BLOCK_SIZE, person=b"kvbaton-block")


def _chain_blocks(data: bytes, step: int, head: bytes) -> Iterator[str]:
    """The chained digest of each `step`-byte block of `data`, going on from `head`."""
    for start in range(0, len(data) - step + 1, step):
        digest = _BLOCK_START.copy()
        digest.update(head)
        digest.update(data[start : start + step])
        head = digest.digest()
        yield head.hex()


def iter_block_digests(token_ids: Sequence[int], block_size: int, limit: int) -> Iterator[str]:
    """Lazily, the chained digest of each of the first `limit` full blocks."""
    if block_size <= 0:
        return
    count = min(limit, len(token_ids) // block_size)
    data = pack_token_ids(token_ids[: count * block_size])
    yield from _chain_blocks(data, block_size * _TOKEN_BYTES, b"")


def block_digests(token_ids: Sequence[int], block_size: int) -> tuple[str, ...]:
    """Chained digest of each FULL block of token_ids; a partial last block has none."""
    return tuple(iter_block_digests(token_ids, block_size, len(token_ids)))


def extend_block_digests(
    known: Sequence[str], token_ids: Sequence[int], block_size: int
) -> tuple[str, ...]:
    """`block_digests(token_ids, block_size)`, given the first `len(known)` of them (the
    caller vouches that they are these tokens' digests): only the blocks after them are
    hashed, the chain going on from the last known one."""
    if block_size <= 0:
        return ()
    done = min(len(known), len(token_ids) // block_size)
    if done == 0:
        return block_digests(token_ids, block_size)
    head = bytes.fromhex(known[done - 1])  # ValueError: not a digest
    if len(head) != _BLOCK_SIZE:
        raise ValueError(f"not a block digest: {known[done - 1]!r}")
    count = len(token_ids) // block_size
    data = pack_token_ids(token_ids[done * block_size : count * block_size])
    return (*known[:done], *_chain_blocks(data, block_size * _TOKEN_BYTES, head))


_SEQ_START = hashlib.blake2b(digest_size=_CONV_SIZE, person=b"kvbaton-seq")


def sequence_digest(token_ids: Sequence[int]) -> str:
    """Digest of a whole token sequence (its length included)."""
    digest = _SEQ_START.copy()
    digest.update(pack_token_ids(token_ids))
    return digest.hexdigest()


def sequence_digests(token_ids: Sequence[int], at: int) -> tuple[str, str]:
    """(`sequence_digest(token_ids[:at])`, `sequence_digest(token_ids)`) in one pass."""
    digest = _SEQ_START.copy()
    digest.update(pack_token_ids(token_ids[:at]))
    head = digest.hexdigest()
    digest.update(pack_token_ids(token_ids[at:]))
    return head, digest.hexdigest()
