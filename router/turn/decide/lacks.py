"""What the previous D's prefix cache lacks of a new prompt, bounded from the conversation's
state alone, so that the decode plan is decided before the turn pays for anything (no
/tokenize). An estimate, never a verification: D's prefix cache is keyed by content, so a
prompt that lacks more than estimated only costs D more compute, never a wrong answer. Pure."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from router.turn.decide import extends
from router.turn.incoming import Incoming, canonical_items
from sessions import model as sm
from sessions.model import SessionState

# Tokens a chat template adds to each message beyond its text: ChatML's `<|im_start|>user\n`
# and `<|im_end|>\n` are 5, Llama 3's header and `<|eot_id|>` 5, rounded up to 8.
PER_MESSAGE = 8
# Tokens of the turn itself: the generation prompt after the last message, and the markers
# that close D's last answer (D's sequence ends at its last sampled token, before them).
PER_TURN = 16
# Message fields whose text the bound counts byte for byte (any other field, a tool call, is
# counted by its whole JSON encoding, at least as many bytes as the text a template renders).
_TEXT_FIELDS = frozenset({"role", "content"})
# Content parts that are text (chat's, and the Responses API's input and output text).
_TEXT_PARTS = ("text", "input_text", "output_text")


@dataclass(frozen=True)
class Lacks:
    new: int  # at most this many of the prompt's tokens are not in D's prefix cache
    holds: int  # the prompt's leading tokens D's prefix cache holds (whole blocks)


def held(token_count: int, block_size: int) -> int:
    """Tokens of D's sequence its prefix cache keeps: the full blocks before its last token
    (D never computes the KV of the token it sampled last)."""
    if block_size <= 0 or token_count <= 1:
        return 0
    return (token_count - 1) // block_size * block_size


def estimate(inc: Incoming, state: SessionState) -> Lacks | None:
    """The new tokens at most and what D holds; None: the state cannot bound them (another
    API, a prompt that does not extend D's conversation as digested, non-text content)."""
    if state.api != inc.api or state.token_count <= 0:
        return None
    if inc.api == "completions" and not isinstance(inc.prompt, str):
        ids = inc.prompt  # the prompt's own ids: what D holds is known exactly
        holds = min(sm.verified_tokens(state, ids), held(state.token_count, state.block_size))
        return Lacks(len(ids) - holds, holds)
    holds = held(state.token_count, state.block_size)
    if holds <= 0:
        return None
    if inc.api == "completions":
        assert isinstance(inc.prompt, str)
        if extends.text_prefix(inc.api, inc.prompt, state) is not extends.Prefix.EXTENDS:
            return None
        added = len(inc.prompt[state.prefix_len :].encode())
    elif inc.api == "chat":
        items = canonical_items(inc)
        if extends.item_prefix(inc.api, items, state, inc.heads) is not extends.Prefix.EXTENDS:
            return None
        after = message_tokens(inc.messages[state.prefix_len :])
        if after is None:
            return None
        added = after + PER_TURN
    else:
        return None  # Responses: items render in ways the bytes do not bound
    return Lacks(state.token_count - holds + added, holds)


def message_tokens(messages: Sequence[Any]) -> int | None:
    """The tokens of these messages at most (byte-level BPE: a token is at least one byte of
    text), with the template's markers; None when one is not text (an image's placeholder
    tokens are many more than its URL's bytes)."""
    total = 0
    for m in messages:
        if not isinstance(m, Mapping):
            return None
        content = m.get("content")
        if isinstance(content, str):
            text = len(content.encode())
        elif content is None:
            text = 0
        elif isinstance(content, list) and all(_text_part(p) for p in content):
            text = sum(len(str(p.get("text", "")).encode()) for p in content)
        else:
            return None
        if m.keys() - _TEXT_FIELDS:
            text = len(msgspec.json.encode(m))
        total += text + PER_MESSAGE
    return total


def _text_part(part: Any) -> bool:
    return isinstance(part, Mapping) and part.get("type") in _TEXT_PARTS
