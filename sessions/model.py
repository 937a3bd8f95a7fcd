"""A conversation's session state and the rules that read and advance it (pure, no I/O).

Its Redis HASH encoding, readable with `redis-cli HGETALL`, is sessions/codec.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from sessions import digests
from sessions.digests import block_digests as block_digests
from sessions.digests import canonical_message as canonical_message
from sessions.digests import conversation_digest as conversation_digest
from sessions.digests import conversation_heads as conversation_heads
from sessions.digests import extend_block_digests, iter_block_digests
from sessions.digests import sequence_digest as sequence_digest
from sessions.digests import text_digest as text_digest
from sessions.vocabulary import Reason


class PinSize(msgspec.Struct, frozen=True):
    """What one handle pins on its D: blocks and tokens (0 and 0 when unknown), and which
    blocks (`held`: their names joined by spaces, each as the connector names one block of D,
    NIXL `<DP rank>:<block id>`; "" when unknown), so that a block several handles pin counts
    once."""

    blocks: int = 0
    tokens: int = 0
    held: str = ""


UNKNOWN_SIZE = PinSize()


class PinTotals(msgspec.Struct, frozen=True):
    """A D's pin index summed: the handles it lists; the distinct blocks they pin, as D counts
    them (a block shared by several handles, such as a common system prompt, once: a share of
    D's size); those handles' blocks summed (a shared block once per handle); their tokens
    summed (each handle's remote_num_tokens)."""

    handles: int = 0
    blocks: int = 0
    handle_blocks: int = 0
    tokens: int = 0


class TurnTimes(msgspec.Struct, frozen=True):
    """A conversation's pace as its state records it: its committed turns, and when the first
    and the last were committed (`SessionStore.turn_times`: the pressure release's order)."""

    turn: int = 0
    created_at: float = 0.0
    updated_at: float = 0.0

    def cadence(self) -> float | None:
        """The mean time between its commits; None before its second turn (or unrecorded)."""
        if self.turn < 2 or self.created_at <= 0 or self.updated_at < self.created_at:
            return None
        return (self.updated_at - self.created_at) / (self.turn - 1)


class SessionState(msgspec.Struct, frozen=True, kw_only=True):
    """What the router remembers about one conversation between turns."""

    turn: int = 0  # committed turns so far
    api: str = ""  # "chat" | "completions" | "responses": the API that produced the handle
    prefill: str = ""  # affinity: base URL of the P instance of the last committed turn
    decode: str = ""  # affinity: base URL of the D instance of the last committed turn
    decode_engine_id: str = ""  # remote_engine_id in D's handle
    decode_started: float = 0.0  # D's process start time when the handle was made (0: unknown)
    kv_transfer_params: dict[str, Any] | None = None  # D's handle (single use); None = none usable
    no_handle_reason: str = ""  # why the last turn left no handle: a `Reason`, as stored
    prefix_digest: str = ""  # digest chain head over the canonical conversation D holds
    prefix_len: int = 0  # items or characters (completions) that prefix_digest covers
    prompt_digest: str = ""  # the same chain over the last turn's prompt only (without D's answer)
    prompt_len: int = 0  # items or characters that prompt_digest covers
    token_count: int = 0  # tokens D holds KV for (the handle's remote_num_tokens)
    block_size: int = 0
    block_digests: tuple[str, ...] = ()  # chained digest per full block of D's first tokens
    seq_digest: str = ""  # digest of D's whole first token_count tokens
    handle_expires_at: float = 0.0  # wall-clock deadline of the handle (router clock)
    created_at: float = 0.0
    updated_at: float = 0.0
    inflight: str = ""  # request id of the turn that claimed the handle; "" when none
    mac: str = ""  # HMAC of what the next turn trusts (sessions/integrity.py); "" unsigned
    # The data-parallel ranks (X-data-parallel-rank) the last turn ran on; -1: none chosen
    # (engines without internal data parallelism, or sessions stored before these fields).
    prefill_rank: int = -1
    decode_rank: int = -1
    # Prompt tokens the last turn's P computed or found cached (its prompt: P's prefix cache
    # holds its full blocks afterwards, unless it evicted them); 0: no P leg, or not known.
    prefill_tokens: int = 0


def prefix_extends(
    state: SessionState,
    api: str,
    items: Sequence[Any] | None = None,
    text: str | None = None,
    heads: Sequence[str] | None = None,
) -> bool:
    """True iff the request strictly extends the canonical conversation D holds.

    An edited history, a regenerated turn or a changed system prompt all fail here (vllm#43094:
    P trusts that its prompt starts with D's tokens and never checks).
    """
    if state.api != api or not state.prefix_digest:
        return False
    n = state.prefix_len
    if items is not None:
        if heads is not None:  # the items' conversation_heads, already computed
            return len(items) > n and digests.head_at(api, heads, n) == state.prefix_digest
        return len(items) > n and conversation_digest(api, items[:n]) == state.prefix_digest
    if text is not None:
        return len(text) > n and text_digest(api, text[:n]) == state.prefix_digest
    return False


def verified_tokens(state: SessionState, token_ids: Sequence[int]) -> int:
    """How many leading tokens of the new prompt are verified equal to D's and may be read.

    The whole of D's sequence when it matches and the prompt is longer; otherwise the longest
    matching run of full blocks, leaving at least one token (rounded to a block) for the reader.
    """
    size = state.block_size
    n = len(token_ids)
    if size <= 0 or n == 0:
        return 0
    held = state.token_count
    if state.seq_digest and 0 < held < n and sequence_digest(token_ids[:held]) == state.seq_digest:
        return held
    limit = min(len(state.block_digests), (n - 1) // size)
    matched = 0
    ours = iter_block_digests(token_ids, size, limit)
    for got, want in zip(ours, state.block_digests[:limit], strict=True):
        if got != want:
            break
        matched += 1
    return matched * size


def handle_unusable_reason(state: SessionState | None, api: str, now: float) -> Reason | None:
    """None when the state's handle may be sent to P, else the reason for `X-KV-Reuse: miss`."""
    if state is None:
        return Reason.NO_SESSION
    if not state.kv_transfer_params:
        if state.inflight:
            return Reason.BUSY
        if state.no_handle_reason:
            return Reason.stored(state.no_handle_reason)  # unknown: a named reason, no error
        return Reason.NO_HANDLE
    if state.api != api:
        return Reason.API_MISMATCH
    if now >= state.handle_expires_at:
        return Reason.EXPIRED
    return None


_JSON = msgspec.json.Encoder()
_DECODE = msgspec.json.Decoder().decode


def _remote_num_tokens(params: Mapping[str, Any] | None) -> int:
    raw = params.get("remote_num_tokens") if params else None
    if isinstance(raw, int) and not isinstance(raw, bool) and raw > 0:
        return raw
    return 0


def _sequence_digests(
    prev: SessionState | None, token_ids: Sequence[int], block_size: int
) -> tuple[str, tuple[str, ...]]:
    """D's new sequence's digest and its block digests. Where the sequence starts with the
    previous turn's (the digest of its first prev.token_count tokens is prev's, taken in the
    same pass as the whole one's), those blocks' digests are prev's and only the new blocks
    are hashed (a 300-token prompt's digests 5 us against 19)."""
    if not (
        prev is not None
        and prev.block_digests
        and prev.block_size == block_size
        and prev.seq_digest
        and 0 < prev.token_count <= len(token_ids)
    ):
        return sequence_digest(token_ids), block_digests(token_ids, block_size)
    shared, seq = digests.sequence_digests(token_ids, prev.token_count)
    if shared == prev.seq_digest:
        with contextlib.suppress(ValueError):  # a stored digest that is not hex
            known = prev.block_digests[: prev.token_count // block_size]
            return seq, extend_block_digests(known, token_ids, block_size)
    return seq, block_digests(token_ids, block_size)


class Finished(msgspec.Struct, frozen=True, kw_only=True):
    """What a turn that finished normally tells its next state: where it ran, D's handle (or
    why it kept none), the conversation's digests and D's token ids."""

    api: str  # "chat" | "completions" | "responses"
    prefill: str  # base URL of the P it ran on (the previous one's on a turn without P)
    decode: str  # base URL of the D it ran on
    decode_started: float = 0.0  # D's process start time (0: unknown)
    kv_transfer_params: dict[str, Any] | None  # D's handle to keep; None: none kept
    no_handle_reason: str  # why none was kept: a `Reason`, as stored ("" with a handle)
    # Without a handle, D's prefix cache still holds the turn's sequence (all but the last
    # token, which has no KV yet): its digests are kept for the decode plan.
    cache_tokens: bool = False
    prefix_digest: str  # the conversation D holds (prompt + answer): its chain head ...
    prefix_len: int  # ... and the items or characters it covers
    prompt_digest: str = ""  # the same over the prompt alone
    prompt_len: int = 0
    token_ids: Sequence[int] | None  # D's prompt and answer as token ids (None: not asked)
    prefill_rank: int = -1  # the data-parallel ranks it ran on (-1: none chosen)
    decode_rank: int = -1
    prefill_tokens: int = 0  # prompt tokens P computed or found cached (0: no P leg)


def next_state(
    prev: SessionState | None,
    done: Finished,
    *,
    block_size: int,
    now: float,
    handle_ttl: float,
) -> SessionState:
    """The state after a turn that finished normally (the caller commits it with CAS): its
    block digests cut by `block_size`, its handle usable for `handle_ttl` from `now`."""
    # A copy the caller cannot change (JSON values: a round trip in C, ~8x a deepcopy).
    handle = done.kv_transfer_params
    params = _DECODE(_JSON.encode(handle)) if handle else None
    held = _remote_num_tokens(params)
    token_ids = done.token_ids
    if not params and done.cache_tokens and token_ids:
        held = len(token_ids) - 1
    blocks: tuple[str, ...] = ()
    seq = ""
    if token_ids is not None and held and len(token_ids) >= held:
        seq, blocks = _sequence_digests(prev, token_ids[:held], block_size)
    return SessionState(
        turn=(prev.turn if prev else 0) + 1,
        api=done.api,
        prefill=done.prefill,
        decode=done.decode,
        decode_engine_id=str(params.get("remote_engine_id") or "") if params else "",
        decode_started=done.decode_started if held else 0.0,
        kv_transfer_params=params,
        no_handle_reason="" if params else done.no_handle_reason,
        prefix_digest=done.prefix_digest,
        prefix_len=done.prefix_len,
        prompt_digest=done.prompt_digest,
        prompt_len=done.prompt_len,
        token_count=held,
        block_size=block_size,
        block_digests=blocks,
        seq_digest=seq,
        handle_expires_at=now + handle_ttl if params else 0.0,
        created_at=prev.created_at if prev else now,
        updated_at=now,
        inflight="",
        prefill_rank=done.prefill_rank,
        decode_rank=done.decode_rank,
        prefill_tokens=done.prefill_tokens,
    )
