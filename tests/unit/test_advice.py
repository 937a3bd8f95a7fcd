"""What start-up says about a misconfiguration: the Redis URL with its password masked, the
fix for an engine URL ending in /v1."""

from __future__ import annotations

import pytest

from router.config import load_settings
from router.lifecycle.advice import masked, store_guard, v1_hint


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:pw@redis:6379/0", "redis://:***@redis:6379/0"),
        ("rediss://user:p%40ss@host:1/2", "rediss://user:***@host:1/2"),
    ],
)
def test_the_password_is_masked(url: str, shown: str) -> None:
    assert masked(url) == shown


@pytest.mark.parametrize(
    ("url", "hint"),
    [
        ("http://p:8100/v1", "drop the /v1 suffix: the engine's base URL is http://p:8100"),
        ("http://p:8100/v1/", "drop the /v1 suffix: the engine's base URL is http://p:8100"),
        ("http://p:8100", ""),
        ("http://p:8100/v10", ""),
    ],
)
def test_a_v1_suffix_gets_the_url_to_give(url: str, hint: str) -> None:
    assert v1_hint(url) == hint


def test_the_guard_names_redis_and_its_flag_but_not_the_memory_store() -> None:
    urls = ["--prefill", "http://p:1", "--decode", "http://d:1", "--unsigned-sessions"]
    on_redis = store_guard(load_settings([*urls, "--redis-url", "redis://:pw@r:1/0"], env={}))
    assert on_redis.name == "Redis at redis://:***@r:1/0"
    assert "--redis-url / KVBATON_REDIS_URL" in on_redis.hint
    in_memory = store_guard(load_settings([*urls, "--session-store", "memory"], env={}))
    assert (in_memory.name, in_memory.hint) == ("session store", "")
