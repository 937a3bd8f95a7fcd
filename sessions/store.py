"""The session store seam: the `SessionStore` protocol and `StoreError`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from sessions.model import SessionState


class StoreError(Exception):
    """The session store is unreachable, too slow, or returned garbage."""


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
        """
        ...

    async def commit(self, key: str, state: SessionState, expected_turn: int, ttl_s: float) -> bool:
        """Replace the whole state iff the stored turn is expected_turn (0: no state yet).

        Sets the key's TTL to ttl_s. False when another turn committed first.
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

    async def ping(self) -> None:
        """Return when the store is usable; raise StoreError otherwise."""
        ...

    async def close(self) -> None:
        """Release connections; the store is not used afterwards."""
        ...
