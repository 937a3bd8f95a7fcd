"""NixlPushConnector (push/WRITE mode, vLLM's `disagg_proxy_pushconnector_demo.py`). P and D
are called concurrently (legs.py): P gets the null handoff with a fresh `transfer_id`, D gets
P's coordinates (coords.py) and the same transfer id, and D registers its blocks with P, which
writes into them.

vLLM refuses bidirectional transfer for push (vllm#46473), so there is no handle to keep: a
conversation gets affinity (same P, same D) and nothing is read from D on the next turn."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import Response

from router.config import Settings
from router.connectors.base import Capabilities, Defaults
from router.connectors.names import ConnectorName
from router.connectors.nixl.params import miss_params
from router.connectors.nixl_push import coords, legs
from router.engines.client import EngineClient
from router.engines.pool import Instance, Role
from router.errors import ConfigError
from router.turn.state import Turn


class NixlPush(Defaults):
    name = ConnectorName.NIXL_PUSH
    caps = Capabilities(reuses_d_to_p=False, pins_on_d=False, p_hands_off=True, decode_plan=False)

    def __init__(self, configured: dict[str, coords.Coordinates] | None = None) -> None:
        self.known = coords.Directory(dict(configured or {}))

    async def serve(self, turn: Turn) -> Response:
        return await legs.serve(turn, self.known)

    def prefill_params(self, handle: Mapping[str, Any] | None) -> dict[str, Any]:
        # Never a handle (no D->P reads in push mode); legs.py adds the transfer id.
        return miss_params()

    def decode_params(self, prefilled: Mapping[str, Any] | None) -> dict[str, Any] | None:
        # legs.py hands D's params (P's coordinates and the transfer id) through as they are.
        return dict(prefilled) if prefilled is not None else None

    async def inspect(
        self, engines: EngineClient, inst: Instance, model: str, timeout: float
    ) -> None:
        await self.known.learn(engines, inst, model, timeout, force=False)

    def seed(self, url: str, role: Role, fields: Mapping[str, Any]) -> None:
        self.known.given(url, coords.from_admin(role, fields))

    def instance_view(self, inst: Instance) -> dict[str, Any]:
        return self.known.view(inst)


def make(settings: Settings) -> NixlPush:
    """The push connector with --prefill-coordinates (ConfigError for a bad spec)."""
    try:
        return NixlPush(coords.configured(settings.prefill_coordinates))
    except ValueError as exc:
        raise ConfigError(f"--prefill-coordinates {exc}") from None
