"""Claim a conversation's handle and verify it against the new prompt before any read.

A read of D's blocks for a prompt that is not an exact token extension of D's sequence
answers wrongly with HTTP 200 and poisons P's prefix cache (vllm#43094; measured on 0.32).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, Protocol

import msgspec

from router.errors import UpstreamFailure
from router.services import Services
from router.tracing import span
from router.turn import history, render
from router.turn.aim import aims_at_its_d
from router.turn.decide import extends, sendable
from router.turn.incoming import Incoming, canonical_items
from router.turn.outcomes import Found, Reason, Reuse
from router.turn.rewrite import ids_leg_allowed
from router.turn.tenant import conversation_hash
from sessions import integrity
from sessions.codec import handle_id
from sessions.keys import conversation_key
from sessions.model import SessionState
from sessions.store import CorruptState, StoreError

log = logging.getLogger("kvbaton.reuse")


class EarlyIds(Protocol):
    """P's /tokenize sent before verify needs it (router/turn/early.py)."""

    async def tokens_for(self, url: str) -> tuple[bool, list[int] | None]:
        """(True, ids) when it went to `url`; else (False, None)."""
        ...


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
class Claim:
    """A conversation's state as claimed, and what the P leg may read."""

    key: str | None
    state: SessionState | None
    reuse: Reuse
    params: dict[str, Any] | None = None  # D's handle, on a hit
    claimed: bool = False  # the store marked it in flight for this turn
    # The new prompt as P's /tokenize rendered it, when the P leg may send it as token ids.
    prompt_ids: list[int] | None = None
    # The new prompt's ids from P's /tokenize, on a hit verified by tokens.
    tokens: list[int] | None = None
    # The synthetic id of a session named by its history only ("" otherwise): the commit
    # indexes it under the digest of the conversation its D then holds.
    history_id: str = ""
    # The handle the claim took from the store, when D may still pin its blocks: unless a P
    # reads it this turn, it is released (router/turn/pins.py).
    taken: dict[str, Any] | None = None

    def miss(self, reason: Reason) -> Claim:
        return replace(self, reuse=Reuse.miss(reason), params=None)


async def claim(svc: Services, inc: Incoming, request_id: str) -> Claim:
    """Take the conversation's handle from the store (single use), or say why not."""
    if inc.conversation_id is not None:
        # A request that names its conversation never uses the history index.
        return await _claim_key(
            svc, inc, request_id, conversation_key(inc.tenant, inc.conversation_id)
        )
    if not svc.settings.history_sessions:
        return Claim(None, None, Reuse.miss(Reason.NO_CONVERSATION_ID))
    return await _by_history(svc, inc, request_id)


async def _by_history(svc: Services, inc: Incoming, request_id: str) -> Claim:
    """The session whose D holds the longest prefix of this history, if it has not moved on
    and no other turn holds it; else a new session (a first turn, a branch, a look-alike)."""
    fresh = history.new_id()
    new = Claim(
        conversation_key(inc.tenant, fresh), None, Reuse.miss(Reason.NO_SESSION), history_id=fresh
    )
    found = history.candidates(inc)
    if not found:
        return new
    try:
        with span("kvbaton.history"):
            values = await svc.guard.call(lambda: svc.store.find_history([c.key for c in found]))
    except StoreError:
        return replace(new, reuse=Reuse.miss(Reason.STORE_UNAVAILABLE))
    match = history.pick(inc, found, values)
    if match is None:
        return new
    key = conversation_key(inc.tenant, match.conversation_id)
    got = await _claim_key(svc, inc, request_id, key, expect=match.expect)
    state = got.state
    if state is None:  # expired since, or the store failed
        return new if got.reuse.reason is Reason.NO_SESSION else replace(new, reuse=got.reuse)
    if state.prefix_digest != match.expect:
        # The session moved on (a regenerate, or another client with the same history so
        # far): its handle stays for its own next turn; this one is a new branch.
        return replace(new, reuse=Reuse.miss(Reason.PREFIX_MISMATCH))
    if state.kv_transfer_params is None and state.inflight:
        return replace(new, reuse=Reuse.miss(Reason.BUSY))  # a turn of it is running now
    reuse = got.reuse
    if reuse.is_hit:
        reuse = replace(reuse, found=Found.HISTORY)
    return replace(got, reuse=reuse, history_id=match.conversation_id)


async def _claim_key(
    svc: Services, inc: Incoming, request_id: str, key: str, expect: str = ""
) -> Claim:
    try:
        if not svc.settings.reuse:
            # Affinity only: read the state for placement, never take or send a handle.
            state = await svc.guard.call(lambda: svc.store.get(key))
            return Claim(key, state, Reuse.miss(Reason.REUSE_DISABLED))
        with span("kvbaton.claim"):
            state = await svc.guard.call(lambda: svc.store.claim(key, request_id, expect))
    except CorruptState as exc:
        log.warning("conversation %s: %s (key dropped)", conversation_hash(key), exc)
        return Claim(key, None, Reuse.miss(Reason.CORRUPT_STATE))
    except StoreError:
        return Claim(key, None, Reuse.miss(Reason.STORE_UNAVAILABLE))
    if state is not None and (not expect or state.prefix_digest == expect):
        state = _spend(svc, key, state)
    decode = svc.pool.find("decode", state.decode) if state is not None else None
    reuse = sendable.claimed_reuse(state, inc.api, svc.clock(), decode)
    if state is not None and state.kv_transfer_params is not None:
        reuse = _checked(svc, key, state, reuse)
    taken = None
    if (
        state is not None
        and (not expect or state.prefix_digest == expect)
        and sendable.releasable(reuse.reason)
        and aims_at_its_d(svc, key, state)
    ):
        taken = state.kv_transfer_params
    if not reuse.is_hit:
        return Claim(key, state, reuse, claimed=state is not None, taken=taken)
    assert state is not None and state.kv_transfer_params is not None
    params = state.kv_transfer_params
    return Claim(key, state, reuse, params=params, claimed=True, taken=taken)


