"""Tenant hashing and conversation id validation."""

from __future__ import annotations

import re

import pytest

from router.errors import BadRequest
from router.turn.tenant import tenant_of, validate_conversation_id

HEX16 = re.compile(r"[0-9a-f]{16}")


@pytest.mark.parametrize(
    ("authorization", "header"),
    [
        (None, None),
        ("", None),
        ("Bearer ", None),
        ("Bearer    ", ""),
    ],
)
def test_default_tenant(authorization: str | None, header: str | None) -> None:
    assert tenant_of(authorization, header) == "default"


@pytest.mark.parametrize(
    ("authorization", "header", "same_as"),
    [
        ("Bearer sk-abc", None, ("Bearer sk-abc", None)),
        ("bearer sk-abc", None, ("Bearer sk-abc", None)),  # scheme is case-insensitive
        ("Bearer  sk-abc ", None, ("Bearer sk-abc", None)),
        ("Bearer sk-other", "team-a", (None, "team-a")),  # the header wins over the token
        ("Basic dXNlcjpw", None, ("Basic dXNlcjpw", None)),
    ],
)
def test_tenant_is_a_stable_hash(
    authorization: str | None, header: str | None, same_as: tuple[str | None, str | None]
) -> None:
    tenant = tenant_of(authorization, header)
    assert HEX16.fullmatch(tenant)
    assert tenant == tenant_of(*same_as)
    for secret in (authorization or "", header or ""):
        token = secret.split()[-1] if secret.split() else ""
        assert not token or token not in tenant


def test_distinct_secrets_give_distinct_tenants() -> None:
    tenants = {tenant_of(f"Bearer key-{i}") for i in range(200)}
    tenants |= {tenant_of(None, f"key-{i}") for i in range(3)}
    assert len(tenants) == 203  # a header value never lands in the tenant of an equal token
    assert tenant_of("Bearer a") != tenant_of("Bearer b")


@pytest.mark.parametrize(
    "value",
    ["a", "conv-1", "A.b_c:d@e/f+g=h-i", "0" * 128, "user@example.com/chat:42", "===="],
)
def test_valid_conversation_ids(value: str) -> None:
    assert validate_conversation_id(value) == value


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("", "1 to 128"),
        ("x" * 129, "1 to 128"),
        ("a b", "1 to 128"),
        ("{tag}", "1 to 128"),
        ("a}", "1 to 128"),
        ("a*", "1 to 128"),
        ("a\n", "1 to 128"),
        ("a\x00b", "1 to 128"),
        ("a\tb", "1 to 128"),
        ("café", "1 to 128"),
        (None, "must be a string, not NoneType"),
        (42, "must be a string, not int"),
        (["a"], "must be a string, not list"),
        (True, "must be a string, not bool"),
    ],
)
def test_invalid_conversation_ids(value: object, fragment: str) -> None:
    with pytest.raises(BadRequest) as info:
        validate_conversation_id(value)
    assert info.value.param == "conversation_id"
    assert info.value.status == 400
    assert fragment in info.value.message
