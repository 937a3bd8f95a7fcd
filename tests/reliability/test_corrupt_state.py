"""A conversation whose Redis key was tampered with or holds garbage (issue 22, finding 2): its
own turn misses (`corrupt-state`), the key is dropped and rewritten by that turn's commit, and
nobody else loses reuse (it used to open the store's breaker for every conversation, again on
each of that conversation's turns, until the key expired)."""

from __future__ import annotations

import pytest
import redis

from tests.reliability.conftest import Stack
from tests.reliability.helpers import Conversation, get_json, new_cid, session


def corrupt(redis_url: str, cid: str, **fields: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        (key,) = client.keys(f"kvbaton:conv:{{*:{cid}}}")
        if fields:
            client.hset(key, mapping=dict(fields.items()))
        else:
            client.delete(key)
            client.set(key, "not a hash")
    finally:
        client.close()


@pytest.mark.parametrize(
    "fields",
    [{"turn": "abc"}, {"token_count": "-3"}, {"handle_expires_at": "nan"}, {}],
    ids=["turn", "token-count", "expiry", "wrong-type"],
)
def test_a_corrupt_key_is_that_conversation_s_miss_only(
    main: Stack, fields: dict[str, str]
) -> None:
    bad = Conversation(main.url, main.ref, new_cid("corrupt"))
    good = Conversation(main.url, main.ref, new_cid("healthy"))
    bad.turn()
    good.turn()
    assert bad.cid is not None
    corrupt(main.redis_url, bad.cid, **fields)
    assert bad.turn().reuse == "miss;reason=corrupt-state"  # the oracle's answer all the same
    assert good.turn().reuse == "hit", "the store stays in use for everyone else"
    assert not get_json(main.url + "/status")["store"]["circuit_open"]
    assert session(main.redis_url, bad.cid)["turn"] == "1", "rewritten by that turn's commit"
    assert bad.turn().reuse == "hit"
