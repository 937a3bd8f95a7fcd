"""Whether the prompt plus the tokens asked for fit D's context (max_model_len), checked
before P prefills: D refuses what does not fit only after P has pinned the prompt's blocks
for it (issue 32). Known cheaply or not at all: the count a verified hit has; for a later
turn, the conversation's state (D's token count for the prefix its digest verifies, plus the
bytes of what follows); a byte bound for the rest; and P's /tokenize only for requests whose
bound comes near the limit (issue 49: a turn that pulls nothing makes no /tokenize call)."""

from __future__ import annotations

from typing import Any

import msgspec

from router.errors import BadRequest
from router.turn import render
from router.turn.claim import prefix_verdict, prompt_token_ids
from router.turn.decide import extends
from router.turn.incoming import Incoming
from router.turn.state import Turn
from sessions.model import SessionState

# vLLM's order: a chat request's max_completion_tokens, when set, wins over max_tokens.
_LIMITS = {"chat": ("max_completion_tokens", "max_tokens"), "completions": ("max_tokens",)}
# Tokens a chat template adds beyond the body's own bytes (role markers, a BOS token). The
# body's JSON syntax around each message is already more bytes than its markers take tokens.
TEMPLATE_MARGIN = 64
# Content parts that are text (chat's, and the Responses API's input and output text).
_TEXT_PARTS = ("text", "input_text", "output_text")


def asked(inc: Incoming) -> tuple[str, int] | None:
    """The output limit the engine applies (its field, its value); None: none set."""
    found = [(k, inc.body[k]) for k in _LIMITS.get(inc.api, ()) if inc.body.get(k) is not None]
    return found[0] if found else None


def bounded(inc: Incoming) -> bool:
    """Whether the body's size bounds its prompt's tokens (each token of text is at least one
    byte): text only; an image's placeholder tokens are many more than its URL's bytes."""
    if inc.api == "completions":
        return True
    return all(_text_only(m.get("content")) for m in inc.items if isinstance(m, dict))


def _text_only(content: Any) -> bool:
    if content is None or isinstance(content, str):
        return True
    return isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") in _TEXT_PARTS for p in content
    )


def may_not_fit(inc: Incoming, want: int, max_model_len: int) -> bool:
    """Whether the byte bound leaves any doubt (or there is no bound at all)."""
    return not bounded(inc) or inc.size + TEMPLATE_MARGIN + want > max_model_len


def state_bound(inc: Incoming, state: SessionState | None) -> int | None:
    """The prompt's tokens at most, from the conversation's state: D's whole sequence for the
    stored prefix (its digest verified; a re-rendered answer's markers are in the margin),
    plus one token per byte of the text after it. None: the state vouches for nothing."""
    if state is None or state.token_count <= 0 or inc.api not in ("chat", "completions"):
        return None
    if prefix_verdict(inc, state) is not extends.Prefix.EXTENDS:
        return None
    if inc.api == "completions":
        if not isinstance(inc.prompt, str):
            return None
        rest = len(inc.prompt[state.prefix_len :].encode())
    else:
        after = inc.messages[state.prefix_len :]
        if not all(isinstance(m, dict) and _text_only(m.get("content")) for m in after):
            return None
        rest = len(msgspec.json.encode(after))
    return state.token_count + rest + TEMPLATE_MARGIN


def refusal(key: str, want: int, prompt: int, max_model_len: int) -> BadRequest:
    # vLLM's own words for the same refusal (its max_tokens check against the prompt).
    return BadRequest(
        f"'{key}' is too large: {want}. This model's maximum context length is "
        f"{max_model_len} tokens and your request has {prompt} input tokens "
        f"({want} > {max_model_len} - {prompt}).",
        param=key,
        code="context_length_exceeded",
    )


async def check(turn: Turn, prefill_url: str) -> None:
    """BadRequest when the prompt plus the output limit cannot fit D's context, before P."""
    svc, inc = turn.svc, turn.inc
    if inc.api == "responses":
        await _check_responses(turn, prefill_url)
        return
    limit, found = svc.max_model_len, asked(inc)
    if not limit or found is None:
        return
    key, want = found
    tokens = turn.claim.tokens
    if tokens is None:
        if inc.api == "completions" and not isinstance(inc.prompt, str):
            tokens = list(inc.prompt)
        elif not bounded(inc) or not may_not_fit(inc, want, limit):
            return  # fits for sure, or cannot be known cheaply: D says
        elif (bound := state_bound(inc, turn.claim.state)) is not None and bound + want <= limit:
            return  # the conversation's state says it fits: no /tokenize on the way to P
        else:
            tokens = await prompt_token_ids(svc, inc, prefill_url, turn.request_id)
            if tokens is None:
                return
    if len(tokens) + want > limit:
        raise refusal(key, want, len(tokens), limit)


async def _check_responses(turn: Turn, prefill_url: str) -> None:
    """A Responses prompt that leaves D no room for one token (`render.too_long`). Its tokens
    come from a verified hit, else P's render when the byte bound leaves doubt (a render that
    refuses it says so; without the route, P refuses it itself, before any prefill)."""
    svc, inc = turn.svc, turn.inc
    limit, tokens = svc.max_model_len, turn.claim.tokens
    if not limit:
        return
    if tokens is None:
        if not bounded(inc) or inc.size + TEMPLATE_MARGIN < limit:
            return
        tokens = await prompt_token_ids(svc, inc, prefill_url, turn.request_id)
        if tokens is None:
            return
    if len(tokens) >= limit:
        raise render.too_long(len(tokens), limit)
