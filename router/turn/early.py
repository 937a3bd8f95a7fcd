"""P's `/tokenize` sent while the store claims the conversation, so that a hit waits for the
longer of the two instead of both in turn.

Only when the turn will most likely need it: a chat turn with a conversation id and an
earlier answer in its history, verified by tokens, whose conversation's last turn in this
process left D's handle (a turn without one, such as a stream from stock vLLM, is served
without P's /tokenize), a pull that pays (router/turn/worth.py), and a D too busy for the
decode plan to be taken from the state alone (router/turn/decode_plan.py). The request goes to
the P that prefilled that turn; its ids count only if this turn's P turns out to be the
same (verify asks again otherwise), and a turn that needs none cancels the request.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from router.services import Services
from router.turn import render
from router.turn.claim import prompt_token_ids
from router.turn.decide import asks, plan
from router.turn.incoming import Incoming
from sessions.keys import conversation_key

# Conversations whose last turn here left a handle, and its P (the oldest forgotten first).
MAX_HINTS = 65536


@dataclass
class EarlyTokens:
    """A /tokenize in flight on `url`."""

    url: str
    task: asyncio.Task[list[int] | None]

    async def tokens_for(self, url: str) -> tuple[bool, list[int] | None]:
        """(True, P's ids) when this request went to `url`; else (False, None), cancelled."""
        if url != self.url:
            self.cancel()
            return False, None
        return True, await self.task

    def cancel(self) -> None:
        """Stop the request; a failure it already had is dropped (verify never saw it)."""
        if self.task.done():
            if not self.task.cancelled():
                self.task.exception()
        else:
            self.task.cancel()


def start(svc: Services, inc: Incoming, request_id: str) -> EarlyTokens | None:
    """Send /tokenize now if this turn is likely a hit to verify by tokens; else None."""
    if not asks.early_tokens(svc.settings, svc.connector.caps, inc):
        return None
    assert inc.conversation_id is not None
    url = _likely_prefill(svc, conversation_key(inc.tenant, inc.conversation_id))
    if not url or (inc.api == "responses" and not render.may_render(svc, url)):
        return None
    return EarlyTokens(url, asyncio.create_task(prompt_token_ids(svc, inc, url, request_id)))


def remember(
    svc: Services, key: str | None, prefill_url: str | None, lacking: int = 0, decode_url: str = ""
) -> None:
    """After a commit: the P of a turn that left a handle, the tokens of it that P lacks
    (router/turn/worth.py) and its D, or None (no handle: forget)."""
    if key is None:
        return
    hints = svc.prefill_hints
    hints.pop(key, None)
    if prefill_url is None:
        return
    hints[key] = (prefill_url, lacking, decode_url)
    if len(hints) > MAX_HINTS:
        del hints[next(iter(hints))]


def _likely_prefill(svc: Services, key: str) -> str:
    """The hinted P, if it is usable and the pull it would make pays (else it gets none), and
    the hinted D is not idle enough to take the turn alone (decide/plan.py's `d_idle`)."""
    url, lacking, decode = svc.prefill_hints.get(key, ("", 0, ""))
    d_inst = svc.pool.find("decode", decode) if decode else None
    load = d_inst.load if d_inst is not None and d_inst.usable else -1
    limits = plan.limits_of(svc.settings)
    if load >= 0 and plan.d_has_room(load, limits) and plan.d_idle(load, limits):
        return ""  # the turn most likely runs on D alone: nothing to verify
    for inst in svc.pool.instances("prefill"):
        if inst.url == url and inst.usable:
            return url if lacking >= inst.reads.current(inst.ident.restarts).floor else ""
    return ""
