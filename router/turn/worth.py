"""Whether a pull pays, judged before the turn pays anything for it (issue 49): from the
state alone (D's tokens, the prompt the conversation's last P computed) and what the chosen P
is known to do with a read (router/engines/reads.py). A pull that would not pay becomes
`miss;reason=recompute-cheaper`: no /tokenize, no verification, the handle released after
the turn; P recomputes what its prefix cache lacks, as vLLM's own threshold would have made
it do after the router had paid for the handle."""

from __future__ import annotations

import logging

from router.engines.pool import Instance
from router.turn.decide.holds import since_last_turn
from router.turn.outcomes import Found, Reason, Reuse, Via
from router.turn.state import Turn
from sessions.model import SessionState

log = logging.getLogger("kvbaton.reuse")


def lacking(state: SessionState, prefill: str, kept: float, held: int | None = None) -> int:
    """The tokens of D's sequence that P (its URL) would read: those beyond the full blocks
    of the prompt it computed last turn (`held`, found here when None), as much of them as P
    is seen to keep (`kept`)."""
    if held is None:
        held = since_last_turn(state, prefill, state.block_size)
    return max(0, state.token_count - int(held * kept))


def pays(lacking_tokens: int, floor: int) -> bool:
    """Whether a read of `lacking_tokens` is one P makes (`floor`: the fewest it reads)."""
    return lacking_tokens >= floor


def judge(turn: Turn, p_inst: Instance) -> None:
    """Turn a pull that would not pay into `recompute-cheaper` (the claim drops its handle)."""
    claim, state = turn.claim, turn.claim.state
    if claim.params is None or state is None or not claim.reuse.pulls:
        return
    reads = p_inst.reads.current(p_inst.ident.restarts)
    held = since_last_turn(state, p_inst.url, state.block_size)
    short = lacking(state, p_inst.url, reads.kept, held)
    if pays(short, reads.floor):
        return
    if held > 0:  # what moved is judged after P by its own count (router/connectors/legs/moved.py)
        found = Found.HISTORY if turn.claim.history_id else None
        turn.rejudge(Reuse.hit(held, Via.PREFILL_CACHE, found), drop_handle=True)
    else:
        turn.miss(Reason.RECOMPUTE_CHEAPER)
    if turn.early is not None:
        turn.early.cancel()  # P's /tokenize sent during the claim: nothing needs it now
    log.debug(
        "turn %s: %s (P %s lacks about %d tokens; it reads %d or more)",
        turn.request_id,
        turn.claim.reuse.header(),
        p_inst.url,
        short,
        reads.floor,
    )
