"""`--kv-connector store`: a turn's reuse verdict from what P says it found cached
(`handleless.store`), applied after P's leg.

In store mode no handle exists: the conversation's KV is wherever the shared store (and the
engines' own prefix caches) hold it, and P finds it by content. So the verdict comes after
the P leg, from P's own count (`usage.prompt_tokens_details.cached_tokens`), never from the
router's guess; placement (affinity, the KV-events index) is the usual one.
"""

from __future__ import annotations

import logging

from router.connectors.legs.prefill import Prefilled
from router.connectors.store.params import prompt_usage
from router.turn.decide import handleless
from router.turn.state import Turn

log = logging.getLogger("kvbaton.reuse")


def note_prefill(turn: Turn, prefilled: Prefilled) -> None:
    """Count P's cached and computed prompt tokens and set the turn's verdict from them."""
    svc = turn.svc
    if prefilled.body is None:
        return
    counts = prompt_usage(prefilled.body)
    if counts is None:  # no usage in P's answer: nothing is known, the claim's verdict stays
        return
    prompt, cached = counts
    svc.metrics.store_prompt_tokens.labels("cached").inc(cached)
    if prompt is not None and prompt >= cached:
        svc.metrics.store_prompt_tokens.labels("computed").inc(prompt - cached)
    local = turn.held.get(prefilled.instance.url)
    reuse = handleless.store(turn.claim.reuse, turn.claim.state is not None, cached, local)
    if reuse != turn.claim.reuse:
        log.info(
            "turn %s: %s (P %s reports %d cached prompt tokens)",
            turn.request_id,
            reuse.header(),
            prefilled.instance.url,
            cached,
        )
        turn.rejudge(reuse)
