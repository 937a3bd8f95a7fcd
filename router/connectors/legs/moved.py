"""What moved: after the P leg, a hit is judged again from P's own count of cached prompt
tokens (`usage.prompt_tokens_details.cached_tokens`, vLLM's `--enable-prompt-tokens-details`),
so that a plain `hit` says P read KV from D (`holds.moved` decides), and the prompt tokens
P reported are kept for the next turn (what its prefix cache then holds)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from router.connectors.legs.prefill import Prefilled
from router.engines.pool import Instance
from router.turn.decide import holds
from router.turn.state import Turn

log = logging.getLogger("kvbaton.reuse")


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def prompt_counts(body: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """(prompt tokens, cached prompt tokens) of P's answer (chat and completions' `prompt_*`,
    Responses' `input_*`); cached is None without the details (vLLM sends them only with
    `--enable-prompt-tokens-details`, and then only when some were cached)."""
    usage = body.get("usage")
    if not isinstance(usage, Mapping):
        return None, None
    for prefix in ("prompt", "input"):
        if f"{prefix}_tokens" in usage:
            details = usage.get(f"{prefix}_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, Mapping) else None
            return _count(usage.get(f"{prefix}_tokens")), _count(cached)
    return None, None


def note_moved(turn: Turn, prefilled: Prefilled) -> None:
    """Keep P's prompt tokens for the next turn; judge the turn's hit by what P counted."""
    if prefilled.body is None or not turn.svc.connector.caps.reuses_d_to_p:
        return
    prompt, cached = prompt_counts(prefilled.body)
    turn.prefill_tokens = prompt or 0
    claim = turn.claim
    block = claim.state.block_size if claim.state is not None else 0
    reuse = holds.moved(claim.reuse, cached, block or turn.svc.block_size)
    _learn(turn, prefilled.instance, cached, skipped=reuse != claim.reuse and claim.reuse.pulls)
    if reuse != claim.reuse:
        log.info(
            "turn %s: %s (P %s read nothing from D: it reports %d cached prompt tokens of the "
            "%d verified)",
            turn.request_id,
            reuse.header(),
            prefilled.instance.url,
            cached,
            claim.reuse.tokens,
        )
        turn.rejudge(reuse)


def _learn(turn: Turn, p_inst: Instance, cached: int | None, *, skipped: bool) -> None:
    """What P did with the read it was offered, or what its cache kept of the conversation's
    last prompt when it was offered none (router/engines/reads.py)."""
    state = turn.claim.state
    if state is None:
        return
    reads = p_inst.reads.current(p_inst.ident.restarts)
    if skipped:
        reads.skipped(turn.claim.reuse.tokens - (cached or 0))
    elif not turn.handle_sent:
        reads.cached(cached, holds.since_last_turn(state, p_inst.url, state.block_size))
