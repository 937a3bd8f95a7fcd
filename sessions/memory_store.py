"""The in-process session store, for a single replica without Redis (`--session-store memory`).

Same semantics as the Redis store, TTLs and pin indexes included, expired lazily by a clock.
"""

from __future__ import annotations

import copy
import heapq
import math
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence

import msgspec

from sessions.codec import handle_id
from sessions.keys import pins_key
from sessions.model import UNKNOWN_SIZE, PinSize, PinTotals, SessionState, TurnTimes
from sessions.store import PinNote, StoreError
from sessions.vocabulary import Reason


def _detached(state: SessionState) -> SessionState:
    """A copy that shares no mutable dict with the caller (Redis copies by serialising)."""
    if state.kv_transfer_params is None:
        return state
    return msgspec.structs.replace(
        state, kv_transfer_params=copy.deepcopy(state.kv_transfer_params)
    )


class MemorySessionStore:
    """SessionStore in a dict; at most max_entries, the least recently committed evicted first.

    Every method runs without awaiting, so each is atomic on the event loop.
    """

    def __init__(
        self, clock: Callable[[], float] = time.time, *, max_entries: int = 100_000
    ) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be at least 1")
        self._clock = clock
        self._max_entries = max_entries
        self._entries: OrderedDict[str, tuple[SessionState, float]] = OrderedDict()
        # History keys: value and deadline, evicted like the sessions they name.
        self._history: OrderedDict[str, tuple[str, float]] = OrderedDict()
        # Pin indexes: decode URL -> ({conversation key: since}, deadline of the index), what
        # each conversation's handle pins (decode URL -> {conversation key: size}), and how
        # many of them pin each block (decode URL -> {block name: handles}).
        self._pins: dict[str, tuple[dict[str, float], float]] = {}
        self._pin_sizes: dict[str, dict[str, PinSize]] = {}
        # Spent handles per conversation key: handle digest -> until when (as in Redis).
        self._spent: dict[str, dict[str, float]] = {}
        self._pin_blocks: dict[str, Counter[str]] = {}
        self._closed = False

    # The process's own memory cannot be restored behind its back.
    history_since = 0.0

    def __len__(self) -> int:
        return len(self._entries)

    def live_entries(self) -> dict[str, tuple[SessionState, float]]:
        """Every unexpired entry: key -> (state, seconds left). For admin listings."""
        now = self._clock()
        return {k: (v[0], v[1] - now) for k, v in self._entries.items() if v[1] > now}

    def _live(self, key: str) -> SessionState | None:
        if self._closed:
            raise StoreError("session store is closed")
        entry = self._entries.get(key)
        if entry is None:
            return None
        state, expires_at = entry
        if self._clock() >= expires_at:
            del self._entries[key]
            return None
        return state

    def _replace(self, key: str, state: SessionState) -> None:
        """Change a live entry's state, keeping its deadline and place in the eviction order."""
        self._entries[key] = (state, self._entries[key][1])

    async def claim(
        self, key: str, request_id: str, expect_prefix: str = ""
    ) -> SessionState | None:
        state = self._live(key)
        if state is None:
            return None
        if expect_prefix and state.prefix_digest != expect_prefix:
            return _detached(state)
        if state.kv_transfer_params:
            if self._refused(key, state):
                return self._live(key)
            taken = msgspec.structs.replace(state, kv_transfer_params=None, inflight=request_id)
            self._replace(key, taken)
            self._spend_state(key, state)
        return state

    def _is_spent(self, key: str, hid: str) -> bool:
        return self._spent.get(key, {}).get(hid, 0.0) > self._clock()

    def _refused(self, key: str, state: SessionState) -> bool:
        """A spent handle still in the state is cleared, its reason stale-handle."""
        assert state.kv_transfer_params is not None
        if not self._is_spent(key, handle_id(state.kv_transfer_params)):
            return False
        reason = str(Reason.STALE_HANDLE)
        stale = msgspec.structs.replace(state, kv_transfer_params=None, no_handle_reason=reason)
        self._replace(key, stale)
        return True

    def _spend_state(self, key: str, state: SessionState) -> None:
        assert state.kv_transfer_params is not None
        now = self._clock()
        until = state.handle_expires_at
        if not now < until < now + 86400:  # as the Redis scripts: past, NaN or absurd
            until = now + 900
        self._add_spent(key, handle_id(state.kv_transfer_params), until)

    def _add_spent(self, key: str, hid: str, until: float) -> None:
        now = self._clock()
        spent = {h: t for h, t in self._spent.get(key, {}).items() if t > now}
        spent[hid] = until
        self._spent[key] = spent
        if len(self._spent) > self._max_entries:
            self._spent.pop(next(iter(self._spent)))

    async def spend(self, key: str, handle_id_: str, until: float) -> None:
        self._check_open()
        self._add_spent(key, handle_id_, until)
        state = self._live(key)
        params = state.kv_transfer_params if state is not None else None
        if state is not None and params and handle_id(params) == handle_id_:
            released = msgspec.structs.replace(
                state, kv_transfer_params=None, no_handle_reason=str(Reason.RELEASED)
            )
            self._replace(key, released)

    notes_pins_in_commit = True

    async def commit(
        self,
        key: str,
        state: SessionState,
        expected_turn: int,
        ttl_s: float,
        pin: PinNote | None = None,
    ) -> bool:
        current = self._live(key)
        if (current.turn if current else 0) != expected_turn:
            return False
        self._entries[key] = (_detached(state), self._clock() + max(ttl_s, 0.001))
        self._entries.move_to_end(key)
        while len(self._entries) > self._max_entries:
            self._entries.popitem(last=False)
        if pin is not None:
            await self.note_pin(pin.decode, key, pin.at, ttl_s, pin.size)
        return True

    async def release(self, key: str, request_id: str) -> None:
        state = self._live(key)
        if state is not None and state.inflight == request_id:
            self._replace(key, msgspec.structs.replace(state, inflight=""))

    async def take_handle(self, key: str, not_after: float) -> SessionState | None:
        state = self._live(key)
        if state is None or not state.kv_transfer_params or state.inflight:
            return None
        if state.updated_at > not_after or self._refused(key, state):
            return None
        reason = str(Reason.RELEASED)
        self._replace(
            key, msgspec.structs.replace(state, kv_transfer_params=None, no_handle_reason=reason)
        )
        self._spend_state(key, state)
        return state

    async def end(self, key: str) -> SessionState | None:
        state = self._live(key)
        if state is None:
            return None
        del self._entries[key]
        if state.kv_transfer_params:
            if self._is_spent(key, handle_id(state.kv_transfer_params)):
                return msgspec.structs.replace(state, kv_transfer_params=None)
            self._spend_state(key, state)
        return state

    def _pin_index(self, decode: str) -> dict[str, float] | None:
        """D's live index; None when it has none (never noted, emptied, or expired)."""
        self._check_open()
        pins_key(decode)  # the Redis store's ValueError for a URL it cannot name a key after
        entry = self._pins.get(decode)
        if entry is not None and self._clock() >= entry[1]:
            self._drop_pins(decode)
            return None
        return None if entry is None else entry[0]

    def _drop_pins(self, decode: str) -> None:
        self._pins.pop(decode, None)
        self._pin_sizes.pop(decode, None)
        self._pin_blocks.pop(decode, None)

    def _hold(self, decode: str, key: str, size: PinSize | None) -> None:
        """key's handle now pins size (None: nothing); its former blocks' counts go down."""
        sizes = self._pin_sizes.setdefault(decode, {})
        counts = self._pin_blocks.setdefault(decode, Counter())
        old = sizes.pop(key, None)
        if size is not None:
            sizes[key] = size
            counts.update(size.held.split())
        if old is not None:
            gone = old.held.split()
            counts.subtract(gone)
            for name in gone:
                if counts.get(name, 0) <= 0:
                    counts.pop(name, None)

    async def note_pin(
        self, decode: str, key: str, at: float, ttl_s: float, size: PinSize = UNKNOWN_SIZE
    ) -> None:
        index = self._pin_index(decode)
        deadline = self._clock() + max(ttl_s, 0.001)
        if index is None:
            index = {}
        else:
            deadline = max(deadline, self._pins[decode][1])  # the expiry only grows
        index[key] = at
        self._hold(decode, key, size)
        self._pins[decode] = (index, deadline)
        if len(index) > self._max_entries:  # the oldest pin goes, as a state would
            oldest = min(index, key=index.__getitem__)
            del index[oldest]
            self._hold(decode, oldest, None)

    async def forget_pin(self, decode: str, key: str, not_after: float = math.inf) -> None:
        index = self._pin_index(decode)
        if index is not None and index.get(key, -math.inf) <= not_after:
            index.pop(key, None)
            self._hold(decode, key, None)
            if not index:  # as Redis deletes an empty ZSET (its expiry with it)
                self._drop_pins(decode)

    async def pins_due(self, decode: str, before: float, limit: int) -> list[tuple[str, float]]:
        index = self._pin_index(decode)
        if index is None or limit < 1:
            return []
        due = heapq.nsmallest(limit, ((at, k) for k, at in index.items() if at <= before))
        return [(k, at) for at, k in due]

    async def pin_totals(self, decode: str) -> PinTotals:
        index = self._pin_index(decode)
        if index is None:
            return PinTotals()
        sizes = self._pin_sizes.get(decode, {}).values()
        return PinTotals(
            len(index),
            len(self._pin_blocks.get(decode, ())),
            sum(s.blocks for s in sizes),
            sum(s.tokens for s in sizes),
        )

    async def turn_times(self, keys: Sequence[str]) -> list[TurnTimes | None]:
        states = [self._live(key) for key in keys]
        return [
            None if s is None else TurnTimes(s.turn, s.created_at, s.updated_at) for s in states
        ]

    async def find_history(self, keys: Sequence[str]) -> list[str | None]:
        self._check_open()
        now = self._clock()
        found: list[str | None] = []
        for key in keys:
            entry = self._history.get(key)
            found.append(entry[0] if entry is not None and entry[1] > now else None)
        return found

    async def index_history(self, key: str, value: str, ttl_s: float) -> None:
        self._check_open()
        self._history[key] = (value, self._clock() + max(ttl_s, 0.001))
        self._history.move_to_end(key)
        while len(self._history) > self._max_entries:
            self._history.popitem(last=False)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError("session store is closed")

    async def get(self, key: str) -> SessionState | None:
        state = self._live(key)
        return None if state is None else _detached(state)

    async def delete(self, key: str) -> bool:
        found = self._live(key) is not None
        if found:
            del self._entries[key]
        return found

    async def ping(self) -> None:
        if self._closed:
            raise StoreError("session store is closed")

    async def close(self) -> None:
        self._closed = True
        self._entries.clear()
        self._history.clear()
        self._pins.clear()
        self._pin_sizes.clear()
        self._spent.clear()
        self._pin_blocks.clear()
