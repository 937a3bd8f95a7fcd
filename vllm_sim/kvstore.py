"""The shared KV store (`--kv-connector store --kv-store redis://...`), as vLLM's
MooncakeStoreConnector uses its store: producers write every finished full block under the
block's chained content hash, and every instance looks blocks up by hash before computing.

A block's value is its KV entries (64-bit, little endian). The hash chains over the whole
prefix, and so does the KV (`model.py`), so a block found by hash is exactly the KV a
from-scratch prefill would compute, unless someone wrote the wrong value: then the answer is
wrong, as on a real engine. A store error is a miss (the instance computes), never a failure.
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Sequence

from vllm_sim.metrics import Counters
from vllm_sim.resp import RespClient, RespError

logger = logging.getLogger(__name__)

KEY_PREFIX = "vllm_sim:kv"


def block_key(namespace: str, block_hash: int) -> str:
    return f"{KEY_PREFIX}:{namespace}:{block_hash:016x}"


def pack(kv: Sequence[int]) -> bytes:
    return array("Q", kv).tobytes()


def unpack(data: bytes, block_size: int) -> list[int] | None:
    """A block's KV entries, or None when the value is not one block of KV."""
    if len(data) != 8 * block_size:
        return None
    values = array("Q")
    values.frombytes(data)
    return list(values)


class KVStore:
    """One instance's view of the shared store: namespaced by model and block size (blocks of
    another model or size never match)."""

    def __init__(self, url: str, model: str, block_size: int, counters: Counters) -> None:
        self.client = RespClient(url)
        self.namespace = f"{model}:{block_size}"
        self.block_size = block_size
        self.counters = counters

    async def load(self, hashes: Sequence[int]) -> list[list[int]]:
        """The KV of the longest run of leading blocks the store holds (by hash)."""
        if not hashes:
            return []
        keys = [block_key(self.namespace, h) for h in hashes]
        try:
            reply = await self.client.command("MGET", *keys)
        except RespError as exc:
            self.counters.sim_store_errors += 1
            logger.warning("KV store lookup failed, computing instead: %s", exc)
            return []
        self.counters.sim_store_lookups += 1
        found: list[list[int]] = []
        for value in reply if isinstance(reply, list) else []:
            kv = unpack(value, self.block_size) if isinstance(value, bytes) else None
            if kv is None:
                break
            found.append(kv)
        self.counters.sim_store_blocks_read += len(found)
        return found

    async def save(self, hashes: Sequence[int], blocks: Sequence[Sequence[int]]) -> None:
        """Write full blocks (their hashes and KV, in order)."""
        if not hashes:
            return
        args: list[bytes | str | int] = ["MSET"]
        for h, kv in zip(hashes, blocks, strict=True):
            args += [block_key(self.namespace, h), pack(kv)]
        try:
            await self.client.command(*args)
        except RespError as exc:
            self.counters.sim_store_errors += 1
            logger.warning("KV store write failed, %d blocks not stored: %s", len(hashes), exc)
            return
        self.counters.sim_store_blocks_written += len(hashes)

    def close(self) -> None:
        self.client.close()
