"""Fault injection for the OpenAI routes, set through POST /sim/faults (documented in docs)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_sim.errors import ApiError


@dataclass(frozen=True)
class Injection:
    """What to do to one request."""

    fail_status: int | None = None
    stall_s: float = 0.0
    drop_after_chunks: int | None = None
    error_after_chunks: int | None = None


@dataclass
class Faults:
    fail_next: int = 0
    status: int = 503
    stall_next: int = 0
    stall_s: float = 0.0
    drop_next: int = 0
    drop_after_chunks: int = 0
    error_next: int = 0
    error_after_chunks: int = 0
    drop_ready_next: int = 0  # /v1/pd_kv_ready: answer 200 and drop the notification

    def update(self, body: Mapping[str, Any]) -> None:
        """Merge a POST /sim/faults body; unknown keys or bad values are a 400."""
        known = {f: type(getattr(self, f)) for f in self.__dataclass_fields__}
        for key, value in body.items():
            if key not in known:
                raise ApiError(f"unknown fault {key!r}; known: {sorted(known)}")
            want = known[key]
            ok = isinstance(value, int | float) if want is float else isinstance(value, int)
            if not ok or isinstance(value, bool) or value < 0:
                raise ApiError(f"fault {key!r} must be a non-negative {want.__name__}")
            setattr(self, key, want(value))
        if "stall_s" in body and "stall_next" not in body and self.stall_next == 0:
            self.stall_next = 1
        if not 400 <= self.status <= 599:
            raise ApiError("status must be an HTTP error status (400-599)")

    def clear(self) -> None:
        for f in self.__dataclass_fields__:
            setattr(self, f, type(getattr(self, f))())
        self.status = 503

    def take(self) -> Injection:
        """Consume the faults that apply to the next request (a stall set with a failure
        comes first: an engine that fails after a while)."""
        stall = 0.0
        if self.stall_next > 0:
            self.stall_next -= 1
            stall = self.stall_s
        if self.fail_next > 0:
            self.fail_next -= 1
            return Injection(fail_status=self.status, stall_s=stall)
        drop = error = None
        if self.drop_next > 0:
            self.drop_next -= 1
            drop = self.drop_after_chunks
        elif self.error_next > 0:
            self.error_next -= 1
            error = self.error_after_chunks
        return Injection(stall_s=stall, drop_after_chunks=drop, error_after_chunks=error)

    def take_ready_drop(self) -> bool:
        """Whether to drop the next ready notification (after answering it 200)."""
        if self.drop_ready_next > 0:
            self.drop_ready_next -= 1
            return True
        return False

    def state(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.__dataclass_fields__}
