"""Where a handle sends P: only to the side channel its D showed it owns (issues 32 and 50).
Each D's side channel is pinned per rank from its first handle; a later answer naming another
address is refused unless D is seen to have restarted."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from router.engines.metrics_read import read_started
from router.engines.pool import Instance
from router.services import Services
from sessions import integrity
from sessions.model import SessionState


def aims_at_its_d(svc: Services, key: str, state: SessionState) -> bool:
    """Whether the state's handle names the engine id, side-channel host and port pinned for
    the D the state records: from its own answers to this process, or from a state signed with
    our secret (a router that admitted D's answer wrote it) while this process has no other
    address for that rank. Anything else, such as an unsigned handle edited in Redis, could
    make P connect to any address: it is never sent to a P, not for a read and not for a
    release."""
    params = state.kv_transfer_params
    inst = svc.pool.find("decode", state.decode) if params is not None else None
    origin = svc.connector.origin(params) if params is not None else None
    if inst is None or origin is None:
        return False
    if inst.ident.owns(origin):  # the common case: no second HMAC on the turn's path
        return True
    secrets = svc.settings.session_secrets
    return bool(secrets) and integrity.authentic(secrets, key, state) and inst.ident.admit(origin)


async def d_owns(svc: Services, inst: Instance, params: Mapping[str, Any] | None) -> bool:
    """Whether D's new handle names a side channel D may claim: the one pinned for its rank,
    or a first one. Another address is believed only once D's /metrics shows a new process
    (a restart forgets what was pinned): asked at once, so a restart costs no turn. A refused
    handle is not kept, and not released either (that would send P there)."""
    if params is None:  # (next_state checks that it is a handle: not walked twice here)
        return True
    origin = svc.connector.origin(params)
    if origin is None:
        return True  # it names no side channel: never sent to a P (aims_at_its_d)
    if not inst.ident.admissible(origin):
        await read_started(svc.engines, inst, svc.settings.health_interval)
    if inst.ident.admit(origin):
        return True
    svc.metrics.moved_handles.labels(inst.url).inc()
    return False
