"""The session store seam: the `SessionStore` protocol and `StoreError`."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

import msgspec

from sessions.model import UNKNOWN_SIZE, PinSize, PinTotals, SessionState, TurnTimes


class PinNote(msgspec.Struct, frozen=True):
    """A committed handle's entry in its D's pin index (`SessionStore.note_pin`): since
    wall-clock time `at`, pinning `size` there."""

    decode: str
    at: float
    size: PinSize = UNKNOWN_SIZE


class StoreError(Exception):
    """The session store is unreachable, too slow, or returned garbage."""


class StoreRefused(StoreError):
    """The store answers but refuses what the router asks of it (an ACL without scripting,
    scripts disabled): a configuration to fix, not an outage; /ready says so."""


class CorruptState(StoreError):
    """One conversation's stored state is not a state (a field that does not decode, a key of
    another type): that conversation's turn misses and the key is dropped; the store itself is
    fine, so this never opens the breaker for everyone else."""


class SessionStore(Protocol):
    """Per-conversation state keyed by `sessions.keys.conversation_key`; every change is atomic.

    Every method raises StoreError, never a backend exception, when the backend fails.
    """

    async def claim(
        self, key: str, request_id: str, expect_prefix: str = ""
    ) -> SessionState | None:
        """Read the state and take its handle, atomically; None when there is no state.

        Returns the state as it was (with its kv_transfer_params). When it had a handle, the
        stored copy loses it and records `inflight=request_id`; nothing else changes. Of two
        concurrent claims at most one gets the handle; the other sees `inflight` ("busy").
        With expect_prefix, the handle is taken only if the state's prefix_digest is that one
        (a session found by history that has moved on keeps its handle for its own next turn).

        A handle taken is spent: the store remembers it (under the conversation's key, until
        the state's `handle_expires_at`), and a state that names a spent handle again (a record
        older than the conversation: restored, or from a lagging replica) comes back without
        it, `no_handle_reason` "stale-handle" (`Reason.STALE_HANDLE`), in the store too.
        """
        ...

    @property
    def history_since(self) -> float:
        """Wall-clock time since when the store's history is unbroken: a handle committed
        before it (the Redis server restarted, was restored or failed over since) may have
        been read since, in a history the store lost. 0: nothing known against any."""
        ...

    async def spend(self, key: str, handle_id: str, until: float) -> None:
        """Remember handle `handle_id` (`sessions.codec.handle_id`) of conversation key as
        spent until `until`, and take it out of the state if the state holds it (then
        `no_handle_reason` "released"): for a handle released after a commit whose outcome is
        not known (it timed out)."""
        ...

    # Whether `commit(..., pin=...)` notes the pin in the commit's own round trip (False on
    # Redis Cluster, where D's pin index is in another slot: `note_pin` is a call of its own).
    notes_pins_in_commit: bool

    async def commit(
        self,
        key: str,
        state: SessionState,
        expected_turn: int,
        ttl_s: float,
        pin: PinNote | None = None,
    ) -> bool:
        """Replace the whole state iff the stored turn is expected_turn (0: no state yet).

        Sets the key's TTL to ttl_s. False when another turn committed first. With `pin`, a
        commit also notes key in D's pin index as `note_pin(pin.decode, key, pin.at, ttl_s,
        pin.size)` does (in the same atomic step where `notes_pins_in_commit`).
        """
        ...

    async def release(self, key: str, request_id: str) -> None:
        """Clear `inflight` if it still is request_id (the turn failed); no-op otherwise."""
        ...

    async def find_history(self, keys: Sequence[str]) -> list[str | None]:
        """The values of these history keys (`sessions.keys.history_key`), None where unset."""
        ...

    async def index_history(self, key: str, value: str, ttl_s: float) -> None:
        """Set a history key to value (`<prefix_len> <conversation_id>`) with a TTL."""
        ...

    async def get(self, key: str) -> SessionState | None:
        """The stored state, unchanged; None when there is none."""
        ...

    async def delete(self, key: str) -> bool:
        """Forget a conversation; True if there was a state."""
        ...

    async def end(self, key: str) -> SessionState | None:
        """The conversation ended: delete it and return its state as it was (handle included,
        for its release, and spent; a handle spent before is left out), atomically; None when
        there was none. A key that holds no state
        raises CorruptState, as `get` does, and is deleted all the same."""
        ...

    async def take_handle(self, key: str, not_after: float) -> SessionState | None:
        """Take the handle for release, atomically: only if the state has one, no turn holds it
        (`inflight` empty) and its `updated_at` <= not_after (math.inf: any age).

        Returns the state as it was (with its handle); the stored copy loses the handle as in
        `claim` and records `no_handle_reason` "released" (`Reason.RELEASED`); the handle is
        spent. Otherwise None, and nothing changes (a spent handle is cleared as `claim`
        clears it). Single use with `claim`: a handle is read or released, never both.
        A key of another type, or a hash that is not a state but looks as if it held a due
        handle, raises CorruptState (as `get` does) and is dropped (as by `claim`): its handle
        cannot be read to be released, D frees the blocks at its own TTL. Any other garbage
        hash is not due (None) and is left as it is for the conversation's next claim.
        """
        ...

    async def note_pin(
        self, decode: str, key: str, at: float, ttl_s: float, size: PinSize = UNKNOWN_SIZE
    ) -> None:
        """Record in `sessions.keys.pins_key(decode)` that conversation key holds a live handle
        on D since wall-clock time `at`, pinning `size` there (a newer note replaces both: the
        blocks of `size.held` are counted for key, its former ones no longer). The index's own
        expiry grows to at least ttl_s, so an index nobody notes into disappears."""
        ...

    async def forget_pin(self, decode: str, key: str, not_after: float = math.inf) -> None:
        """Remove key from D's pin index, its blocks no longer counted (no-op when absent),
        only if its entry's time is not after `not_after` (a sweep's due entry: a handle the
        conversation committed since keeps its entry)."""
        ...

    async def pins_due(self, decode: str, before: float, limit: int) -> list[tuple[str, float]]:
        """Up to limit (key, at) of D's index with at <= before, oldest first (ties by key).

        before=math.inf lists the oldest whatever their age (D short of memory); limit < 1: []."""
        ...

    async def pin_totals(self, decode: str) -> PinTotals:
        """How many conversations D's pin index holds; the distinct blocks their notes named
        (a block several name, once); their blocks and tokens summed note by note."""
        ...

    async def turn_times(self, keys: Sequence[str]) -> list[TurnTimes | None]:
        """Each conversation's turn, created_at and updated_at, in the order of keys, without
        touching its handle (one round trip; not atomic across keys). None where there is no
        state, or a key that does not hold one readably."""
        ...

    async def ping(self) -> None:
        """Return when the store is usable; raise StoreError otherwise."""
        ...

    async def close(self) -> None:
        """Release connections; the store is not used afterwards."""
        ...
