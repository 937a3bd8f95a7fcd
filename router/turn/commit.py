"""The end of a turn: commit the conversation's next state after a normal finish, or give the
claim back; then one log line and the turn's metrics."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import replace
from typing import Any

from router.engines.versions import registration_generation
from router.tracing import span
from router.turn import ahead, aim, early, history, pins, responses_keep, worth
from router.turn.capture import Captured
from router.turn.decide import keep
from router.turn.incoming import Incoming
from router.turn.outcomes import Reason
from router.turn.state import Turn
from router.turn.tenant import conversation_hash
from sessions import digests, integrity
from sessions import model as sm
from sessions.store import StoreError
from sessions.vocabulary import AbortReason, CommitResult

log = logging.getLogger("kvbaton.turn")

NORMAL_FINISH = ("stop", "length")


async def finish(turn: Turn, captured: Captured) -> None:
    """Commit after a normal finish (stop/length, no error event); otherwise release. D's new
    handle ends in the committed state or in a release, whatever happens: the commit runs to
    its end even when the client leaves meanwhile (its outcome decides which)."""
    if captured.error is not None:
        await abort(turn, AbortReason.DECODE_ERROR_EVENT, captured)
        return
    if captured.finish_reason not in NORMAL_FINISH:
        await abort(turn, AbortReason.finish(captured.finish_reason), captured)
        return
    settle = asyncio.ensure_future(_settle(turn, captured))
    turn.svc.background.add(settle)  # awaited at shutdown, if the turn is cancelled first
    settle.add_done_callback(turn.svc.background.discard)
    await asyncio.shield(settle)


async def _settle(turn: Turn, captured: Captured) -> None:
    turn.settled = True
    pins.release_unread(turn, "superseded")
    if turn.svc.kv_events is not None:  # their streams should show this turn's blocks
        ran = (turn.prefill, turn.decode)
        turn.svc.kv_events.note_turn(*(i.url for i in ran if i is not None))
    result, kept = await _commit(turn, captured)
    if not kept:  # no state holds D's new handle: nobody else will ever release it
        pins.release_new(turn, captured, pins.unsaved_reason(result))
    if turn.inc.store:
        await responses_keep.keep(turn, captured)
    report(turn, result, captured)


async def abort(turn: Turn, reason: AbortReason | str, captured: Captured | None = None) -> None:
    """A failed or cancelled turn commits nothing; it only gives back its claim, and releases
    any handle it took or D gave it. `reason` is an `AbortReason` or one of its families'
    spellings (`AbortReason.engine(status)`, ...)."""
    if turn.settled:  # committed or released already (a bad event after D's last one)
        report(turn, f"aborted:{reason}", captured)
        return
    await release(turn)
    pins.release_unread(turn, "aborted")
    pins.release_new(turn, captured, "aborted")
    turn.svc.metrics.aborts.labels(reason).inc()
    report(turn, f"aborted:{reason}", captured)


async def release(turn: Turn) -> None:
    svc, key = turn.svc, turn.claim.key
    if key is None or not turn.claim.claimed:
        return
    with contextlib.suppress(StoreError):
        await svc.guard.call(lambda: svc.store.release(key, turn.request_id))


async def _commit(turn: Turn, captured: Captured) -> tuple[CommitResult, bool]:
    """The commit's result, and whether the stored state holds D's new handle."""
    key = turn.claim.key
    if key is None or turn.decode is None:
        return CommitResult.NO_CONVERSATION_ID, False
    owned = await aim.d_owns(turn.svc, turn.decode, captured.kv_transfer_params)
    state = next_state(turn, captured, d_owns=owned)
    expected = turn.claim.state.turn if turn.claim.state else 0
    svc = turn.svc
    ok = False
    note = pins.pin_note(turn, state)
    folded = note if svc.store.notes_pins_in_commit else None
    try:
        with span("kvbaton.commit"):
            ok = await svc.guard.call(
                lambda: svc.store.commit(key, state, expected, svc.settings.session_ttl, folded)
            )
    except StoreError:
        result = CommitResult.STORE_UNAVAILABLE
    else:
        # A lost race: another turn of this conversation committed first (compare-and-set).
        result = CommitResult.COMMITTED if ok else CommitResult.LOST_RACE
    svc.metrics.commits.labels(result).inc()
    if ok:
        turn.committed = state
    if ok and note is not None and folded is None:
        pins.note_committed(turn, note)
    # The next turn's P /tokenize goes out early only after a turn that left a handle.
    p_inst = turn.prefill
    ahead.remember(svc, key, state if ok else None)
    if ok and state.kv_transfer_params and p_inst is not None:
        kept = p_inst.reads.current(p_inst.ident.restarts).kept
        lacking = worth.lacking(state, p_inst.url, kept)
        early.remember(svc, key, p_inst.url, lacking, state.decode)
    else:
        early.remember(svc, key, None)
    if ok and turn.claim.history_id:
        await _index_history(turn, state, captured)
    if result is CommitResult.STORE_UNAVAILABLE and state.kv_transfer_params is not None:
        # The commit may have landed all the same (a timeout): the handle about to be
        # released must not be read from there, by any replica.
        pins.spend_later(turn, key, state)
    return result, ok and state.kv_transfer_params is not None


async def _index_history(turn: Turn, state: sm.SessionState, captured: Captured) -> None:
    """After the commit, not in it: on Redis Cluster the history key and the conversation's
    HASH are in other slots. The index is a hint; the claim checks the state's own digest."""
    svc = turn.svc
    entry = history.index_entry(turn.inc, turn.claim.history_id, state, captured.output_text)
    if entry is None:
        return
    key, value = entry
    try:
        await svc.guard.call(lambda: svc.store.index_history(key, value, svc.settings.session_ttl))
    except StoreError:
        log.warning("history index write failed: the next turn of this history will miss")


