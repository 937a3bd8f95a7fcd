"""Claim a conversation's handle and verify it against the new prompt before any read.

A read of D's blocks for a prompt that is not an exact token extension of D's sequence
answers wrongly with HTTP 200 and poisons P's prefix cache (vllm#43094; measured on 0.32).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import msgspec

from router.connectors import nixl as handoff
from router.engines.client import UpstreamFailure
from router.engines.pool import Pool, engine_family
from router.services import Services
from router.tracing import span
from router.turn.incoming import Incoming, canonical_items
from router.turn.rewrite import ids_leg_allowed
from sessions import model as sm
from sessions.keys import conversation_key
from sessions.model import SessionState
from sessions.store import StoreError

log = logging.getLogger("kvbaton.reuse")

# Fields of a chat request that change how /tokenize renders the prompt.
_TOKENIZE_CHAT_FIELDS = (
    "add_generation_prompt",
    "continue_final_message",
    "add_special_tokens",
    "chat_template",
    "chat_template_kwargs",
    "tools",
    "documents",
)


@dataclass(frozen=True)
class Reuse:
    """The `X-KV-Reuse` verdict: hit, or miss/skip with a reason."""

    outcome: str
    reason: str = ""
    tokens: int = 0

    def header(self) -> str:
        return f"{self.outcome};reason={self.reason}" if self.reason else self.outcome


@dataclass(frozen=True)
class Claim:
    """A conversation's state as claimed, and what the P leg may read."""

    key: str | None
    state: SessionState | None
    reuse: Reuse
    params: dict[str, Any] | None = None
    claimed: bool = False
    # The new prompt as P's /tokenize rendered it, when the P leg may send it as token ids.
    prompt_ids: list[int] | None = None

    def miss(self, reason: str) -> Claim:
        return replace(self, reuse=Reuse("miss", reason), params=None)


async def claim(svc: Services, inc: Incoming, request_id: str) -> Claim:
    """Take the conversation's handle from the store (single use), or say why not."""
    if inc.conversation_id is None:
        return Claim(None, None, Reuse("skip", "no-conversation-id"))
    key = conversation_key(inc.tenant, inc.conversation_id)
    if not svc.settings.reuse:
        # Affinity only: read the state for placement, never take or send a handle.
        try:
            state = await svc.guard.call(lambda: svc.store.get(key))
        except StoreError:
            return Claim(key, None, Reuse("miss", "store-unavailable"))
        return Claim(key, state, Reuse("skip", "reuse-disabled"))
    try:
        with span("kvbaton.claim"):
            state = await svc.guard.call(lambda: svc.store.claim(key, request_id))
    except StoreError:
        return Claim(key, None, Reuse("miss", "store-unavailable"))
    reason = sm.handle_unusable_reason(state, inc.api, svc.clock())
    if state is not None and not reason:
        reason = _placement_reason(svc.pool, state)
    if reason:
        return Claim(key, state, Reuse("miss", reason), claimed=state is not None)
    assert state is not None and state.kv_transfer_params is not None
    return Claim(
        key,
        state,
        Reuse("hit", tokens=state.token_count),
        params=handoff.hit_params(state.kv_transfer_params),
        claimed=True,
    )


def _placement_reason(pool: Pool, state: SessionState) -> str:
    """A handle naming an instance the router no longer routes to is not used."""
    inst = pool.find("decode", state.decode)
    if inst is None:
        return "decode-removed"
    if not inst.healthy:
        return "decode-unhealthy"
    # D restarted since this handle was made: its blocks and engine id are gone, and a read
    # would fail (kv_load_failure_policy=fail) or, worse, hang on a handshake. The health loop
    # sees a new process start time within one interval; a handle captured since shows a new
    # engine id.
    if inst.started and state.decode_started and inst.started != state.decode_started:
        return "decode-restarted"
    made_by = engine_family(state.decode_engine_id)
    if inst.engine_id and made_by and inst.engine_id != made_by:
        return "decode-restarted"
    if inst.unreachable:  # maybe restarting: nothing says the handle's blocks are still its own
        return "decode-unreachable"
    return ""


