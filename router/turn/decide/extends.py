"""Does the new prompt extend what D holds, and how far? The message or text digests first,
then, when they cannot decide, P's tokens against D's block digests. Pure: claim.verify
applies them."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum, StrEnum
from typing import Any

import msgspec

from router.turn.outcomes import Reason, Reuse
from sessions import model as sm
from sessions.model import SessionState


class Prefix(StrEnum):
    EXTENDS = "extends"  # the new prompt starts with what D holds
    DIVERGES_LATE = "diverges-late"  # differs inside D's last answer: tokens decide
    MISMATCH = "mismatch"  # differs earlier (edited history, regenerate, new system prompt)


def as_prompt_only(state: SessionState) -> SessionState:
    """The state seen as covering only the prompt of its last turn (without D's answer)."""
    return msgspec.structs.replace(
        state, prefix_digest=state.prompt_digest, prefix_len=state.prompt_len
    )


def item_prefix(
    api: str, items: Sequence[Any], state: SessionState, heads: Sequence[str] | None = None
) -> Prefix:
    """A chat or Responses conversation (canonical items, and their `conversation_heads` when
    known) against the digests D holds."""
    if sm.prefix_extends(state, api, items=items, heads=heads):
        return Prefix.EXTENDS
    late = (
        state.prompt_len > 0
        and len(items) > state.prefix_len
        and items[state.prompt_len].get("role") == "assistant"
        and sm.prefix_extends(
            as_prompt_only(state), api, items=items[: state.prompt_len + 1], heads=heads
        )
    )
    return Prefix.DIVERGES_LATE if late else Prefix.MISMATCH


def text_prefix(api: str, prompt: str | list[int], state: SessionState) -> Prefix:
    """A completions prompt against the digests D holds (token ids are compared by tokens)."""
    if not isinstance(prompt, str) or sm.prefix_extends(state, api, text=prompt):
        return Prefix.EXTENDS
    if (
        state.prompt_len > 0
        and len(prompt) > state.prompt_len
        and sm.prefix_extends(as_prompt_only(state), api, text=prompt[: state.prompt_len + 1])
    ):
        return Prefix.DIVERGES_LATE
    return Prefix.MISMATCH


class ByTokens(Enum):
    """The digests cannot decide a hit: P's /tokenize of the new prompt does."""

    DECIDE = "by-tokens"


Check = Reuse | ByTokens  # a verdict (a hit, or a miss and why), or P's tokens decide


def digest_verdict(prefix: Prefix, hit: Reuse) -> Reuse:
    """The verdict from the digests alone, when no token check is made."""
    return hit if prefix is Prefix.EXTENDS else Reuse.miss(Reason.PREFIX_MISMATCH)


def digest_check(prefix: Prefix, hit: Reuse, *, by_tokens: bool, state: SessionState) -> Check:
    """The verdict from the digests alone, or that P's /tokenize must decide."""
    if prefix is Prefix.MISMATCH or not by_tokens:
        return digest_verdict(prefix, hit)
    if not state.block_digests and not state.seq_digest:
        return Reuse.miss(Reason.NO_TOKEN_DIGESTS)
    return ByTokens.DECIDE


def token_verdict(state: SessionState, tokens: list[int] | None, min_reuse_tokens: int) -> Reuse:
    """A hit on the longest block-aligned prefix of D's sequence the new prompt's tokens
    verify, or a miss when less than a block (or `--min-reuse-tokens`) matches."""
    if tokens is None:
        return Reuse.miss(Reason.TOKENIZE_FAILED)
    verified = sm.verified_tokens(state, tokens)
    if verified < max(min_reuse_tokens, state.block_size, 1):
        return Reuse.miss(Reason.PREFIX_MISMATCH)
    return Reuse.hit(min(verified, state.token_count))
