"""The turn's decision core: pure functions of data that return decisions as data.

Which handle may be sent, whether the new prompt extends what D holds, what to do after each
P attempt and after a failed D, whether the turn keeps D's new handle. No I/O, no logging, no
metrics: the turn's steps and the connectors' legs (connectors/legs/) apply what these return.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import Enum, StrEnum
from typing import Any, Protocol

import msgspec

from router.engines.identity import engine_family
from router.engines.pool import Instance
from router.engines.versions import registration_generation
from router.turn.outcomes import Reason, Reuse, Via
from sessions import model as sm
from sessions.model import SessionState

# A failed D before its first byte is redone once, on another D if there is one.
DECODE_ATTEMPTS = 2


def claimed_reuse(
    state: SessionState | None, api: str, now: float, decode: Instance | None
) -> Reuse:
    """What a claimed state allows: a hit on its handle, or the reason it may not be sent."""
    unusable = sm.handle_unusable_reason(state, api, now)
    if unusable is not None:
        return Reuse.miss(unusable)
    assert state is not None
    blocker = decode_blocker(decode, state)
    if blocker is not None:
        return Reuse.miss(blocker)
    return Reuse.hit(state.token_count)


def decode_blocker(inst: Instance | None, state: SessionState) -> Reason | None:
    """Why a handle naming that D must not reach P (None: it may)."""
    if inst is None:
        return Reason.DECODE_REMOVED  # the router no longer routes to it
    if not inst.healthy:
        return Reason.DECODE_UNHEALTHY
    # D restarted since this handle was made: its blocks and engine id are gone, and a read
    # would fail (kv_load_failure_policy=fail) or, worse, hang on a handshake. The health loop
    # sees a new process start time within one interval; a handle captured since shows a new
    # engine id.
    if inst.ident.restarted_since(state.decode_started, state.decode_engine_id):
        return Reason.DECODE_RESTARTED
    if inst.ident.unreachable:  # maybe restarting: nothing says its blocks are still its own
        return Reason.DECODE_UNREACHABLE
    # vLLM 0.33: D re-registered its KV (a sleep) since; the handle's block ids are the old
    # registration's, and a P that handshakes afresh would read whatever they hold now.
    # A handle without one (0.32's, or a malformed one: handle_check's) is judged by time.
    generation = registration_generation(state.kv_transfer_params)
    if inst.ident.registration_changed(generation, state.updated_at):
        return Reason.REGISTRATION_CHANGED
    return None


class HandleReader(Protocol):
    """What the handle check asks of the connector (connectors/base.py's `Connector` is one)."""

    def is_handle(self, params: object) -> bool: ...
    def engine_id(self, params: Mapping[str, Any]) -> str | None: ...


def handle_check(connector: HandleReader, state: SessionState) -> Reason | None:
    """The router's own checks of a stored handle before it may reach P: the state is read
    back from Redis, so it is checked as if a client had sent it (None: it passes)."""
    params = state.kv_transfer_params
    if params is None or not connector.is_handle(params):
        return Reason.HANDLE_INVALID
    if params.get("remote_num_tokens") != state.token_count or state.token_count <= 0:
        return Reason.HANDLE_INVALID
    if engine_family(connector.engine_id(params) or "") != engine_family(state.decode_engine_id):
        return Reason.HANDLE_INVALID
    groups = params.get("remote_block_ids")
    if state.block_size > 0 and isinstance(groups, list):
        need = -(-state.token_count // state.block_size)
        # Full-attention groups hold exactly the blocks of those tokens (vLLM may have given
        # the last, not yet computed token a block of its own); sliding-window ones fewer.
        longest = max((len(g) for g in groups if isinstance(g, list)), default=0)
        if not need <= longest <= need + 1:
            return Reason.HANDLE_INVALID
    return None


# A taken handle that must not go to a P even to be released: one the router cannot trust
# (tampered with: it could aim P at any address), spent before (read or released already),
# whose D no longer holds it, or whose D the P's have been refusing (a release through them
# would fail the same way).
NOT_RELEASABLE = frozenset(
    {
        Reason.READS_PAUSED,
        Reason.HANDLE_UNAUTHENTICATED,
        Reason.HANDLE_INVALID,
        Reason.STALE_HANDLE,
        Reason.DECODE_REMOVED,
        Reason.DECODE_UNHEALTHY,
        Reason.DECODE_RESTARTED,
        Reason.DECODE_UNREACHABLE,
        Reason.REGISTRATION_CHANGED,
    }
)


def releasable(reason: Reason | None) -> bool:
    """Whether a handle the claim took may be released (sent to a P that reads nothing)."""
    return reason not in NOT_RELEASABLE


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


def cached_reuse(verified: Reuse, block_size: int, *, p_held: int, d_evicted: bool) -> Reuse:
    """A verified hit seen with the engines' KV events: if the chosen P already holds every
    full block of the verified prefix (`p_held` tokens), no handle is sent (a read would
    bring P nothing); else a handle whose blocks D evicted or cleared is dropped."""
    if not verified.pulls:
        return verified
    covered = verified.tokens // block_size * block_size if block_size > 0 else 0
    if covered > 0 and p_held >= covered:
        return replace(verified, via=Via.PREFILL_CACHE)  # how it was found stays
    if d_evicted:
        return Reuse.miss(Reason.EVICTED)
    return verified


def prefix_placement(
    held: Sequence[tuple[Instance, int]], current: Instance, slack: int
) -> Instance:
    """The P holding the longest prefix of the prompt (`held`: usable P and the tokens each
    holds), among those within `slack` requests of the least loaded; `current` (the load and
    affinity pick) unless another holds more."""
    if not held:
        return current
    least = min(inst.outstanding for inst, _ in held)
    fit = [(inst, n) for inst, n in held if inst.outstanding <= least + slack]
    mine = next((n for inst, n in fit if inst is current), -1)
    best, most = max(fit, key=lambda pair: pair[1])
    return best if most > max(mine, 0) else current


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
        reason = Reason.DECODE_LOCAL  # D got no params, so vLLM gives none back
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
