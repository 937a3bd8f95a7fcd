"""Verdicts from what P holds and what P reports: the connectors that keep no D->P handle
(affinity for push and MoRI-IO, what P reports cached for store), and, for the pull, what
the chosen P holds of the verified prefix since the conversation's last turn and what moved
by P's own count (a `hit` means KV moved from D). Pure: the legs apply them."""

from __future__ import annotations

from router.turn.outcomes import Outcome, Reason, Reuse, Via
from sessions.model import SessionState

# Verdicts about the session itself, which a connector without a D->P handle keeps; every
# other one (they are about a handle, which it never has) becomes its affinity reason.
SESSION_REASONS = frozenset(
    {
        Reason.NO_SESSION,
        Reason.BUSY,
        Reason.STORE_UNAVAILABLE,
        Reason.CORRUPT_STATE,
        Reason.HANDLE_UNAUTHENTICATED,
        Reason.PREFIX_MISMATCH,
        Reason.API_MISMATCH,
        Reason.NO_CONVERSATION_ID,
        Reason.REUSE_DISABLED,
    }
)


def affinity(claimed: Reuse, continuing: bool) -> Reuse:
    """No D->P reuse (push: vllm#46473; MoRI-IO): a continued conversation says so."""
    if continuing and claimed.reason not in SESSION_REASONS:
        return Reuse.miss(Reason.PUSH_AFFINITY)
    return claimed


def store(claimed: Reuse, continuing: bool, cached: int, local: int | None = None) -> Reuse:
    """The turn's X-KV-Reuse: a skip or a first turn stays as claimed; a continuing
    conversation is a hit on the tokens P reports cached, or a miss when it reports none.
    `local`: what P's own cache held before the P leg, when its KV events say so: a hit it
    covers entirely came from P's own cache (`via=prefill-cache`), not from the store."""
    if claimed.outcome is Outcome.SKIP or not continuing:
        return claimed
    if cached <= 0:
        return Reuse.miss(Reason.STORE_MISSED)
    if local is not None and cached <= local:
        return Reuse.hit(cached, via=Via.PREFILL_CACHE)
    return Reuse.hit(cached, via=Via.STORE)


def held_since_last_turn(state: SessionState, prefill: str, block_size: int) -> int:
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
