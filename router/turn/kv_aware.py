"""The turn's use of the engines' KV events: no handle when P already holds the verified
prefix, none whose blocks D evicted, and P placed by the longest prefix it holds."""

from __future__ import annotations

import logging

from router.engines.kv_index import block_digests, held_tokens
from router.engines.pool import AFFINITY_SLACK, Instance
from router.turn import decide
from router.turn.claim import prompt_token_ids
from router.turn.state import Turn

log = logging.getLogger("kvbaton.reuse")


def check_handle(turn: Turn, p_inst: Instance, source: Instance | None) -> None:
    """After verify: keep the handle only if P lacks the verified prefix and D still holds it."""
    kv, claim = turn.svc.kv_events, turn.claim
    if kv is None or source is None or claim.tokens is None or claim.state is None:
        return
    if not claim.reuse.pulls:
        return
    verified = claim.tokens[: claim.reuse.tokens]
    p_index = kv.index(p_inst.url)
    p_held = held_tokens(p_index, verified) if p_index is not None else 0
    d_index = kv.index(source.url, source.ident.restarts)
    evicted = False
    if d_index is not None and d_index.block_size > 0:
        digests = block_digests(verified, d_index.block_size)
        evicted = d_index.evicted_since(digests, claim.state.updated_at)
    block = claim.state.block_size or turn.svc.block_size
    reuse = decide.cached_reuse(claim.reuse, block, p_held=p_held, d_evicted=evicted)
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
    chosen = decide.prefix_placement(held, p_inst, AFFINITY_SLACK)
    if chosen is not p_inst:
        log.info(
            "turn %s: prefill on %s, which holds %d prompt tokens",
            turn.request_id,
            chosen.url,
            dict((i.url, n) for i, n in held)[chosen.url],
        )
    return chosen
