"""What each engine's prefix cache holds, from its KV events (pure: no I/O).

Blocks are indexed by a chained digest of their token ids that the router computes itself
(the events carry the tokens), so no copy of vLLM's block hash function is needed.
"""

from __future__ import annotations

import collections
import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sessions.digests import pack_token_ids

ROOT = 0  # the parent digest of a sequence's first block


def block_digests(tokens: Sequence[int], block_size: int, limit: int | None = None) -> list[int]:
    """The chained digest of every full block of `tokens` (at most `limit` blocks)."""
    if block_size <= 0:
        return []
    count = len(tokens) // block_size
    if limit is not None:
        count = min(count, limit)
    out: list[int] = []
    parent = ROOT
    for i in range(count):
        parent = _chain(parent, tokens[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def _chain(parent: int, tokens: Sequence[int]) -> int:
    raw = hashlib.blake2b(
        parent.to_bytes(8, "big") + pack_token_ids(tokens), digest_size=8
    ).digest()
    return int.from_bytes(raw, "big")


def _plain(event: Mapping[str, Any]) -> bool:
    """Blocks of the text-only, base-model, full-attention GPU cache (group 0) only: a LoRA
    adapter or multimodal extra keys make the same token ids other KV."""
    if event.get("group_idx") not in (None, 0) or event.get("medium") not in (None, "GPU"):
        return False
    if event.get("lora_name") is not None or event.get("lora_id") is not None:
        return False
    extra = event.get("extra_keys")
    return not extra or all(e is None for e in extra)


@dataclass
class EngineIndex:
    """One engine's prefix cache as its events tell it. Bounded by `max_blocks` (the oldest
    entries go first: the index then under-states what the engine holds, which only costs a
    read or a placement, never a wrong answer)."""

    max_blocks: int = 1_000_000
    max_tombstones: int = 100_000
    block_size: int = 0
    stale: bool = True  # not (yet) in sync with the engine: claims nothing
    cleared_at: float = 0.0  # router clock of the last AllBlocksCleared or rebuild
    unchained: int = 0  # stored blocks whose parent was unknown (missed events)
    _by_hash: dict[int, int] = field(default_factory=dict)  # engine hash -> our digest
    _held: dict[int, int] = field(default_factory=dict)  # our digest -> engine hashes of it
    # digest -> router time it was evicted, for "a handle's block was evicted" checks
    _removed: collections.OrderedDict[int, float] = field(default_factory=collections.OrderedDict)

    @property
    def blocks(self) -> int:
        return len(self._by_hash)

    def clear(self, now: float) -> None:
        """Forget everything (AllBlocksCleared, an engine restart, a gap replay cannot fill)."""
        self._by_hash.clear()
        self._held.clear()
        self._removed.clear()
        self.cleared_at = now

    def apply(self, events: Sequence[Mapping[str, Any]], now: float) -> None:
        for event in events:
            kind = event.get("type")
            if kind == "BlockStored":
                self._stored(event)
            elif kind == "BlockRemoved":
                self._removed_blocks(event.get("block_hashes") or (), now)
            elif kind == "AllBlocksCleared":
                self.clear(now)
            # unknown event types (newer vLLM) are ignored

    def _stored(self, event: Mapping[str, Any]) -> None:
        if not _plain(event):
            return
        hashes = event.get("block_hashes") or []
        tokens = event.get("token_ids") or []
        size = int(event.get("block_size") or 0)
        if size <= 0 or len(tokens) < size * len(hashes):
            return
        self.block_size = size
        parent_hash = event.get("parent_block_hash")
        parent = ROOT if parent_hash is None else self._by_hash.get(parent_hash)
        if parent is None:
            self.unchained += len(hashes)
            return
        for i, engine_hash in enumerate(hashes):
            parent = _chain(parent, tokens[i * size : (i + 1) * size])
            if engine_hash not in self._by_hash:
                self._by_hash[engine_hash] = parent
                self._held[parent] = self._held.get(parent, 0) + 1
        while len(self._by_hash) > self.max_blocks:
            self._forget(next(iter(self._by_hash)))

    def _forget(self, engine_hash: int) -> int | None:
        digest = self._by_hash.pop(engine_hash, None)
        if digest is None:
            return None
        left = self._held.get(digest, 1) - 1
        if left > 0:
            self._held[digest] = left
        else:
            self._held.pop(digest, None)
        return digest

    def _removed_blocks(self, hashes: Sequence[int], now: float) -> None:
        for engine_hash in hashes:
            digest = self._forget(engine_hash)
            if digest is not None:
                self._removed[digest] = now
                self._removed.move_to_end(digest)
        while len(self._removed) > self.max_tombstones:
            self._removed.popitem(last=False)

    def held_blocks(self, digests: Sequence[int]) -> int:
        """How many leading blocks of a sequence the engine holds (0 while stale)."""
        if self.stale:
            return 0
        n = 0
        for digest in digests:
            if digest not in self._held:
                break
            n += 1
        return n

    def evicted_since(self, digests: Sequence[int], made_at: float) -> bool:
        """Whether the engine cleared or evicted any of these blocks after `made_at` (router
        clock): a handle made then names blocks that are gone. False when not known."""
        if self.stale:
            return False
        if self.cleared_at > made_at:
            return True
        return any(self._removed.get(d, 0.0) > made_at for d in digests)


def held_tokens(index: EngineIndex, tokens: Sequence[int]) -> int:
    """Tokens of the longest prefix of `tokens` whose full blocks the engine holds."""
    size = index.block_size
    if index.stale or size <= 0:
        return 0
    return index.held_blocks(block_digests(tokens, size)) * size
