"""What the chosen P holds of the verified prefix, and the engines' KV events: no handle when
P already holds it (its events say so, or it computed it on the conversation's last turn),
none whose blocks D evicted, and P placed by the longest prefix it holds."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from router.engines.kv_index import EngineIndex, block_digests, held_tokens
from router.engines.pool import AFFINITY_SLACK, Instance
from router.turn.claim import prompt_token_ids
from router.turn.decide import holds
from router.turn.state import Turn

log = logging.getLogger("kvbaton.reuse")


def check_handle(turn: Turn, p_inst: Instance, source: Instance | None) -> None:
    """After verify: keep the handle only if P lacks the verified prefix and D still holds it
    (a read would bring P nothing, and the turn must say so: `hit;via=prefill-cache`)."""
    kv, claim = turn.svc.kv_events, turn.claim
    if source is None or claim.state is None or not claim.reuse.pulls:
        return
    state = claim.state
    block = state.block_size or turn.svc.block_size
    p_held = holds.since_last_turn(state, p_inst.url, block)
    evicted = False
    if kv is not None and claim.tokens is not None:
        verified = claim.tokens[: claim.reuse.tokens]
        p_held = events_held(kv.index(p_inst.url), verified, p_held, state.updated_at)
        d_index = kv.index(source.url, source.ident.restarts)
        if d_index is not None and d_index.block_size > 0:
            digests = block_digests(verified, d_index.block_size)
            evicted = d_index.evicted_since(digests, state.updated_at)
    reuse = holds.cached_reuse(claim.reuse, block, p_held=p_held, d_evicted=evicted)
    if reuse != claim.reuse:
        log.info(
            "turn %s: %s (verified %d tokens, P %s holds %d)",
            turn.request_id,
            reuse.header(),
            claim.reuse.tokens,
            p_inst.url,
            p_held,
        )
        turn.rejudge(reuse, drop_handle=True)


def events_held(
    index: EngineIndex | None, verified: Sequence[int], last_turn: int, since: float
) -> int:
    """What P's KV events say it holds of the verified prefix; what it computed on the last
    turn (`last_turn` tokens) unless its events show it evicted them since (`since`): an
    index that does not have them yet is only behind (events arrive after the turn)."""
    if index is None or index.stale or index.block_size <= 0:
        return last_turn
    held = held_tokens(index, verified)
    if last_turn > held:
        digests = block_digests(verified[:last_turn], index.block_size)
        if not index.evicted_since(digests, since):
            return last_turn
    return held


async def place_prefill(turn: Turn, p_inst: Instance) -> Instance:
    """Without a handle to send: the P that holds the longest prefix of the prompt (one
    /tokenize, or Responses render, on the load pick), within the load limits."""
    svc, inc = turn.svc, turn.inc
    kv = svc.kv_events
    if kv is None or not kv.enabled or turn.claim.params is not None:
        return p_inst
    usable = [i for i in svc.pool.instances("prefill") if i.usable]
    indexes = {i.url: kv.index(i.url) for i in usable}
    if len(usable) < 2 or not any(idx is not None and idx.blocks for idx in indexes.values()):
        return p_inst
    tokens = turn.claim.tokens or await prompt_token_ids(svc, inc, p_inst.url, turn.request_id)
    if tokens is None:
        return p_inst
    held = []
    for inst in usable:
        idx = indexes[inst.url]
        held.append((inst, held_tokens(idx, tokens) if idx is not None else 0))
    turn.held = {i.url: n for i, n in held if indexes[i.url] is not None}
    chosen = holds.prefix_placement(held, p_inst, AFFINITY_SLACK)
    if chosen is not p_inst:
        log.info(
            "turn %s: prefill on %s, which holds %d prompt tokens",
            turn.request_id,
            chosen.url,
            dict((i.url, n) for i, n in held)[chosen.url],
        )
    return chosen
