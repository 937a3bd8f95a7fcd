"""Store-based P/D (`--kv-connector store`): the engines move KV through a shared store
(vLLM's MooncakeStoreConnector; LMCache's connector with a shared remote backend), keyed by
the blocks' content hashes. P (`kv_producer`) writes its prompt's blocks, D (`kv_consumer`)
loads them by hash before computing, so the router sends no `kv_transfer_params` at all and
there is no handle to keep: only the two calls (P with max_tokens=1, then the client's request
to D). connector.py is the connector; this module reads P's usage.

What P found cached is the engine's own count, `usage.prompt_tokens_details.cached_tokens`
(vLLM reports it with `--enable-prompt-tokens-details`): its local prefix cache and the
store together; `prompt_usage` reads it from P's answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def _count(value: object) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return None
    return value


def prompt_usage(body: Mapping[str, Any]) -> tuple[int | None, int] | None:
    """(prompt tokens, cached prompt tokens) from P's answer: chat and completions'
    `prompt_tokens(_details)`, Responses' `input_tokens(_details)`. None: no usage at all.
    vLLM omits the details when nothing was cached, so a usage without them means 0."""
    usage = body.get("usage")
    if not isinstance(usage, Mapping):
        return None
    for prefix in ("prompt", "input"):
        if f"{prefix}_tokens" in usage:
            details = usage.get(f"{prefix}_tokens_details")
            cached = details.get("cached_tokens") if isinstance(details, Mapping) else 0
            return _count(usage.get(f"{prefix}_tokens")), _count(cached) or 0
    return None
