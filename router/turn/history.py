"""History-addressed sessions (pure): a request without a conversation id continues the session
whose D holds the longest prefix of its history, found by a tenant-scoped digest of it."""

from __future__ import annotations

import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from router.turn.incoming import Incoming, canonical_items
from sessions import digests
from sessions.keys import history_key
from sessions.model import SessionState

# Text prompts have no message boundaries: the index covers the longest prefix of what D holds
# that is a multiple of TEXT_STEP characters, and a lookup tries every such prefix of the new
# prompt, the longest TEXT_CANDIDATES of them (so the text after D's answer may be ~16k chars).
TEXT_STEP = 64
TEXT_CANDIDATES = 256
# The conversation ids the router gives history-addressed sessions.
_SYNTHETIC = re.compile(r"h-[0-9a-f]{32}")


def new_id() -> str:
    """A synthetic conversation id for a session that only its history names."""
    return f"h-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Candidate:
    """One history key a request may continue: a prefix of its history of `length` items
    (chat, Responses) or characters (completions) whose digest is `digest`."""

    key: str
    length: int
    digest: str


@dataclass(frozen=True)
class Match:
    """The session a history lookup found, and the prefix digest its state must have."""

    conversation_id: str
    expect: str


def candidates(inc: Incoming) -> list[Candidate]:
    """The history keys of a request, longest first: every strict prefix of its conversation
    that ends with an assistant message (text: every TEXT_STEP characters)."""
    if inc.api == "completions":
        prompt = inc.prompt
        if not isinstance(prompt, str):
            return []  # token ids: the same turn by id only
        ends = digests.text_heads(inc.api, prompt[:-1], TEXT_STEP, TEXT_CANDIDATES)
        return [Candidate(history_key(inc.tenant, d), n, d) for n, d in ends]
    items = canonical_items(inc)
    heads = inc.heads
    return [
        Candidate(history_key(inc.tenant, heads[k]), k + 1, heads[k])
        for k in range(len(items) - 2, -1, -1)
        if isinstance(items[k], dict) and items[k].get("role") == "assistant"
    ]


def pick(inc: Incoming, found: Sequence[Candidate], values: Sequence[str | None]) -> Match | None:
    """The longest candidate whose key names a session, checked against what it says it covers
    (a value that does not parse is ignored; the claim checks the state's own digest)."""
    for cand, value in zip(found, values, strict=True):
        if value is None:
            continue
        length, _, conversation_id = value.partition(" ")
        if not length.isdigit() or not _SYNTHETIC.fullmatch(conversation_id):
            continue
        held = int(length)
        if inc.api != "completions":
            if held == cand.length:
                return Match(conversation_id, cand.digest)
            continue
        prompt = inc.prompt
        assert isinstance(prompt, str)
        if cand.length <= held < len(prompt):
            return Match(conversation_id, digests.text_digest(inc.api, prompt[:held]))
    return None


def index_entry(
    inc: Incoming, conversation_id: str, state: SessionState, answer: str
) -> tuple[str, str] | None:
    """The history key and value under which a committed state is found by its next turn."""
    value = f"{state.prefix_len} {conversation_id}"
    if not state.prefix_digest:
        return None
    if inc.api != "completions":
        return history_key(inc.tenant, state.prefix_digest), value
    prompt = inc.prompt
    if not isinstance(prompt, str):
        return None
    aligned = state.prefix_len // TEXT_STEP * TEXT_STEP
    if aligned == 0:
        return None
    held = prompt + answer
    return history_key(inc.tenant, digests.text_digest(inc.api, held[:aligned])), value
