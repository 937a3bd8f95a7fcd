"""Who is asking and about which conversation: tenant hashing and conversation id validation."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping

from router.errors import BadRequest

DEFAULT_TENANT = "default"
MAX_CONVERSATION_ID = 128
# No braces (the Redis Cluster hash tag in kvbaton:conv:{tenant:id}), spaces, `*` or controls.
_CONVERSATION_ID = re.compile(r"[A-Za-z0-9._:@/+=-]{1,128}")


def _digest(value: str, person: bytes) -> str:
    # Personalised per source, so a bearer token chosen equal to another tenant's header
    # value does not land in that tenant, and no other hash of the secret matches.
    return hashlib.blake2b(value.encode(), digest_size=8, person=person).hexdigest()


def tenant_of(authorization: str | None, tenant_header_value: str | None = None) -> str:
    """A 16-hex-char hash of the configured tenant header's value, else of the bearer token.

    "default" when neither is present. The token itself is never returned or stored.
    """
    if tenant_header_value:
        return _digest(tenant_header_value, b"kvbaton-header")
    if authorization:
        scheme, _, token = authorization.strip().partition(" ")
        secret = token.strip() if scheme.lower() == "bearer" else authorization.strip()
        if secret:
            return _digest(secret, b"kvbaton-token")
    return DEFAULT_TENANT


def tenant_of_headers(headers: Mapping[str, str], tenant_header: str) -> str:
    """A request's tenant: `tenant_of` its Authorization and its --tenant-header value."""
    value = headers.get(tenant_header) if tenant_header else None
    return tenant_of(headers.get("authorization"), value)


def validate_conversation_id(value: object) -> str:
    """The conversation id, or BadRequest: a str of 1..128 chars from [A-Za-z0-9._:@/+=-]."""
    if not isinstance(value, str):
        raise BadRequest(
            f"conversation_id must be a string, not {type(value).__name__}",
            param="conversation_id",
        )
    if not _CONVERSATION_ID.fullmatch(value):
        raise BadRequest(
            f"conversation_id must be 1 to {MAX_CONVERSATION_ID} characters from "
            "A-Z a-z 0-9 . _ : @ / + = -",
            param="conversation_id",
        )
    return value


def conversation_hash(key: str | None) -> str:
    """A short stable name for a conversation in logs (never the id or the tenant)."""
    if key is None:
        return "-"
    return hashlib.blake2b(key.encode(), digest_size=6).hexdigest()
