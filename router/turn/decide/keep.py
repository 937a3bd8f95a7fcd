"""What does the turn keep for the next one? D's new handle only when the next turn can
verify and read it, and else the reason the next turn will say. Pure: commit applies it."""

from __future__ import annotations

from dataclasses import dataclass

from router.turn.outcomes import Reason


@dataclass(frozen=True)
class Ending:
    """What D's finished answer lets the turn keep for the next one."""

    keep_handle: bool
    reason: Reason | None = None  # why not, for the next turn's X-KV-Reuse
    ids_differ: bool = False  # D tokenized the prompt otherwise than P computed it


@dataclass(frozen=True)
class Answered:
    """What the turn knows once D answered: the facts `ending` decides on."""

    handle: bool  # D returned a handle its connector reads
    reuse_on: bool  # --reuse
    tool_calls: bool  # D's answer calls tools
    stream: bool  # the client streamed
    sent_ids: list[int] | None  # the prompt as token ids P computed (None: sent as text)
    d_prompt_ids: list[int] | None  # D's prompt token ids (None: D gave none)
    token_ids_wanted: bool  # D was asked for its token ids
    token_ids_needed: bool  # the next turn verifies by tokens
    local: bool = False  # the decode plan: D alone, no P leg


def ending(facts: Answered) -> Ending:
    """The handle D returned is kept only when the next turn can verify and read it."""
    sent_ids, d_prompt_ids = facts.sent_ids, facts.d_prompt_ids
    differ = sent_ids is not None and d_prompt_ids is not None and d_prompt_ids != sent_ids
    reason: Reason | None = None
    if not facts.reuse_on:
        reason = Reason.REUSE_DISABLED
    elif facts.tool_calls:
        reason = Reason.TOOL_CALLS
    elif not facts.handle and facts.local:
        reason = Reason.DECODE_LOCAL  # D alone kept nothing: not bidirectional
    elif not facts.handle:
        reason = Reason.STREAM_NO_KV_PARAMS if facts.stream else Reason.NO_KV_PARAMS
    if differ:
        reason = Reason.PROMPT_IDS_DIFFER
    have_ids = facts.token_ids_wanted and d_prompt_ids is not None
    if reason is None and facts.token_ids_needed and not have_ids:
        reason = Reason.NO_TOKEN_IDS
    return Ending(keep_handle=reason is None, reason=reason, ids_differ=differ)


# Without a handle, D's prefix cache still holds the turn's sequence: its token digests are
# kept for the decode plan, unless they are not to be trusted (ids differ) or not wanted.
CACHE_KEPT = frozenset({Reason.STREAM_NO_KV_PARAMS, Reason.NO_KV_PARAMS, Reason.DECODE_LOCAL})
