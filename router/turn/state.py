"""One turn in flight: what was decided so far, shared by the steps that run it."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from router.engines import ranks
from router.engines.client import EngineStream
from router.engines.pool import Instance
from router.services import Services
from router.tracing import past_span
from router.turn.claim import Claim
from router.turn.early import EarlyTokens
from router.turn.incoming import Incoming
from router.turn.outcomes import Reason, Reuse
from sessions.model import SessionState


class SentAhead(Protocol):
    """D's leg sent beside the claim (router/turn/ahead.py's Ahead)."""

    def counted(self, inst: Instance) -> int: ...

    async def take(
        self, d: Instance, headers: dict[str, str], body: dict[str, Any]
    ) -> EngineStream | None: ...

    def cancel(self) -> None: ...


@dataclass
class Turn:
    svc: Services
    inc: Incoming
    request_id: str  # sent to P and D, logged, and on every response (errors too)
    claim: Claim
    started: float
    prefill: Instance | None = None
    decode: Instance | None = None
    prefill_ids: list[int] | None = None  # the prompt P got as token ids, if it did
    prefill_tokens: int = 0  # the prompt tokens P reported (its cache holds them after)
    want_token_ids: bool = False  # D is asked for return_token_ids
    first_byte: float = 0.0
    reuse_counted: bool = False
    # Prompt tokens each P's prefix cache held before the P leg, by its KV events (placement).
    held: dict[str, int] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)  # data-parallel rank sent, by role
    # The X-Request-Id of both legs when it is not request_id (MoRI-IO's addressed id).
    leg_id: str = ""
    early: EarlyTokens | None = None  # P's /tokenize sent during the claim (turn/early.py)
    ahead: SentAhead | None = None  # D's leg sent beside the claim (turn/ahead.py)
    handle_sent: bool = False  # the claimed handle reached a P (read, or D notified)
    settled: bool = False  # the end of the turn ran: D's new handle is committed or released
    committed: SessionState | None = None  # the state this turn's commit wrote, if it did
    # When P answered, and how its params reached D (legs/handover.py's Mode; "": no P leg).
    handover_at: float = 0.0
    handover_mode: str = ""

    def miss(self, reason: Reason) -> None:
        """The turn's verdict becomes a miss (its handle, if any, is not sent)."""
        self.claim = self.claim.miss(reason)

    def rejudge(self, reuse: Reuse, *, drop_handle: bool = False) -> None:
        """A new verdict for the turn; `drop_handle`: the handle is not sent either."""
        if drop_handle:
            self.claim = replace(self.claim, reuse=reuse, params=None)
        else:
            self.claim = replace(self.claim, reuse=reuse)

    def leg_headers(self, inst: Instance) -> dict[str, str]:
        """The headers of a leg to `inst` (`leg_headers`), its rank kept for the commit."""
        headers, self.ranks[inst.role] = leg_headers(self.svc, self.inc, self.claim.state, inst)
        return headers

    def headers(self) -> dict[str, str]:
        return {"X-Request-Id": self.request_id, "X-KV-Reuse": self.claim.reuse.header()}

    def final_headers(self) -> dict[str, str]:
        """The response's headers: the reuse verdict is final now, so it is counted (once)."""
        if not self.reuse_counted:
            self.reuse_counted = True
            reuse, metrics = self.claim.reuse, self.svc.metrics
            metrics.reuse.labels(*reuse.labels()).inc()
            if reuse.is_hit:
                metrics.reused_tokens.labels(reuse.source).inc(reuse.tokens)
        return self.headers()

    def mark_first_byte(self) -> None:
        if not self.first_byte:
            self.first_byte = time.monotonic()
            self.svc.metrics.ttft.labels(self.inc.api).observe(self.first_byte - self.started)
            if self.handover_mode:  # P's answer to D's first byte
                took = self.first_byte - self.handover_at
                self.svc.metrics.handover.labels(self.handover_mode).observe(took)
                past_span("kvbaton.handover", took, mode=self.handover_mode)


def leg_headers(
    svc: Services, inc: Incoming, state: SessionState | None, inst: Instance
) -> tuple[dict[str, str], int]:
    """The headers of a leg to `inst`: the client's forwarded ones, and the conversation's
    data-parallel rank on an engine that runs several (engines/ranks.py); and that rank."""
    previous = -1
    if state is not None and inst.url == (
        state.prefill if inst.role == "prefill" else state.decode
    ):
        previous = state.prefill_rank if inst.role == "prefill" else state.decode_rank
    size = ranks.size_of(svc.settings.data_parallel_size, inst)
    rank = ranks.choose(inst, size, previous)
    headers = dict(inc.forward_headers)
    if rank >= 0:
        headers[ranks.HEADER] = str(rank)
    return headers, rank
