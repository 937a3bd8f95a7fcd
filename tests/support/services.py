"""The one place tests build a `Services` (what a turn runs on), as the app's lifespan does,
with the in-memory store: a new field of `Services` changes this file only."""

from __future__ import annotations

from typing import Any

from router.config import Settings
from router.connectors.select import select
from router.engines.client import EngineClient, Upstream
from router.engines.pool import Pool
from router.metrics import Metrics
from router.services import Services, StoreGuard
from sessions.memory_store import MemorySessionStore


def make_services(
    settings: Settings, engines: EngineClient | None = None, **fields: Any
) -> Services:
    """`settings`' pool, metrics and connector over `engines` (an unopened `Upstream` unless
    given) and an empty in-memory store; `fields` set any other field (`model`, `block_size`,
    `store`...)."""
    pool = Pool(settings.prefill, settings.decode, settings.unhealthy_after)
    parts: dict[str, Any] = {
        "settings": settings,
        "engines": Upstream(settings) if engines is None else engines,
        "pool": pool,
        "store": MemorySessionStore(),
        "guard": StoreGuard(1.0),
        "metrics": Metrics(pool, lambda: False),
        "connector": select(settings),
    }
    return Services(**(parts | fields))