def next_state(turn: Turn, captured: Captured, *, d_owns: bool = True) -> sm.SessionState:
    svc, inc = turn.svc, turn.inc
    assert turn.decode is not None
    params = captured.kv_transfer_params
    handle = svc.connector.is_handle(params)  # validated once: a long handle has many blocks
    # A Responses stream always ends with D's handle (response.completed): it says nothing
    # about D's chat and completions streams.
    if inc.stream and inc.api != "responses" and handle:
        turn.decode.ident.note_streams_params()
    prev = turn.claim.state
    answered = keep.Answered(
        handle=handle,
        reuse_on=svc.settings.reuse,
        tool_calls=captured.tool_calls,
        stream=inc.stream,
        sent_ids=turn.prefill_ids,
        d_prompt_ids=captured.prompt_token_ids,
        token_ids_wanted=turn.want_token_ids,
        token_ids_needed=svc.settings.verify_prefix == "tokens" and inc.api != "responses",
        local=turn.prefill is None,
    )
    end = keep.ending(answered)
    if end.ids_differ:
        _switch_ids_leg_off(turn, captured)
    if end.keep_handle and not d_owns:  # it names a side channel D did not show it owns
        end = replace(end, keep_handle=False, reason=Reason.HANDLE_INVALID)
    token_ids: list[int] | None = None
    if turn.want_token_ids and captured.prompt_token_ids is not None:
        token_ids = [*captured.prompt_token_ids, *captured.output_token_ids]
    kept = params if end.keep_handle else None
    if kept is not None:
        turn.decode.ident.note_engine_id(svc.connector.engine_id(kept))
    if handle:  # kept or not, it says which registration D is on
        turn.decode.ident.note_registration(registration_generation(params))
    prompt_digest, prompt_len, prefix_digest, prefix_len = _digests(inc, captured)
    done = sm.Finished(
        api=inc.api,
        prefill=turn.prefill.url if turn.prefill else (prev.prefill if prev else ""),
        decode=turn.decode.url,
        decode_started=turn.decode.ident.handle_started,
        kv_transfer_params=kept,
        no_handle_reason=str(end.reason or ""),
        cache_tokens=end.reason in keep.CACHE_KEPT,
        prefix_digest=prefix_digest,
        prefix_len=prefix_len,
        prompt_digest=prompt_digest,
        prompt_len=prompt_len,
        token_ids=token_ids,
        prefill_rank=turn.ranks.get("prefill", prev.prefill_rank if prev else -1),
        decode_rank=turn.ranks.get("decode", -1),
        prefill_tokens=turn.prefill_tokens if turn.prefill else 0,
    )
    state = sm.next_state(
        prev,
        done,
        block_size=svc.block_size or turn.decode.block_size,
        now=svc.clock(),
        handle_ttl=svc.settings.handle_ttl,
    )
    assert turn.claim.key is not None
    return integrity.sign(svc.settings.session_secrets, turn.claim.key, state)


def _switch_ids_leg_off(turn: Turn, captured: Captured) -> None:
    """D rendered the prompt into other token ids than P's /tokenize gave, which P computed:
    D's KV for this turn may be wrong, and P must not get token ids again in this process."""
    sent, seen = turn.prefill_ids or [], captured.prompt_token_ids or []
    turn.svc.switch_ids_leg_off(
        f"{turn.decode.url if turn.decode else 'decode'} tokenized a prompt into "
        f"{len(seen)} ids, P's /tokenize into {len(sent)} that differ; check that both run "
        "the same model, tokenizer and chat template (--no-prefill-token-ids keeps this off)"
    )


def _digests(inc: Incoming, captured: Captured) -> tuple[str, int, str, int]:
    """Digests of the conversation as sent (prompt) and as D holds it (prompt + answer)."""
    if inc.api in ("chat", "responses"):
        answer: dict[str, Any] = {"role": "assistant", "content": captured.output_text}
        heads = inc.heads  # the prompt's, computed once per turn (claim, history, here)
        sent = digests.head_at(inc.api, heads, len(heads))
        return sent, len(heads), digests.next_head(inc.api, heads, answer), len(heads) + 1
    prompt = inc.prompt
    if not isinstance(prompt, str):
        return "", 0, "", 0
    text = prompt + captured.output_text
    return (sm.text_digest(inc.api, prompt), len(prompt), sm.text_digest(inc.api, text), len(text))


def report(turn: Turn, result: CommitResult | str, captured: Captured | None) -> None:
    """One INFO line per turn, without prompt content, handles or engine side channels."""
    now = time.monotonic()
    route = turn.inc.api
    turn.svc.metrics.e2e.labels(route).observe(now - turn.started)
    usage = (captured.usage if captured else None) or {}
    reuse = turn.claim.reuse
    fields: dict[str, Any] = {
        "request_id": turn.request_id,
        "conv": conversation_hash(turn.claim.key),
        "api": route,
        "stream": turn.inc.stream,
        "p": turn.prefill.url if turn.prefill else "-",
        "d": turn.decode.url if turn.decode else "-",
        "reuse": reuse.header(),
        "reused_tokens": reuse.tokens if reuse.is_hit else 0,
        "ttft_ms": round((turn.first_byte - turn.started) * 1000, 1) if turn.first_byte else "-",
        "e2e_ms": round((now - turn.started) * 1000, 1),
        "prompt_tokens": usage.get("prompt_tokens", usage.get("input_tokens", "-")),
        "completion_tokens": usage.get("completion_tokens", usage.get("output_tokens", "-")),
        "result": str(result),
    }
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    log.info("turn %s", text, extra={"turn": fields})
