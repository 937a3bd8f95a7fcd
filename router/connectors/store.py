"""Store-based P/D (`--kv-connector store`): the engines move KV through a shared store
(vLLM's MooncakeStoreConnector; LMCache's connector with a shared remote backend), keyed by
the blocks' content hashes. P (`kv_producer`) writes its prompt's blocks, D (`kv_consumer`)
loads them by hash before computing, so the router sends no `kv_transfer_params` at all and
there is no handle to keep: only the two calls (P with max_tokens=1, then the client's request
to D). `StoreConnector` is this module behind the connector seam (`base.Connector`).

What P found cached is the engine's own count, `usage.prompt_tokens_details.cached_tokens`
(vLLM reports it with `--enable-prompt-tokens-details`): its local prefix cache and the
store together; `prompt_usage` reads it from P's answer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.connectors import nixl


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


class StoreConnector:
    """KV through a shared store: no fields to P or D, no handle from either."""

    name = "store"

    def prefill_params(self, handle: Mapping[str, Any] | None) -> dict[str, Any]:
        return {}  # nothing: P's connector finds the blocks by hash (none is ever claimed)

    def decode_params(self, prefilled: Mapping[str, Any] | None) -> dict[str, Any] | None:
        return None  # D's connector loads P's blocks from the store by hash

    def truncate(
        self, params: Mapping[str, Any], num_tokens: int, block_size: int
    ) -> dict[str, Any]:
        raise ValueError("the store connector has no handle to truncate")

    def is_handle(self, params: object) -> bool:
        return False  # a store engine's params (if any) never name blocks for the router

    def engine_id(self, params: Mapping[str, Any]) -> str | None:
        return None

    def prefill_failed(self, status: int, body: Mapping[str, Any] | None) -> bool:
        return nixl.prefill_failed(status, body)  # vLLM's error shapes, whatever the connector
