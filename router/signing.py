"""Session signing at start: a router on a shared store signs its sessions unless told not to."""

from __future__ import annotations

import secrets

import msgspec

from router.config import Settings
from router.errors import ConfigError

NEEDS_SECRET = (
    "--session-store redis needs a session secret: without one, anyone who can write to Redis "
    "can change a stored handle and make P read wrong KV. Make one with `python3 -c 'import "
    "secrets; print(secrets.token_urlsafe(32))'` (or `openssl rand -base64 32`) and set it as "
    "KVBATON_SESSION_SECRET (or --session-secret), the same on every replica; or run unsigned "
    "on purpose with --unsigned-sessions"
)


def signed(settings: Settings) -> Settings:
    """The settings a router starts with: a shared store (Redis) needs a session secret unless
    the operator said --unsigned-sessions; the memory store, which no other process reads,
    signs with a secret of its own. Called once, before anything starts (`kvbaton serve`)."""
    if settings.session_secrets or settings.unsigned_sessions:
        return settings
    if settings.session_store == "memory":
        return msgspec.structs.replace(settings, session_secret=secrets.token_urlsafe(32))
    raise ConfigError(NEEDS_SECRET)
