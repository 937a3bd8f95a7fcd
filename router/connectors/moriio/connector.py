"""MoRI-IO (vLLM's MoRIIOConnector, `moriio_toy_proxy_server.py`): the instances announce
themselves over ZMQ (announce.py), both legs carry a request id naming both peers (params.py),
P's data-parallel rank is pinned; READ or WRITE as announced (legs.py). No D->P handle: a
conversation gets affinity (same P, same D, same ranks)."""

from __future__ import annotations

from collections.abc import Coroutine, Mapping
from typing import Any

from starlette.responses import Response

from router.config import Settings
from router.connectors.base import Capabilities, Changed, Defaults
from router.connectors.moriio import announce, legs, params
from router.connectors.names import ConnectorName
from router.engines.pool import Role
from router.errors import ConfigError
from router.turn.state import Turn


class MoriIO(Defaults):
    name = ConnectorName.MORIIO
    caps = Capabilities(
        reuses_d_to_p=False,
        pins_on_d=False,
        p_hands_off=True,
        decode_plan=False,
        needs_registration=True,
    )

    def __init__(self, endpoint: str, ttl: float) -> None:
        self.endpoint = endpoint
        self.peers = announce.Peers(ttl)

    async def serve(self, turn: Turn) -> Response:
        return await legs.serve(turn, self.peers)

    def prefill_params(self, handle: Mapping[str, Any] | None) -> dict[str, Any]:
        return params.p_params(params.new_transfer_id(), 1, 1)  # legs.py builds the real ones

    def decode_params(self, prefilled: Mapping[str, Any] | None) -> dict[str, Any] | None:
        return dict(prefilled) if prefilled is not None else None

    def start(self, changed: Changed) -> list[Coroutine[Any, Any, None]]:
        return [announce.listen(self.endpoint, self.peers, changed)]

    def announced(self, role: Role) -> tuple[str, ...]:
        return self.peers.urls(role)

    def status(self) -> dict[str, Any]:
        # MoRI-IO instances heard on --moriio-register (mode: the transfer mode announced).
        view = {"on": True, "mode": self.peers.mode, "announced": self.peers.status()}
        return {"kv_connector": self.name.value, "moriio": view}


def make(settings: Settings) -> MoriIO:
    """MoRI-IO peers are addressed by the ZMQ addresses they announce, nothing else: the
    connector needs --moriio-register (whose own limits config.py checks)."""
    if not settings.moriio_register:
        raise ConfigError("--kv-connector moriio and --moriio-register go together")
    return MoriIO(settings.moriio_register, settings.moriio_register_ttl)
