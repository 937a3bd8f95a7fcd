"""The connector seam: what the turn needs from a KV-transfer protocol's fields.

One module per protocol implements it (`nixl.py`: NixlConnector pull with bidirectional D->P
reuse; `nixl_push.py`: NixlPushConnector, whose concurrent legs are router/turn/push.py's;
`moriio.py`: MoRIIOConnector, legs in router/turn/moriio.py; `store.py`: KV through a
shared store, no fields); `select` picks one by `--kv-connector`. The turn never reads a
protocol field itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol


class Connector(Protocol):
    """A KV-transfer protocol as the router speaks it to P and D."""

    name: str

    def prefill_params(self, handle: Mapping[str, Any] | None) -> dict[str, Any]:
        """P's `kv_transfer_params`: D's claimed handle (a hit), or the null handoff."""
        ...

    def decode_params(self, prefilled: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """D's `kv_transfer_params` from what P returned (None: D computes the prompt)."""
        ...

    def truncate(
        self, params: Mapping[str, Any], num_tokens: int, block_size: int
    ) -> dict[str, Any]:
        """A handle cut to its first `num_tokens` tokens (a block-aligned prefix)."""
        ...

    def is_handle(self, params: object) -> bool:
        """Whether an engine returned usable params (not the null handoff, not garbage)."""
        ...

    def engine_id(self, params: Mapping[str, Any]) -> str | None:
        """The engine id that made a handle (a new one means its engine restarted)."""
        ...

    def prefill_failed(self, status: int, body: Mapping[str, Any] | None) -> bool:
        """Whether P's answer says it failed (and so refused a handle it was given)."""
        ...


def select(name: str) -> Connector:
    """The connector for `--kv-connector NAME`."""
    from router.connectors.moriio import MoriIO
    from router.connectors.nixl import NixlPull  # one import per protocol module
    from router.connectors.nixl_push import NixlPush
    from router.connectors.store import StoreConnector

    connectors: dict[str, Connector] = {
        "nixl": NixlPull(),
        "nixl-push": NixlPush(),
        "store": StoreConnector(),
        "moriio": MoriIO(),
    }
    try:
        return connectors[name]
    except KeyError:
        raise ValueError(
            f"unknown kv connector {name!r}; expected one of {sorted(connectors)}"
        ) from None
