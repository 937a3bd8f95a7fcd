"""The block pool and prefix cache: fixed-size blocks, chained hashes, LRU eviction.

Block 0 is reserved (vLLM's null block). Freed blocks keep their content and hash until
they are reused, so a stale read returns whatever they hold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


class NoFreeBlocks(RuntimeError):
    """The pool cannot hand out the blocks asked for."""


@dataclass(slots=True)
class Block:
    block_id: int
    kv: list[int]
    ref_count: int = 0
    block_hash: int | None = None


@dataclass(frozen=True, slots=True)
class Stored:
    """Full blocks entered the prefix cache (one contiguous run of a sequence)."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class Removed:
    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class Cleared:
    pass


CacheEvent = Stored | Removed | Cleared


@dataclass
class BlockPool:
    num_blocks: int
    block_size: int
    blocks: list[Block] = field(init=False)
    _free: OrderedDict[int, None] = field(init=False)
    _cached: dict[int, int] = field(init=False)
    _events: list[CacheEvent] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError("num_blocks must be at least 2 (block 0 is reserved)")
        self.blocks = [Block(i, [0] * self.block_size) for i in range(self.num_blocks)]
        self.blocks[0].ref_count = 1  # the null block is never handed out
        self._free = OrderedDict((i, None) for i in range(1, self.num_blocks))
        self._cached = {}

    # -- queries ------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    @property
    def usage(self) -> float:
        """Fraction of usable blocks referenced by requests or pins."""
        usable = self.num_blocks - 1
        return (usable - len(self._free)) / usable

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids of the longest cached run of hashes, from the first."""
        out: list[int] = []
        for h in hashes:
            bid = self._cached.get(h)
            if bid is None:
                break
            out.append(bid)
        return out

    def free_needed(self, hit_ids: Sequence[int], new_blocks: int) -> int:
        """Free-queue blocks that touching hit_ids and allocating new_blocks would consume."""
        return new_blocks + sum(1 for b in hit_ids if b in self._free)

    # -- changes ------------------------------------------------------------------------

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference on each block (removing it from the free queue)."""
        for bid in block_ids:
            block = self.blocks[bid]
            if block.ref_count == 0:
                del self._free[bid]
            block.ref_count += 1

    def allocate(self, n: int) -> list[int]:
        """n blocks from the front of the free queue (least recently freed), evicting hashes."""
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free")
        out: list[int] = []
        evicted: list[int] = []
        for _ in range(n):
            bid, _ = self._free.popitem(last=False)
            block = self.blocks[bid]
            if block.block_hash is not None:
                evicted.append(block.block_hash)
                if self._cached.get(block.block_hash) == bid:
                    del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_count = 1
            out.append(bid)
        if evicted:
            self._events.append(Removed(evicted))
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference from each block. A request's tail blocks are evicted first."""
        for bid in reversed(block_ids):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    # Blocks that cache nothing are reused before cached ones.
                    self._free[bid] = None
                    self._free.move_to_end(bid, last=False)
                else:
                    self._free[bid] = None

    def cache_full_blocks(
        self,
        block_ids: Sequence[int],
        hashes: Sequence[int],
        parent: int | None,
        token_ids: Sequence[int],
    ) -> None:
        """Enter full blocks (hash i for block i) into the prefix cache, with one event per run.

        A hash that another block already caches keeps the older block (as vLLM does).
        """
        bs = self.block_size
        run_hashes: list[int] = []
        run_tokens: list[int] = []
        run_parent = parent
        prev = parent
        for i, (bid, h) in enumerate(zip(block_ids, hashes, strict=True)):
            block = self.blocks[bid]
            fresh = block.block_hash is None and h not in self._cached
            if fresh:
                block.block_hash = h
                self._cached[h] = bid
                if not run_hashes:
                    run_parent = prev
                run_hashes.append(h)
                run_tokens.extend(token_ids[i * bs : (i + 1) * bs])
            elif run_hashes:
                self._events.append(Stored(run_hashes, run_parent, run_tokens))
                run_hashes, run_tokens = [], []
            prev = h
        if run_hashes:
            self._events.append(Stored(run_hashes, run_parent, run_tokens))

    def reset_prefix_cache(self) -> None:
        """Forget every hash (contents stay; referenced blocks stay referenced)."""
        for block in self.blocks:
            block.block_hash = None
        self._cached.clear()
        self._events.append(Cleared())

    def wipe(self) -> None:
        """The KV memory released and allocated again (a sleep): every content lost, every
        hash forgotten; references stay."""
        for block in self.blocks:
            block.kv = [0] * self.block_size
        self.reset_prefix_cache()

    def drain_events(self) -> list[CacheEvent]:
        events, self._events = self._events, []
        return events

    # -- contents -----------------------------------------------------------------------

    def read(self, block_ids: Sequence[int]) -> list[list[int]]:
        """Copies of the blocks' KV content, whatever they hold now."""
        return [list(self.blocks[bid].kv) for bid in block_ids]

    def write(self, block_ids: Sequence[int], start: int, kv: Sequence[int]) -> None:
        """Write KV entries for positions start.. of the sequence that owns block_ids."""
        bs = self.block_size
        for offset, value in enumerate(kv):
            pos = start + offset
            self.blocks[block_ids[pos // bs]].kv[pos % bs] = value

    def kv_at(self, block_ids: Sequence[int], pos: int) -> int:
        return self.blocks[block_ids[pos // self.block_size]].kv[pos % self.block_size]
