"""Key names are a public contract (redis-cli users and other tools read them)."""

from __future__ import annotations

import pytest

from sessions.keys import CONVERSATION_PREFIX, PINS_PREFIX, conversation_key, pins_key


def test_conversation_key_layout() -> None:
    assert conversation_key("t1", "abc-123") == "kvbaton:conv:{t1:abc-123}"
    assert conversation_key("default", "x").startswith(CONVERSATION_PREFIX)


@pytest.mark.parametrize(("tenant", "conv"), [("t{", "x"), ("t", "a}b"), ("t", "{x}")])
def test_braces_are_refused(tenant: str, conv: str) -> None:
    with pytest.raises(ValueError, match="braces"):
        conversation_key(tenant, conv)


def test_pins_key_layout() -> None:
    assert pins_key("http://10.0.0.21:8200") == "kvbaton:pins:{http://10.0.0.21:8200}"
    assert pins_key("https://d/v1").startswith(PINS_PREFIX)


@pytest.mark.parametrize("decode", ["", "http://d{1}:8000", "http://d:8000/}"])
def test_pins_key_refuses_braces_and_nothing(decode: str) -> None:
    with pytest.raises(ValueError, match="braces"):
        pins_key(decode)
