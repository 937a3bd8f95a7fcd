"""The cost model's parameters and the KV pulls' time. Prefill and decode time is the step
loop's (`steps.py`): they share each step of one engine."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    prefill_ms_per_token: float = 0.0
    transfer_ms_per_block: float = 0.0
    decode_ms_per_token: float = 0.0
    transfer_ms_per_pull: float = 0.0

    def transfer_s(self, pulled_blocks: int) -> float:
        """A read's time: a fixed cost per pull (one NIXL read: its descriptors, the post,
        the completion and D's notification) plus its blocks (an asynchronous read: it holds
        up only its request). Reading nothing costs nothing."""
        if pulled_blocks <= 0:
            return 0.0
        return (self.transfer_ms_per_pull + pulled_blocks * self.transfer_ms_per_block) / 1000.0


async def spend(seconds: float) -> None:
    """Sleep only when there is a cost (a zero-cost model never yields to the loop here)."""
    if seconds > 0:
        await asyncio.sleep(seconds)
