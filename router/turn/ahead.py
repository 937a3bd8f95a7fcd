"""D's leg sent beside the claim (issue 49): a turn that will most likely run on its previous
D alone (the decode plan on an idle D, decide/plan.py) does not wait for the store before D
starts. D's request does not depend on the claim; the claim only says whether this is such
a turn. So the request goes out at once, chosen from the state this process committed last
for the conversation, and it is used only if the claimed state chooses the same D with the
same request (router/connectors/legs/decode.py); else it is cancelled before its first byte
(D stops it: what it computed is lost, nothing of it is relayed).

Measured on the cost model's engines, one client, a turn on D alone: the router added about
4.5 ms to what D took, 0.9 ms of it (p50; 1.9 ms p90) the claim.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import msgspec

from router.engines.client import EngineStream
from router.engines.pool import Instance
from router.services import Services
from router.turn import decode_plan
from router.turn.decide import asks
from router.turn.incoming import Incoming
from router.turn.rewrite import decode_body
from router.turn.state import leg_headers
from sessions.keys import conversation_key
from sessions.model import SessionState

# Conversations whose last state is kept (the oldest forgotten first); each is a few hundred
# bytes once its handle and block digests are dropped (decode_plan.ahead needs neither).
MAX_STATES = 16384


@dataclass
class Ahead:
    """A D request in flight since before the claim answered."""

    d: Instance
    headers: dict[str, str]
    body: dict[str, Any]
    task: asyncio.Task[EngineStream]
    taken: bool = False  # by the turn, or cancelled
    used: bool = False  # the turn relays this request's answer

    def counted(self, inst: Instance) -> int:
        """1 while this request is opening on `inst` (its load counts it), else 0: the
        claimed turn judges D's load without its own request."""
        return int(inst is self.d and not self.task.done())

    async def take(
        self, d: Instance, headers: dict[str, str], body: dict[str, Any]
    ) -> EngineStream | None:
        """D's open answer when the turn sends the same request to the same D (a failure
        to open is raised, as the turn's own request's would be); else None, cancelled."""
        if self.taken or d is not self.d or headers != self.headers or body != self.body:
            self.cancel()
            return None
        self.taken = self.used = True
        return await self.task

    def cancel(self) -> None:
        """Stop the request unless the turn took it (an open answer is closed: D aborts)."""
        if self.taken:
            return
        self.taken = True
        if not self.task.done():
            self.task.cancel()
        elif not self.task.cancelled() and self.task.exception() is None:
            self.task.result().close()


def start(svc: Services, inc: Incoming, request_id: str) -> Ahead | None:
    """Send D's leg now if this process's last state for the conversation says the turn
    runs on that D alone; else None."""
    if svc.open_decode is None or inc.conversation_id is None:
        return None
    state = svc.last_states.get(conversation_key(inc.tenant, inc.conversation_id))
    d = decode_plan.ahead(svc, inc, state) if state is not None else None
    if d is None:
        return None
    want = asks.token_ids(svc.settings, inc, d.ident.streams_handles)
    headers, _ = leg_headers(svc, inc, state, d)
    alone = asks.handle_seen(svc.settings, inc, d.ident.streams_handles)
    kv = svc.connector.decode_params(svc.connector.alone_params() if alone else None)
    body = decode_body(inc.body, kv, return_token_ids=want, api=inc.api)
    opened = svc.open_decode(svc, d, inc.api, body, request_id, headers)
    return Ahead(d, headers, body, asyncio.ensure_future(opened))


def end(svc: Services, sent: Ahead | None) -> None:
    """The turn is over or past its D leg's start: a request it did not use is cancelled,
    and counted either way."""
    if sent is None:
        return
    sent.cancel()
    svc.metrics.decode_ahead.labels("used" if sent.used else "dropped").inc()


def remember(svc: Services, key: str | None, state: SessionState | None) -> None:
    """After a commit: the state committed (None: forget the conversation's)."""
    if key is None:
        return
    states = svc.last_states
    states.pop(key, None)
    if state is None or not (state.block_digests or state.seq_digest) or not state.decode:
        return
    # What decode_plan.ahead reads: a handle and the block digests are the claim's only.
    states[key] = msgspec.structs.replace(state, kv_transfer_params=None, block_digests=())
    if len(states) > MAX_STATES:
        del states[next(iter(states))]
