"""The toy model: a 64-bit KV chain per position and a next token chosen from the last KV.

kv[i] = H(kv[i-1], token[i]), so a KV entry carries its whole history, like real KV; reading
KV computed for another prefix therefore changes the answer (the correctness oracle).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

MASK64 = (1 << 64) - 1
KV_ROOT = 0x5EED_0F_C0FFEE_0001  # the KV "before" position 0
_SAMPLE_SALT = 0x7A11_5A17_0000_0001
_BLOCK_SEED = 0xB10C_0000_0000_0001


_ODD = 0xD6E8FEB86659FD93


def mix(a: int, b: int) -> int:
    """A 64-bit digest of the pair (a, b): one splitmix64 round over a ^ b*odd."""
    z = ((a ^ ((b * _ODD) & MASK64)) + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


def kv_next(prev: int, token_id: int) -> int:
    """The KV entry of a position, given the KV entry of the previous one."""
    return mix(prev, token_id)


def kv_chain(prev: int, token_ids: Sequence[int]) -> list[int]:
    """The KV entries of token_ids, continuing from prev (KV_ROOT at position 0)."""
    out: list[int] = []
    append = out.append
    m = MASK64
    for t in token_ids:  # mix(), inlined: this loop is the simulator's hot path
        z = ((prev ^ ((t * _ODD) & m)) + 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        prev = z ^ (z >> 31)
        append(prev)
    return out


def sample(last_kv: int, emittable: Sequence[int]) -> int:
    """The next token: a function of the KV at the last position only."""
    return emittable[mix(last_kv, _SAMPLE_SALT) % len(emittable)]


def block_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """A full block's prefix-cache hash, chained on its parent's hash (unsigned 64-bit).

    BLAKE2b of (parent hash, token ids), like vLLM's hash of (parent, tokens, extra keys).
    """
    data = array("Q", [_BLOCK_SEED if parent is None else parent, *token_ids]).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of every full block of token_ids."""
    out: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out
