"""`--kv-connector`'s names: the one list of connectors (flags, config and selection read it)."""

from __future__ import annotations

from enum import StrEnum


class ConnectorName(StrEnum):
    """`--kv-connector`: the one list of connectors (flags, config and selection read it)."""

    NIXL = "nixl"  # NixlConnector pull, with bidirectional D->P reuse
    NIXL_PUSH = "nixl-push"  # NixlPushConnector: P writes into D, both legs at once
    STORE = "store"  # KV through a shared store (MooncakeStoreConnector, LMCache)
    MORIIO = "moriio"  # MoRIIOConnector: request-id addressing, announced instances

    @property
    def package(self) -> str:
        """The package that implements it."""
        return "router.connectors." + self.value.replace("-", "_")
