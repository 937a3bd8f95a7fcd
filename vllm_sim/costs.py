"""The cost model: prefill time from computed tokens and pulled blocks, then per-token decode."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    prefill_ms_per_token: float = 0.0
    transfer_ms_per_block: float = 0.0
    decode_ms_per_token: float = 0.0

    def prefill_s(self, computed_tokens: int, pulled_blocks: int) -> float:
        """Prefix-cache hits are free; computed tokens and pulled blocks cost time."""
        ms = (
            computed_tokens * self.prefill_ms_per_token + pulled_blocks * self.transfer_ms_per_block
        )
        return ms / 1000.0

    def decode_s(self) -> float:
        return self.decode_ms_per_token / 1000.0


async def spend(seconds: float) -> None:
    """Sleep only when there is a cost (a zero-cost model never yields to the loop here)."""
    if seconds > 0:
        await asyncio.sleep(seconds)
