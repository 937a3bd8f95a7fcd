"""The decode plan applied: what the previous D's prefix cache holds of the new prompt, and
whether the turn runs there alone (`hit;via=decode`). router/turn/decide/plan.py decides,
from the state alone before the turn pays for anything (decide/lacks.py bounds what D lacks),
or, where the state cannot bound it, from D's own rendering of the prompt."""

from __future__ import annotations

import logging

from router.engines.kv_index import held_tokens
from router.engines.pool import Instance
from router.services import Services
from router.turn.claim import prefix_verdict, prompt_token_ids
from router.turn.decide import extends, lacks, plan, sendable
from router.turn.incoming import Incoming
from router.turn.outcomes import Found, Reason, Reuse, Via
from router.turn.state import Turn
from sessions import model as sm
from sessions.model import SessionState

log = logging.getLogger("kvbaton.reuse")

# The misses that only say no handle could be made: D still holds the conversation. Any
# other reason (an edited history, another turn in flight, a failed or expired handle) keeps
# its P/D turn and its diagnosis.
NO_HANDLE_MADE = frozenset({Reason.STREAM_NO_KV_PARAMS, Reason.NO_KV_PARAMS, Reason.DECODE_LOCAL})


def _load(turn: Turn, inst: Instance) -> int:
    """`inst.load` without the turn's own D request sent beside the claim (turn/ahead.py)."""
    own = turn.ahead.counted(inst) if turn.ahead is not None else 0
    return max(inst.outstanding - own, inst.engine_requests)


def limits(turn: Turn) -> plan.Limits:
    return plan.limits_of(turn.svc.settings)


def _candidate(turn: Turn, source: Instance | None) -> bool:
    """Whether the decode plan is worth a look (`plan.candidate` decides from data)."""
    claim, state = turn.claim, turn.claim.state
    if state is None or source is None:
        return False
    reuse = claim.reuse
    no_handle = not reuse.is_hit and reuse.reason in NO_HANDLE_MADE
    seen = plan.Seen(
        reuse_on=turn.svc.settings.reuse,
        connector_allows=turn.svc.connector.caps.decode_plan,
        has_token_digests=bool(state.block_digests or state.seq_digest),
        hit=reuse.is_hit,
        pulls=reuse.pulls,
        no_handle_made=no_handle,
        # Asked only when it can matter: it hashes the conversation again.
        prefix_mismatch=lambda: prefix_verdict(turn.inc, state) is extends.Prefix.MISMATCH,
        d_usable=source.usable and sendable.decode_blocker(source, state) is None,
        d_inflight=_load(turn, source),
    )
    return plan.candidate(seen, limits(turn))


def ahead(svc: Services, inc: Incoming, state: SessionState) -> Instance | None:
    """The previous D when this process's last state for the conversation says the turn will
    run there alone, on an idle D (turn/ahead.py sends D's leg beside the claim). Only what
    by_state would choose from the claimed state without a handle or P in the picture: a
    turn that the claim makes something else cancels the request."""
    settings = svc.settings
    if not (settings.reuse and svc.connector.caps.decode_plan) or not state.decode:
        return None
    if inc.api == "completions" and not isinstance(inc.prompt, str):
        return None  # token ids: what D holds is checked against the block digests
    d = svc.pool.find("decode", state.decode)
    limits = plan.limits_of(settings)
    if d is None or not d.usable or sendable.decode_blocker(d, state) is not None:
        return None
    if not (plan.d_has_room(d.load, limits) and plan.d_idle(d.load, limits)):
        return None
    est = lacks.estimate(inc, state)
    if est is None or est.holds <= 0 or not 0 < est.new <= limits.max_tokens:
        return None
    return d


def by_state(turn: Turn, source: Instance | None, p_inst: Instance) -> tuple[Instance | None, bool]:
    """(the previous D, if the decode plan is chosen from the state alone; whether the choice
    is made). Before the P leg's /tokenize, the verification and the claim's early /tokenize:
    a turn that runs on D alone pays for none of them. Not made: the state cannot bound what
    D lacks, or bounds a pulling turn only above the limit (decode_here decides after the
    verification, by its exact count)."""
    if not _candidate(turn, source):
        return None, True
    assert source is not None and turn.claim.state is not None
    est = lacks.estimate(turn.inc, turn.claim.state)
    if est is None:
        return None, False
    if est.new > limits(turn).max_tokens and turn.claim.reuse.pulls:
        # The bound counts a token per byte: a message over the limit in bytes may be within
        # it in tokens, which the verification counts anyway (P's /tokenize): decided there.
        return None, False
    inputs = plan.Inputs(
        new_tokens=est.new,
        d_holds=est.holds,
        handle=turn.claim.reuse.pulls,
        d_inflight=_load(turn, source),
        p_inflight=p_inst.outstanding,
    )
    if plan.choose(inputs, limits(turn)) is not plan.Plan.DECODE:
        return None, True
    if turn.early is not None:
        turn.early.cancel()  # P's /tokenize sent during the claim: nothing needs it now
    _take(turn, source, est.holds, est.new)
    return source, True


async def decode_here(turn: Turn, source: Instance | None, p_inst: Instance) -> Instance | None:
    """The previous D when the decode plan is chosen (the claim then says `hit;via=decode`
    and carries no handle), else None: the turn pulls or recomputes as before."""
    if not _candidate(turn, source):
        return None
    assert source is not None and turn.claim.state is not None
    svc, claim, state = turn.svc, turn.claim, turn.claim.state
    tokens = claim.tokens if claim.reuse.pulls else None
    holds = claim.reuse.tokens
    if tokens is None and claim.reuse.pulls and p_inst.outstanding < limits(turn).max_inflight:
        return None  # a hit verified by digests (Responses) to a P with room: a pull anyway
    if tokens is None:
        # No handle: D's own /tokenize (or Responses render) says how the new prompt starts
        # (its tokens are what its prefix cache is keyed by), checked against D's recorded
        # sequence.
        tokens = await prompt_token_ids(svc, turn.inc, source.url, turn.request_id)
        if tokens is None:
            return None
        holds = sm.verified_tokens(state, tokens)
    kv = svc.kv_events
    index = kv.index(source.url, source.ident.restarts) if kv is not None else None
    if index is not None:  # D's KV events: what it still holds (nothing evicted since)
        holds = min(holds, held_tokens(index, tokens))
    inputs = plan.Inputs(
        new_tokens=len(tokens) - holds,
        d_holds=holds,
        handle=claim.reuse.pulls,
        d_inflight=_load(turn, source),
        p_inflight=p_inst.outstanding,
    )
    if plan.choose(inputs, limits(turn)) is not plan.Plan.DECODE:
        return None
    _take(turn, source, holds, len(tokens) - holds)
    return source


def _take(turn: Turn, source: Instance, holds: int, new: int) -> None:
    """The claim says `hit;via=decode` and carries no handle (it is released after the turn)."""
    found = Found.HISTORY if turn.claim.history_id else None
    turn.rejudge(Reuse.hit(holds, Via.DECODE, found), drop_handle=True)
    log.info(
        "turn %s: decode plan on %s (it holds %d tokens, lacks %d or fewer; %d in flight)",
        turn.request_id,
        source.url,
        holds,
        new,
        _load(turn, source),
    )
