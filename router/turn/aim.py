"""Where a stored handle sends P: only to a side channel its D announced itself (issue 32)."""

from __future__ import annotations

from router.services import Services
from sessions import integrity
from sessions.model import SessionState


def aims_at_its_d(svc: Services, key: str, state: SessionState) -> bool:
    """Whether the state's handle names the engine id, side-channel host and port of the D the
    state records, as that D announced them: in its own answers to this process, or in a state
    signed with our secret (a router that had D's answer wrote it). Anything else, such as an
    unsigned handle edited in Redis, could make P connect to any address: it is never sent to
    a P, not for a read and not for a release."""
    params = state.kv_transfer_params
    inst = svc.pool.find("decode", state.decode) if params is not None else None
    origin = svc.connector.origin(params) if params is not None else None
    if inst is None or origin is None:
        return False
    if origin in inst.ident.origins:  # the common case: no second HMAC on the turn's path
        return True
    secrets = svc.settings.session_secrets
    if secrets and integrity.authentic(secrets, key, state):
        inst.ident.note_origin(origin)
        return True
    return False