def _spend(svc: Services, key: str, state: SessionState) -> SessionState:
    """The claim took the state's handle: it is spent here now (read or released by this turn).
    One spent before (this process saw it read or released), or committed before the store's
    history broke (a Redis restart, restore or failover since), may name blocks D reused: the
    state comes back without it, as the store gives back one it knows spent."""
    params = state.kv_transfer_params
    if params is None:
        if state.no_handle_reason == Reason.STALE_HANDLE and not state.inflight:
            _warn_stale(key, "the session store knew it spent")
        return state
    hid = handle_id(params)
    seen = svc.spent.holds(hid)
    svc.spent.add_id(hid)
    if seen:
        _warn_stale(key, "this router read or released it before")
    elif state.updated_at < svc.store.history_since:
        _warn_stale(key, "it was committed before the session store's server changed")
    else:
        return state
    return msgspec.structs.replace(
        state, kv_transfer_params=None, no_handle_reason=str(Reason.STALE_HANDLE)
    )


def _warn_stale(key: str, why: str) -> None:
    log.warning(
        "conversation %s: its stored handle is not read (%s; the record is older than the "
        "conversation: a lagging replica, a restore or a failover): miss;reason=%s",
        conversation_hash(key),
        why,
        Reason.STALE_HANDLE,
    )


def _checked(svc: Services, key: str, state: SessionState, reuse: Reuse) -> Reuse:
    """`reuse` unless the state fails its HMAC (checked first: no field of it is trusted
    before) or, for a hit, the handle fails the router's checks: then a miss with its reason
    and one log line, never a read."""
    reason: Reason | None = None
    if not integrity.authentic(svc.settings.session_secrets, key, state):
        reason = Reason.HANDLE_UNAUTHENTICATED
    elif reuse.is_hit:
        reason = sendable.handle_check(svc.connector, state)
        if reason is None and not aims_at_its_d(svc, key, state):
            reason = Reason.HANDLE_INVALID  # another address than its D announced
    if reason is None:
        return reuse
    log.warning("conversation %s: its handle is not used (%s)", conversation_hash(key), reason)
    return Reuse.miss(reason)


def prefix_verdict(inc: Incoming, state: SessionState) -> extends.Prefix:
    if inc.api in ("chat", "responses"):
        return extends.item_prefix(inc.api, canonical_items(inc), state, inc.heads)
    return extends.text_prefix(inc.api, inc.prompt, state)


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
    """The new prompt as the chosen P renders it (its own /tokenize; a Responses request: its
    /v1/responses/render), or None on failure."""
    if inc.api == "completions" and not isinstance(inc.prompt, str):
        return list(inc.prompt)
    if inc.api == "responses":
        return await render.prompt_ids(svc, inc, prefill_url, request_id)
    try:
        with span("kvbaton.verify", instance=prefill_url):
            status, raw = await svc.engines.post_json(
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
    svc: Services,
    inc: Incoming,
    found: Claim,
    prefill_url: str,
    request_id: str,
    early: EarlyIds | None = None,
) -> Claim:
    """Keep the hit only for the longest verified prefix of D's sequence (P's ids from
    `early`, the /tokenize sent during the claim, when it went to this P)."""
    if found.params is None or found.state is None:
        return found
    state, handle = found.state, found.params
    # A Responses turn is verified by tokens when P renders it (/v1/responses/render) and D's
    # token ids were recorded; else by its item digests alone (the whole handle or nothing).
    by_tokens = svc.settings.verify_prefix == "tokens" and (
        inc.api != "responses" or render.verifiable(svc, state, prefill_url)
    )
    prefix = prefix_verdict(inc, state)
    check = extends.digest_check(prefix, found.reuse, by_tokens=by_tokens, state=state)
    if check is not extends.ByTokens.DECIDE:
        return _verdict(found, check)
    sent, tokens = await early.tokens_for(prefill_url) if early else (False, None)
    if not sent:
        tokens = await prompt_token_ids(svc, inc, prefill_url, request_id)
    if tokens is None and inc.api == "responses" and not render.may_render(svc, prefill_url):
        # P answered that it serves no render route (learned now, not asked again).
        return _verdict(found, extends.digest_verdict(prefix, found.reuse))
    reuse = extends.token_verdict(state, tokens, svc.settings.min_reuse_tokens)
    if not reuse.is_hit:
        return found.miss(_reason(reuse))
    # Only on a hit: /tokenize rendered D's own tokens of this conversation exactly, evidence
    # that it and P's chat route render it alike (a field that only the route honours, say
    # tool_choice "none" hiding the tools, shows up as a mismatch above).
    changes: dict[str, Any] = {"tokens": tokens}
    if _ids_leg(inc):
        changes["prompt_ids"] = tokens
    if reuse.tokens < state.token_count:
        changes["params"] = svc.connector.truncate(handle, reuse.tokens, state.block_size)
        changes["reuse"] = replace(reuse, found=found.reuse.found)
    return replace(found, **changes)  # one copy of the claim, whatever changed


def _verdict(found: Claim, reuse: Reuse) -> Claim:
    """The claim as the digests left it: its hit as claimed, or a miss."""
    return found if reuse.is_hit else found.miss(_reason(reuse))


def _reason(reuse: Reuse) -> Reason:
    assert reuse.reason is not None
    return reuse.reason
