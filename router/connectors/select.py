"""The connector for `--kv-connector NAME`: `ConnectorName`'s member names its package, whose
`connector.make(settings)` builds it (the only place connectors are looked up)."""

from __future__ import annotations

import importlib
from typing import Any, cast

from router.config import Settings
from router.connectors.base import Connector
from router.connectors.names import ConnectorName
from router.errors import ConfigError


def select(settings: Settings) -> Connector[Any]:
    """The configured connector; ConfigError for settings it cannot work with."""
    name = ConnectorName(settings.kv_connector)
    module = importlib.import_module(name.package + ".connector")
    connector = cast(Connector[Any], module.make(settings))
    if settings.moriio_register and not connector.caps.needs_registration:
        raise ConfigError(
            f"--moriio-register is for instances that announce themselves; "
            f"--kv-connector {name} does not (use --kv-connector moriio)"
        )
    return connector
