"""The turn's plan, a pure choice among three: pull (P reads the verified prefix from the
previous D, then P->D), decode (the whole turn on the previous D, no P leg: D computes only
what its prefix cache lacks) and recompute (an ordinary P/D turn).

Why these rules (docs/architecture.md, *Per-turn placement*):
- The decode plan puts prefill work into D's decode batch, so it is taken only when that
  work is small (`--decode-local-max-tokens` new tokens) and D is not crowded
  (`--decode-local-max-inflight` requests in flight there).
- While D has room (`--decode-local-idle-inflight`, by default as many as the limit) the
  decode plan wins even when P could pull: one forward on D comes sooner than P's forward,
  the handover and D's own forward for token 1. Set lower, a busier D keeps the pull and
  the prefill work on P, so the streams D is decoding are not slowed; the decode plan then
  still wins when P is as crowded as the limit.
- What D lacks of the new prompt is bounded from the state alone (decide/lacks.py: no
  /tokenize); where the state cannot bound it, D's own rendering says (`/tokenize`, or
  `/v1/responses/render` for Responses: a D that does not serve it is never given the
  decode plan for a Responses turn).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from router.config import Settings


class Plan(StrEnum):
    PULL = "pull"
    DECODE = "decode"
    RECOMPUTE = "recompute"


@dataclass(frozen=True)
class Limits:
    max_tokens: int  # --decode-local-max-tokens (0: never the decode plan)
    max_inflight: int  # --decode-local-max-inflight
    idle_inflight: int = 0  # --decode-local-idle-inflight (0: P crowded only)


@dataclass(frozen=True)
class Inputs:
    new_tokens: int  # the prompt's tokens the previous D's prefix cache lacks (at most)
    d_holds: int  # the prompt's leading tokens in that cache
    handle: bool  # a verified handle may be pulled by P
    d_inflight: int  # requests in flight on the previous D (this router's, or D's own count)
    p_inflight: int  # ... and this router's on the chosen P


def limits_of(s: Settings) -> Limits:
    """The decode plan's limits, as the settings say."""
    return Limits(
        s.decode_local_max_tokens, s.decode_local_max_inflight, s.decode_local_idle_inflight
    )


def d_has_room(d_inflight: int, limits: Limits) -> bool:
    """Whether the decode plan is possible at all (checked before any /tokenize is spent)."""
    return limits.max_tokens > 0 and d_inflight < limits.max_inflight


def d_idle(d_inflight: int, limits: Limits) -> bool:
    """Whether D is idle enough that its next step comes before a pull's would."""
    return d_inflight < min(limits.idle_inflight, limits.max_inflight)


@dataclass(frozen=True)
class Seen:
    """What the turn knows before anything is paid for the decode plan."""

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
    if c.d_holds <= 0 or c.new_tokens <= 0 or c.new_tokens > limits.max_tokens:
        return fallback
    if d_idle(c.d_inflight, limits):
        return Plan.DECODE  # its next step is the turn's first token: no prefill, no handover
    if c.handle and c.p_inflight < limits.max_inflight:
        return Plan.PULL  # P has room: keep the prefill off the streams D is decoding
    return Plan.DECODE
