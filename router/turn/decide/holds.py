"""What does P hold already, and what moved? The verified prefix P holds since the
conversation's last turn or by its KV events (then no handle is sent), a handle whose blocks
D evicted, the P holding the longest prefix, and after the P leg what P's own count says
moved (a `hit` means KV moved from D). Pure: kv_aware and the legs apply them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from router.engines.pool import Instance
from router.turn.outcomes import Reason, Reuse, Via
from sessions.model import SessionState


def cached_reuse(verified: Reuse, block_size: int, *, p_held: int, d_evicted: bool) -> Reuse:
    """A verified hit seen with the engines' KV events: if the chosen P already holds every
    full block of the verified prefix (`p_held` tokens), no handle is sent (a read would
    bring P nothing); else a handle whose blocks D evicted or cleared is dropped."""
    if not verified.pulls:
        return verified
    covered = verified.tokens // block_size * block_size if block_size > 0 else 0
    if covered > 0 and p_held >= covered:
        return replace(verified, via=Via.PREFILL_CACHE)  # how it was found stays
    if d_evicted:
        return Reuse.miss(Reason.EVICTED)
    return verified


def prefix_placement(
    held: Sequence[tuple[Instance, int]], current: Instance, slack: int
) -> Instance:
    """The P holding the longest prefix of the prompt (`held`: usable P and the tokens each
    holds), among those within `slack` requests of the least loaded; `current` (the load and
    affinity pick) unless another holds more."""
    if not held:
        return current
    least = min(inst.outstanding for inst, _ in held)
    fit = [(inst, n) for inst, n in held if inst.outstanding <= least + slack]
    mine = next((n for inst, n in fit if inst is current), -1)
    best, most = max(fit, key=lambda pair: pair[1])
    return best if most > max(mine, 0) else current


def since_last_turn(state: SessionState, prefill: str, block_size: int) -> int:
    """Tokens of the verified prefix that P (its URL) holds because it was the conversation's
    last P: the full blocks of the prompt it computed or found cached then. D's sequence
    begins with that prompt, so they are the verified prefix's first tokens. P may have
    evicted them since (nothing says so without KV events): `moved` judges what P reports."""
    if not state.prefill or prefill != state.prefill or block_size <= 0:
        return 0
    return state.prefill_tokens // block_size * block_size


def moved(reuse: Reuse, cached: int | None, block_size: int) -> Reuse:
    """A pull's or P-cache hit's verdict after the P leg, from the prompt tokens P reports
    cached (`usage.prompt_tokens_details.cached_tokens`: its own prefix cache and what it
    read). A read brings P's count up to the handle's tokens, so a lower count means P read
    nothing (vLLM skips a read of fewer than its `kv_recompute_threshold` tokens): its own
    cache held what it counts. None (no count): the verdict stays."""
    if cached is None or not reuse.is_hit or reuse.via not in (None, Via.PREFILL_CACHE):
        return reuse
    need = reuse.tokens
    if reuse.via is Via.PREFILL_CACHE and block_size > 0:
        need = reuse.tokens // block_size * block_size  # P's cache holds whole blocks
    if cached >= need:
        return reuse
    if cached <= 0:
        return Reuse.miss(Reason.RECOMPUTED)
    return Reuse.hit(cached, Via.PREFILL_CACHE, reuse.found)
