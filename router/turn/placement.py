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
- Responses turns are never planned on D: vLLM's `/tokenize` cannot render their input, so
  what D's cache holds of the prompt is not known.
"""

from __future__ import annotations

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
    api: str


def d_has_room(d_inflight: int, limits: Limits) -> bool:
    """Whether the decode plan is possible at all (checked before any /tokenize is spent)."""
    return limits.max_tokens > 0 and d_inflight < limits.max_inflight


def choose(c: Inputs, limits: Limits) -> Plan:
    """The plan for one turn whose previous D is usable (else the caller never asks)."""
    fallback = Plan.PULL if c.handle else Plan.RECOMPUTE
    if c.api == "responses" or not d_has_room(c.d_inflight, limits):
        return fallback
    new = c.prompt_tokens - c.d_holds
    if c.d_holds <= 0 or new <= 0 or new > limits.max_tokens:
        return fallback
    if c.handle and c.p_inflight < limits.max_inflight:
        return Plan.PULL  # P has room: keep the prefill off D's decode batch
    return Plan.DECODE
