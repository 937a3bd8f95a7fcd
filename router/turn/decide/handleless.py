"""The verdict of a connector without a D->P handle: affinity for push and MoRI-IO, what P
reports cached for store. Pure: the legs apply them."""

from __future__ import annotations

from router.turn.outcomes import Outcome, Reason, Reuse, Via

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
