"""The connector seam: a KV-transfer protocol as the router speaks it, end to end.

A connector is a package under router/connectors/, named by its `ConnectorName` member, whose
`connector.py` has `make(settings) -> Connector`. It owns its parameters, its legs (`serve`:
how P and D are called), its registration or coordinates and its reuse verdicts, and says
what it can do in `Capabilities`: the turn asks those, never the connector's name.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from starlette.responses import Response

from router.connectors.names import ConnectorName
from router.engines.client import EngineClient
from router.engines.pool import Instance, Role
from sessions.model import UNKNOWN_SIZE, PinSize


@dataclass(frozen=True)
class Capabilities:
    """What a connector does, as the turn's decisions need to know it."""

    # P reads the conversation's KV from the previous D: a handle is kept between turns and
    # verified before it is sent (the prompt's tokens, P's /tokenize).
    reuses_d_to_p: bool
    # D pins every finished request's blocks until a P reads them (bidirectional_kv_xfer).
    pins_on_d: bool
    # P's answer carries the params D reads P's blocks with (store: D loads by hash).
    p_hands_off: bool
    # A turn may run on the previous D alone (the decode plan): only when no P leg is
    # needed to move KV (store mode's P leg is what fills the store).
    decode_plan: bool
    # The instances announce themselves (MoRI-IO's ZMQ registration).
    needs_registration: bool = False
    # P's params may reach a D request sent beside P's through D's /v1/pd_kv_ready
    # (vllm#51919), where D serves it: the params are all D waits for.
    ready_notify: bool = False


TurnT = TypeVar("TurnT", contravariant=True)
# Where a handle sends P to read: (engine id, side-channel host, side-channel port).
Origin = tuple[str, str, int]
Changed = Callable[[], Awaitable[None]]


class Connector(Protocol[TurnT]):
    """One KV-transfer protocol. `TurnT` is router/turn/state.py's Turn (the seam sits below
    the turn, so it cannot name it)."""

    name: ConnectorName
    caps: Capabilities

    async def serve(self, turn: TurnT) -> Response:
        """The turn's legs, from placement to the response (which may still be streaming)."""
        ...

    def prefill_params(self, handle: Mapping[str, Any] | None) -> dict[str, Any]:
        """P's `kv_transfer_params`: D's claimed handle (a hit), or the null handoff."""
        ...

    def decode_params(self, prefilled: Mapping[str, Any] | None) -> dict[str, Any] | None:
        """D's `kv_transfer_params` from what P returned (None: D computes the prompt)."""
        ...

    def alone_params(self) -> dict[str, Any] | None:
        """What P's params are on a turn D runs alone (the decode plan), for decode_params."""
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

    def origin(self, params: Mapping[str, Any]) -> Origin | None:
        """The engine and side channel a handle makes P connect to (None: it names none)."""
        ...

    def prefill_failed(self, status: int, body: Mapping[str, Any] | None) -> bool:
        """Whether P's answer says it failed (and so refused a handle it was given)."""
        ...

    def release_request(
        self, handle: Mapping[str, Any], model: str
    ) -> tuple[dict[str, Any], str] | None:
        """P's body and path for a request that makes D free a handle's pinned blocks and
        reads nothing (None: this protocol pins nothing on D)."""
        ...

    def release_prefilled(
        self, prefilled: Mapping[str, Any], model: str
    ) -> tuple[dict[str, Any], str] | None:
        """A D request that frees what P pinned for a D that will never read it (None: P
        pins nothing for D, or these are not P's params)."""
        ...

    def pinned(self, handle: Mapping[str, Any]) -> PinSize:
        """What a handle D returned pins there: its blocks and tokens (0 and 0: nothing)."""
        ...

    async def inspect(
        self, engines: EngineClient, inst: Instance, model: str, timeout: float
    ) -> None:
        """Learn what the connector needs of a new instance (push: P's coordinates)."""
        ...

    def seed(self, url: str, role: Role, fields: Mapping[str, Any]) -> None:
        """The connector's fields of an admin add (the seeds' push coordinates); ValueError
        if they cannot be used."""
        ...

    def start(self, changed: Changed) -> list[Coroutine[Any, Any, None]]:
        """Background work for the app's lifetime (registration); `changed` re-syncs the
        pool when the instances it knows change."""
        ...

    def announced(self, role: Role) -> tuple[str, ...]:
        """Instances of `role` that announced themselves (added to the command line's)."""
        ...

    def instance_view(self, inst: Instance) -> dict[str, Any]:
        """/status: an instance's KV mode and what the connector knows of it."""
        ...

    def status(self) -> dict[str, Any]:
        """/status: the connector's own state (its registration, if any)."""
        ...


def prefill_failed(status: int, body: Mapping[str, Any] | None) -> bool:
    """P rejected the request: HTTP >= 400, an error body, or a choice that ended in "error"
    (vLLM's error shapes, whatever the connector)."""
    if status >= 400:
        return True
    if body is None:
        return False
    if isinstance(body.get("error"), Mapping) or body.get("status") == "failed":
        return True
    choices = body.get("choices")
    if not isinstance(choices, list):
        return False
    return any(isinstance(c, Mapping) and c.get("finish_reason") == "error" for c in choices)


def engine_id(params: Mapping[str, Any]) -> str | None:
    value = params.get("remote_engine_id")
    return value if isinstance(value, str) else None


def origin(params: Mapping[str, Any]) -> Origin | None:
    engine, host, port = (params.get(k) for k in ("remote_engine_id", "remote_host", "remote_port"))
    if not (isinstance(engine, str) and isinstance(host, str) and type(port) is int):
        return None
    return engine, host, port


class Defaults:
    """What a connector without a D->P handle, registration or coordinates does; each
    connector overrides what its protocol has."""

    name: ConnectorName

    def alone_params(self) -> dict[str, Any] | None:
        return None

    def truncate(
        self, params: Mapping[str, Any], num_tokens: int, block_size: int
    ) -> dict[str, Any]:
        raise ValueError(f"--kv-connector {self.name} keeps no handle to truncate")

    def is_handle(self, params: object) -> bool:
        return False  # what D returns is never read back by P

    def engine_id(self, params: Mapping[str, Any]) -> str | None:
        return engine_id(params)

    def origin(self, params: Mapping[str, Any]) -> Origin | None:
        return origin(params)

    def prefill_failed(self, status: int, body: Mapping[str, Any] | None) -> bool:
        return prefill_failed(status, body)

    def release_request(
        self, handle: Mapping[str, Any], model: str
    ) -> tuple[dict[str, Any], str] | None:
        return None  # D pins nothing for this protocol

    def release_prefilled(
        self, prefilled: Mapping[str, Any], model: str
    ) -> tuple[dict[str, Any], str] | None:
        return None

    def pinned(self, handle: Mapping[str, Any]) -> PinSize:
        return UNKNOWN_SIZE

    async def inspect(
        self, engines: EngineClient, inst: Instance, model: str, timeout: float
    ) -> None:
        return None

    def seed(self, url: str, role: Role, fields: Mapping[str, Any]) -> None:
        return None  # a connector without such fields ignores them

    def start(self, changed: Changed) -> list[Coroutine[Any, Any, None]]:
        return []

    def announced(self, role: Role) -> tuple[str, ...]:
        return ()

    def instance_view(self, inst: Instance) -> dict[str, Any]:
        return {"mode": self.name.value}

    def status(self) -> dict[str, Any]:
        return {"kv_connector": self.name.value}