def _prefix_verdict(inc: Incoming, state: SessionState) -> str:
    """'extends', 'diverges-late' (inside D's last answer: tokens decide), or 'mismatch'."""
    if inc.api in ("chat", "responses"):
        items = canonical_items(inc)
        if sm.prefix_extends(state, inc.api, items=items):
            return "extends"
        late = (
            state.prompt_len > 0
            and len(items) > state.prefix_len
            and items[state.prompt_len].get("role") == "assistant"
            and sm.prefix_extends(
                replace_digest(state), inc.api, items=items[: state.prompt_len + 1]
            )
        )
        return "diverges-late" if late else "mismatch"
    prompt = inc.prompt
    if not isinstance(prompt, str):
        return "extends"  # token-id prompts are compared token by token
    if sm.prefix_extends(state, inc.api, text=prompt):
        return "extends"
    if (
        state.prompt_len > 0
        and len(prompt) > state.prompt_len
        and sm.prefix_extends(replace_digest(state), inc.api, text=prompt[: state.prompt_len + 1])
    ):
        return "diverges-late"
    return "mismatch"


def replace_digest(state: SessionState) -> SessionState:
    """The state seen as covering only the prompt of its last turn (without D's answer)."""
    return msgspec.structs.replace(
        state, prefix_digest=state.prompt_digest, prefix_len=state.prompt_len
    )


def tokenize_body(inc: Incoming, model: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": inc.body.get("model") or model}
    if inc.api == "chat":
        body["messages"] = inc.messages
        body["add_generation_prompt"] = True
        body.update({k: inc.body[k] for k in _TOKENIZE_CHAT_FIELDS if k in inc.body})
    else:
        body["prompt"] = inc.prompt
        if "add_special_tokens" in inc.body:
            body["add_special_tokens"] = inc.body["add_special_tokens"]
    return body


async def prompt_token_ids(
    svc: Services, inc: Incoming, prefill_url: str, request_id: str
) -> list[int] | None:
    """The new prompt as the chosen P renders it (its own /tokenize), or None on failure."""
    if inc.api == "completions" and not isinstance(inc.prompt, str):
        return list(inc.prompt)
    try:
        with span("kvbaton.verify", instance=prefill_url):
            status, raw = await svc.upstream.post_json(
                prefill_url + "/tokenize",
                tokenize_body(inc, svc.model),
                request_id=request_id,
                timeout=svc.settings.prefill_timeout,
            )
        tokens = msgspec.json.decode(raw).get("tokens") if status == 200 else None
    except (UpstreamFailure, msgspec.DecodeError, AttributeError) as exc:
        log.warning("tokenize on %s failed: %s", prefill_url, exc)
        return None
    if not isinstance(tokens, list):
        return None
    return tokens


def _ids_leg(inc: Incoming) -> bool:
    """Whether the ids /tokenize just gave are the whole prompt P would build (a token-id
    prompt is sent as it came: P has its ids already). Whether the process sends ids at all
    (--prefill-token-ids, or switched off) is the P leg's check."""
    if inc.api == "completions" and not isinstance(inc.prompt, str):
        return False
    return ids_leg_allowed(inc.api, inc.body)


async def verify(
    svc: Services, inc: Incoming, found: Claim, prefill_url: str, request_id: str
) -> Claim:
    """Keep the hit only for the longest verified prefix of D's sequence."""
    if found.params is None or found.state is None:
        return found
    state, held = found.state, found.params
    verdict = _prefix_verdict(inc, state)
    if verdict == "mismatch":
        return found.miss("prefix-mismatch")
    if svc.settings.verify_prefix == "digest" or inc.api == "responses":
        # vLLM's /tokenize cannot render Responses input, so those turns are checked by
        # their item digests alone.
        return found if verdict == "extends" else found.miss("prefix-mismatch")
    if not state.block_digests and not state.seq_digest:
        return found.miss("no-token-digests")
    tokens = await prompt_token_ids(svc, inc, prefill_url, request_id)
    if tokens is None:
        return found.miss("tokenize-failed")
    verified = sm.verified_tokens(state, tokens)
    floor = max(svc.settings.min_reuse_tokens, state.block_size, 1)
    if verified < floor:
        return found.miss("prefix-mismatch")
    # Only on a hit: /tokenize rendered D's own tokens of this conversation exactly, evidence
    # that it and P's chat route render it alike (a field that only the route honours, say
    # tool_choice "none" hiding the tools, shows up as a mismatch above).
    if _ids_leg(inc):
        found = replace(found, prompt_ids=tokens)
    if verified >= state.token_count:
        return found
    params = handoff.truncate(held, verified, state.block_size)
    return replace(found, params=params, reuse=Reuse("hit", tokens=verified))
