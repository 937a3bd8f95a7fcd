"""What after a P attempt, and after a failed D? The P leg's next step from what one attempt
sent and got back, and whether a turn whose D failed before its first byte is redone. Pure:
the legs apply them."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

# A failed D before its first byte is redone once, on another D if there is one.
DECODE_ATTEMPTS = 2


class Next(StrEnum):
    """What the P leg does after one attempt."""

    DONE = "done"  # P prefilled: on to D
    AS_BODY = "as-body"  # P refused the prompt as token ids (4xx): same P, the client's body
    AS_MISS = "as-miss"  # P refused the handle: same P, as a miss
    ANOTHER_P = "another-p"  # P failed: another P
    RELAY = "relay"  # P's own 4xx to the client's request: relay it


@dataclass(frozen=True)
class Attempt:
    """What one P attempt sent and got back."""

    status: int | None  # None: no HTTP answer (refused, reset, timed out)
    ok: bool  # 200 and a body that does not say it failed
    reached: bool  # False only when the connection was never made
    with_handle: bool
    with_ids: bool
    paused: bool = False  # vLLM 0.33's 503 engine_paused: P took nothing, read nothing


@dataclass(frozen=True)
class AfterPrefill:
    next: Next
    handle_used: bool = False  # P may have read the handle: never send it again
    failed: bool = False  # counts against P's health


def after_prefill(a: Attempt) -> AfterPrefill:
    refused = a.status is not None and 400 <= a.status < 500  # P's 4xx: the request refused
    if a.with_ids and refused:
        # P validates before reading any KV: the ids were refused, not the handle.
        return AfterPrefill(Next.AS_BODY)
    if a.ok:
        return AfterPrefill(Next.DONE)
    if a.paused:
        # Refused before the engine took the request: the handle was not read (vLLM frees
        # nothing of D's for it), P is not broken and D is not to blame: another P.
        return AfterPrefill(Next.ANOTHER_P)
    # A failed or declined D->P read answers 500 under kv_load_failure_policy=fail (vLLM
    # #34896); a timeout may still be reading (a hung D). Either way the handle is used up,
    # and the failure is the handle's D's: the same P is tried again as a miss, and is judged
    # by that attempt alone (a hung D must not eject every P).
    if a.with_handle and (a.status is not None or a.reached):
        return AfterPrefill(Next.AS_MISS, handle_used=True)
    if a.status == 429:
        return AfterPrefill(Next.ANOTHER_P)  # busy, not broken: another P, no ejection
    if refused:
        return AfterPrefill(Next.RELAY)
    return AfterPrefill(Next.ANOTHER_P, failed=True)


def redo_decode(failed_attempts: int) -> bool:
    """Whether a turn whose D failed before its first byte is redone (with a new P leg)."""
    return failed_attempts < DECODE_ATTEMPTS
