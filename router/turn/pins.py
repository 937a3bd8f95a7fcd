"""The turn's part in D's memory: a handle it took and no P read is released when the turn
ends, a handle it leaves is noted in the store's pin index (for the idle and pressure
releases, router/lifecycle/pin_sweep.py), and the time since the conversation's last turn is
measured (the release delay's base)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging

from router.services import Services
from router.turn.aim import aims_at_its_d
from router.turn.capture import Captured
from router.turn.decide import sendable
from router.turn.state import Turn
from sessions.codec import handle_id
from sessions.model import SessionState
from sessions.store import PinNote, StoreError
from sessions.vocabulary import CommitResult

log = logging.getLogger("kvbaton.pins")


def measure_gap(turn: Turn) -> None:
    """A continued conversation: how long after its last commit this turn came."""
    state = turn.claim.state
    if state is not None and state.updated_at > 0:
        gap = turn.svc.clock() - state.updated_at
        turn.svc.gaps.note(gap)
        turn.svc.metrics.inter_turn.observe(max(gap, 0.0))


def release_unread(turn: Turn, reason: str) -> None:
    """The handle this turn took from the store and did not send to any P is dead (nobody
    else can claim it): release it, unless the P leg may have read it."""
    svc, claim = turn.svc, turn.claim
    if svc.releaser is None or claim.taken is None or turn.handle_sent or claim.state is None:
        return
    if not sendable.releasable(claim.reuse.reason):  # the turn's verdict, as it ended
        return
    # Its entry in the pin index stays until a sweep finds no handle there (or a commit on
    # the same D replaces it): a removal racing this turn's own note could drop the new one.
    svc.releaser.submit(claim.taken, claim.state.decode, reason)


def unsaved_reason(result: CommitResult) -> str:
    """Why no committed state holds D's new handle (`kvbaton_pin_releases_total{reason}`)."""
    if result is CommitResult.STORE_UNAVAILABLE:
        return "unsaved"  # the store failed or timed out
    if result is CommitResult.LOST_RACE:
        return "lost-race"  # another turn of the conversation committed first
    return "unkept"  # committed without it (not verifiable next turn), or no conversation


def release_new(turn: Turn, captured: Captured | None, reason: str) -> None:
    """D's handle from this turn, which no committed state holds, is dead the moment the turn
    ends (nobody else knows it): released at once, without the store, and spent here."""
    svc = turn.svc
    params = captured.kv_transfer_params if captured is not None else None
    if svc.releaser is None or turn.decode is None or not svc.connector.is_handle(params):
        return
    assert params is not None  # is_handle said so
    origin = svc.connector.origin(params)
    if origin is None or not turn.decode.ident.admit(origin):
        return  # a release would send P to a side channel D did not show it owns
    svc.releaser.submit(params, turn.decode.url, reason)  # spent from now on


def spend_later(turn: Turn, key: str, state: SessionState) -> None:
    """A commit whose outcome is not known may have stored the handle it carried, which the
    turn then releases: once the store answers, it is marked spent there too, so that no
    replica reads it (this one knows already)."""
    svc = turn.svc  # this process marks it spent as it releases it (Releaser.submit)
    assert state.kv_transfer_params is not None
    svc.unspent.append((key, handle_id(state.kv_transfer_params), state.handle_expires_at))
    if not svc.flushing:
        svc.flushing = True
        svc.spawn(_flush_unspent(svc))


async def _flush_unspent(svc: Services) -> None:
    delay = 0.25
    try:
        while svc.unspent and not svc.stopping:
            await asyncio.sleep(delay)
            delay = min(2 * delay, 4.0)
            while svc.unspent:
                key, hid, until = svc.unspent[0]
                if until > svc.clock():
                    try:
                        await svc.guard.call(functools.partial(svc.store.spend, key, hid, until))
                    except StoreError:
                        break  # not yet: the next try is later
                svc.unspent.popleft()
    finally:
        svc.flushing = False


def pin_note(turn: Turn, state: SessionState) -> PinNote | None:
    """The pin index entry of a state about to be committed with a handle (None without one,
    or without releases). The store writes it in the commit's own round trip where it can
    (`notes_pins_in_commit`); otherwise `note_committed` writes it after the commit."""
    svc = turn.svc
    if svc.releaser is None or turn.claim.key is None or state.kv_transfer_params is None:
        return None
    return PinNote(state.decode, state.updated_at, svc.connector.pinned(state.kv_transfer_params))


def note_committed(turn: Turn, note: PinNote) -> None:
    """After a commit that left a handle, on a store that could not note it in the commit
    (Redis Cluster): index it under its D, off the turn's path."""
    svc, key = turn.svc, turn.claim.key
    if key is not None:
        svc.spawn(_note(turn, key, note))


async def _note(turn: Turn, key: str, note: PinNote) -> None:
    svc = turn.svc
    ttl = svc.settings.session_ttl
    try:
        await svc.guard.call(lambda: svc.store.note_pin(note.decode, key, note.at, ttl, note.size))
    except StoreError as exc:
        # The handle is then freed by D's own TTL, or released when a later turn takes it.
        log.warning("pin index write failed: %s", exc)


async def end(svc: Services, key: str) -> SessionState | None:
    """The conversation ended (a client's or the admin's delete): forget it, and release its
    handle at once (nobody can read it any more). Its state as it was; None if there was none.
    Raises StoreError."""
    state = await svc.guard.call(lambda: svc.store.end(key))
    if state is None:
        return None
    if svc.releaser is not None and not state.inflight and aims_at_its_d(svc, key, state):
        svc.releaser.submit(state.kv_transfer_params, state.decode, "ended")
    if state.decode:
        decode = state.decode
        svc.spawn(_forget(svc, decode, key))
    return state


async def _forget(svc: Services, decode: str, key: str) -> None:
    with contextlib.suppress(StoreError):
        await svc.guard.call(lambda: svc.store.forget_pin(decode, key))


async def release_turn(svc: Services, key: str, turn: int) -> bool:
    """Release the conversation's handle if turn `turn` committed it and no turn has read or
    replaced it since (a deleted response's handle: nothing else continues it). Whether one
    was released. Raises StoreError."""
    state = await svc.guard.call(lambda: svc.store.get(key))
    if state is None or state.turn != turn or state.kv_transfer_params is None or state.inflight:
        return False
    not_after = state.updated_at  # a commit since would be later: then nothing is taken
    taken = await svc.guard.call(lambda: svc.store.take_handle(key, not_after))
    if taken is None or taken.kv_transfer_params is None:
        return False
    if svc.releaser is not None and aims_at_its_d(svc, key, taken):
        svc.releaser.submit(taken.kv_transfer_params, taken.decode, "ended")
    svc.spawn(_forget(svc, taken.decode, key))
    return True
