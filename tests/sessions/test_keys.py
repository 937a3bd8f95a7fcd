"""Key names are a public contract (redis-cli users and other tools read them)."""

from __future__ import annotations

import pytest

from sessions.keys import CONVERSATION_PREFIX, conversation_key


def test_conversation_key_layout() -> None:
    assert conversation_key("t1", "abc-123") == "kvbaton:conv:{t1:abc-123}"
    assert conversation_key("default", "x").startswith(CONVERSATION_PREFIX)


@pytest.mark.parametrize(("tenant", "conv"), [("t{", "x"), ("t", "a}b"), ("t", "{x}")])
def test_braces_are_refused(tenant: str, conv: str) -> None:
    with pytest.raises(ValueError, match="braces"):
        conversation_key(tenant, conv)
