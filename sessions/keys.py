"""Every Redis key name kvbaton uses, in one place (a public contract: see docs/architecture.md)."""

from __future__ import annotations

CONVERSATION_PREFIX = "kvbaton:conv:"


def conversation_key(tenant: str, conversation_id: str) -> str:
    """`kvbaton:conv:{<tenant>:<conversation_id>}`; the braces are a Redis Cluster hash tag."""
    if "{" in tenant or "}" in tenant or "{" in conversation_id or "}" in conversation_id:
        # A brace inside would move the hash tag and split one conversation across slots.
        raise ValueError("tenant and conversation id must not contain braces")
    return f"{CONVERSATION_PREFIX}{{{tenant}:{conversation_id}}}"
