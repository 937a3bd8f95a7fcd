"""KV through a shared store (vLLM's MooncakeStoreConnector; LMCache with a shared remote
backend): no fields to P or D, no handle from either. Legs: P (`kv_producer`, which writes
the prompt's blocks to the store), then D (`kv_consumer`, which loads them by hash); the
reuse verdict comes from what P reports cached (legs.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import Response

from router.config import Settings
from router.connectors.base import Capabilities, Defaults
from router.connectors.legs import pd
from router.connectors.names import ConnectorName
from router.connectors.store import legs
from router.turn.state import Turn


class StoreConnector(Defaults):
    name = ConnectorName.STORE
    # Every turn has a P leg: it is what fills the store (a kv_consumer D never writes).
    caps = Capabilities(reuses_d_to_p=False, pins_on_d=False, p_hands_off=False, decode_plan=False)

    async def serve(self, turn: Turn) -> Response:
        return await pd.serve(turn, on_prefilled=legs.note_prefill)

    def prefill_params(self, handle: Mapping[str, Any] | None) -> dict[str, Any]:
        return {}  # nothing: P's connector finds the blocks by hash (none is ever claimed)

    def decode_params(self, prefilled: Mapping[str, Any] | None) -> dict[str, Any] | None:
        return None  # D's connector loads P's blocks from the store by hash

    def engine_id(self, params: Mapping[str, Any]) -> str | None:
        return None


def make(settings: Settings) -> StoreConnector:
    return StoreConnector()
