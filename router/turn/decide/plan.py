"""The turn's plan, a pure choice among three: pull (P reads the verified prefix from the
previous D, then P->D), decode (the whole turn on the previous D, no P leg: D computes only
what its prefix cache lacks) and recompute (an ordinary P/D turn).

Why these rules (docs/architecture.md, *Per-turn placement*):
- The decode plan puts prefill work into D's decode batch, so it is taken only when that
  work is small (`--decode-local-max-tokens` new tokens) and D is not crowded
  (`--decode-local-max-inflight` requests in flight there, counted by this router).
- With a verified handle and a P that has room, the pull keeps all prefill work on P: the
  decode batch of the other conversations on D is not slowed. The decode plan then still
  wins when P is as crowded as the limit.
- What D holds of the new prompt is known from D's own rendering of it: `/tokenize` for
  chat and completions, `/v1/responses/render` for Responses (a D that does not serve it is
  never given the decode plan for a Responses turn: nothing says what it holds).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class Plan(StrEnum):
    PULL = "pull"
    DECODE = "decode"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class Limits:
    max_tokens: int  # --decode-local-max-tokens (0: never the decode plan)
    max_inflight: int  # --decode-local-max-inflight


@dataclass(frozen=True)
class Inputs:
    prompt_tokens: int  # the new prompt's tokens (0: not known)
    d_holds: int  # of those, the leading ones verified in the previous D's prefix cache
    handle: bool  # a verified handle may be pulled by P
    d_inflight: int  # requests this router has in flight on the previous D
    p_inflight: int  # ... and on the chosen P


def d_has_room(d_inflight: int, limits: Limits) -> bool:
    """Whether the decode plan is possible at all (checked before any /tokenize is spent)."""
    return limits.max_tokens > 0 and d_inflight < limits.max_inflight


@dataclass(frozen=True)
class Seen:
    """What the turn knows before it asks D's /tokenize for the decode plan."""

    reuse_on: bool  # --reuse
    connector_allows: bool  # the connector's capability (store: every turn needs its P leg)
    has_token_digests: bool  # the state records D's token sequence
    hit: bool  # the claim's verdict is a hit ...
    pulls: bool  # ... that P would read from D (not one from P's own cache)
    no_handle_made: bool  # a miss only because no handle could be made: D holds the turn
    # Whether the prompt does not extend what D holds (edited, regenerated): asked last.
    prefix_mismatch: Callable[[], bool]
    d_usable: bool  # the previous D is healthy, not draining, not restarted since
    d_inflight: int


def candidate(s: Seen, limits: Limits) -> bool:
    """Whether the decode plan is worth a look: a usable previous D with room, and a state
    that records D's token sequence; a hit from P's own cache needs no plan."""
    if not (s.reuse_on and s.connector_allows and s.has_token_digests):
        return False
    if s.hit and not s.pulls:
        return False
    if not s.hit and not s.no_handle_made:
        return False
    if not (s.d_usable and d_has_room(s.d_inflight, limits)):
        return False
    return s.hit or not s.prefix_mismatch()


def choose(c: Inputs, limits: Limits) -> Plan:
    """The plan for one turn whose previous D is usable (else the caller never asks)."""
    fallback = Plan.PULL if c.handle else Plan.RECOMPUTE
    if not d_has_room(c.d_inflight, limits):
        return fallback
    new = c.prompt_tokens - c.d_holds
    if c.d_holds <= 0 or new <= 0 or new > limits.max_tokens:
        return fallback
    if c.handle and c.p_inflight < limits.max_inflight:
        return Plan.PULL  # P has room: keep the prefill off D's decode batch
    return Plan.DECODE
