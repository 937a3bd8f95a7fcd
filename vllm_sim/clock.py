"""The engine clock: monotonic time plus an offset that tests can advance (POST /sim/clock)."""

from __future__ import annotations

import time
from collections.abc import Callable


class SimClock:
    def __init__(self, base: Callable[[], float] = time.monotonic) -> None:
        self._base = base
        self.offset = 0.0

    def __call__(self) -> float:
        return self._base() + self.offset

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("the clock only moves forward")
        self.offset += seconds
