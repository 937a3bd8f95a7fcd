"""The handles this process saw read or released ("spent"): a state that still names one is
older than the conversation (a lagging replica, a restore), and D may have reused its blocks,
so it is never sent to a P again (issue 48; a handle is read at most once)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

from sessions.codec import handle_id

# Handles remembered at once: ~150 bytes each, and 131,072 is 290 turns a second for a whole
# handle TTL (450 s). Past it the oldest go first; the store's own spent keys remain.
MAX_SPENT = 131_072


class Spent:
    """Handle digests (`sessions.codec.handle_id`) with the time until which D could still pin
    them: `ttl` seconds after they were spent (the handle TTL: a handle older than that is
    refused anyway)."""

    def __init__(
        self, ttl: float, clock: Callable[[], float], *, max_entries: int = MAX_SPENT
    ) -> None:
        self._ttl = ttl
        self._clock = clock
        self._max = max_entries
        self._until: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._until)

    def add(self, params: Mapping[str, Any] | None) -> str:
        """Remember a handle as spent; its digest ("" for no handle)."""
        if not params:
            return ""
        hid = handle_id(params)
        self.add_id(hid)
        return hid

    def add_id(self, hid: str) -> None:
        now = self._clock()
        self._until[hid] = now + self._ttl
        self._until.move_to_end(hid)
        while len(self._until) > self._max:
            self._until.popitem(last=False)
        for _ in range(2):  # the oldest first: those past their time go as new ones come
            old = next(iter(self._until))
            if self._until[old] > now:
                break
            del self._until[old]

    def holds(self, hid: str) -> bool:
        """Whether the handle with this digest was read or released here, while D could still
        pin it."""
        until = self._until.get(hid)
        return until is not None and until > self._clock()
