"""NixlConnector pull with bidirectional D->P reuse (vLLM's toy proxy and its multi-turn
variant): P gets D's handle (a hit) or the null handoff, D gets P's params, and D's new
handle is kept for the next turn. Legs: P, then D (router/connectors/legs/pd.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from starlette.responses import Response

from router.config import Settings
from router.connectors.base import Capabilities, Defaults
from router.connectors.legs import pd
from router.connectors.names import ConnectorName
from router.connectors.nixl import params
from router.turn.state import Turn
from sessions.model import PinSize


class NixlPull(Defaults):
    name = ConnectorName.NIXL
    caps = Capabilities(
        reuses_d_to_p=True, pins_on_d=True, p_hands_off=True, decode_plan=True, ready_notify=True
    )

    async def serve(self, turn: Turn) -> Response:
        return await pd.serve(turn)

    def prefill_params(self, handle: Mapping[str, Any] | None) -> dict[str, Any]:
        return params.hit_params(handle) if handle is not None else params.miss_params()

    def decode_params(self, prefilled: Mapping[str, Any] | None) -> dict[str, Any] | None:
        # P's own params, as P returned them: D reads P's blocks with them (P->D).
        return dict(prefilled) if prefilled is not None else None

    def alone_params(self) -> dict[str, Any] | None:
        return dict(params.ALONE)  # a bidirectional D returns its handle for these

    def truncate(
        self, handle: Mapping[str, Any], num_tokens: int, block_size: int
    ) -> dict[str, Any]:
        return params.truncate(handle, num_tokens, block_size)

    def is_handle(self, value: object) -> bool:
        return params.is_handle(value)

    def release_request(
        self, handle: Mapping[str, Any], model: str
    ) -> tuple[dict[str, Any], str] | None:
        body = params.release_body(handle, model)
        return (body, "/v1/completions") if body is not None else None

    def release_prefilled(
        self, prefilled: Mapping[str, Any], model: str
    ) -> tuple[dict[str, Any], str] | None:
        body = params.release_prefilled_body(prefilled, model)
        return (body, "/v1/completions") if body is not None else None

    def pinned(self, handle: Mapping[str, Any]) -> PinSize:
        return params.pinned(handle)


def make(settings: Settings) -> NixlPull:
    return NixlPull()
