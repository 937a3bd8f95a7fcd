"""Which of a pressured D's handles go first: those least likely to be read, idle longest
relative to their own conversation's cadence. Pure: the sweep (lifecycle/pin_sweep.py) feeds it
the pin index's oldest entries and each conversation's turn times."""

from __future__ import annotations

import math
from collections.abc import Sequence

from sessions.model import TurnTimes

# A conversation measured faster than this is taken at this pace (scripts, client retries):
# one idle for a second is not yet a hundred times overdue.
MIN_CADENCE_S = 1.0
# A conversation of one turn has no cadence yet: it is taken to come back as slowly as most
# do, the p95 time between turns this process measured (DEFAULT_PRIOR_S until 20 gaps are
# measured). So a one-turn handle is overdue once it is idle past that p95 (a bot's that never
# comes back, on a fleet of quick scripts, within a second), and a conversation that has gone
# quiet for many of its own gaps may go before it.
DEFAULT_PRIOR_S = 60.0


def prior(p95: float | None) -> float:
    """The cadence assumed for a conversation that has none yet (see DEFAULT_PRIOR_S)."""
    return DEFAULT_PRIOR_S if p95 is None else p95


def overdue(since: float, times: TurnTimes | None, now: float, prior: float, ttl: float) -> float:
    """How many of its own conversation's cadences a handle committed at `since` has sat
    unread at `now`; math.inf once past the handle TTL (no turn would read it)."""
    idle = max(now - since, 0.0)
    if idle >= ttl:
        return math.inf
    cadence = times.cadence() if times is not None else None
    return idle / max(prior if cadence is None else cadence, MIN_CADENCE_S)


def least_likely_first(
    due: Sequence[tuple[str, float]],
    times: Sequence[TurnTimes | None],
    *,
    now: float,
    prior: float,
    ttl: float,
) -> list[tuple[str, float]]:
    """`due` (the pin index's (key, since)) with the handles least likely to be read first:
    the most overdue (`overdue`, `times[i]` being due[i]'s conversation), ties oldest first."""
    scored = [
        (-overdue(since, pace, now, prior, ttl), since, key)
        for (key, since), pace in zip(due, times, strict=True)
    ]
    scored.sort()
    return [(key, since) for _, since, key in scored]
