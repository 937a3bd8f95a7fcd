"""Producer-side pins: blocks held for a remote reader until notified or expired.

P pins for kv_lease_duration, D (bidirectional) for decoder_kv_blocks_ttl (vLLM #41383).
The sweep scans every entry, not just the oldest (the reaper bug of vllm#58222).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm_sim.blocks import BlockPool


@dataclass(frozen=True)
class Pin:
    request_id: str
    block_ids: list[int]
    expiry: float
    kind: str  # "lease" (P) or "decoder" (D)


class PinTable:
    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool
        self._pins: dict[str, Pin] = {}

    def __len__(self) -> int:
        return len(self._pins)

    @property
    def num_blocks(self) -> int:
        return sum(len(p.block_ids) for p in self._pins.values())

    def pin(self, pin: Pin) -> None:
        """Take over the request's block references until release or expiry."""
        old = self._pins.pop(pin.request_id, None)
        if old is not None:
            self._pool.free(old.block_ids)
        self._pins[pin.request_id] = pin

    def release(self, request_id: str) -> Pin | None:
        pin = self._pins.pop(request_id, None)
        if pin is not None:
            self._pool.free(pin.block_ids)
        return pin

    def sweep(self, now: float) -> list[Pin]:
        expired = [p for p in self._pins.values() if p.expiry <= now]
        for p in expired:
            self.release(p.request_id)
        return expired

    def snapshot(self) -> list[dict[str, Any]]:
        return [
            {
                "request_id": p.request_id,
                "block_ids": p.block_ids,
                "expiry": p.expiry,
                "kind": p.kind,
            }
            for p in self._pins.values()
        ]
