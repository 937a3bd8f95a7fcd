"""Session state read back from Redis is checked before any read (issue 22, finding 1): a
handle or digest changed outside the router is a miss with its own reason and the oracle's
answer, never a read of wrong KV, and nobody else's prefix cache is poisoned."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import redis

from tests.reliability.conftest import ROUTER_FLAGS, SESSION_SECRET, Stack
from tests.reliability.helpers import JSON, Conversation, new_cid, router

Edit = Callable[[dict[str, Any], Stack], dict[str, str]]


def _params(edit: Callable[[dict[str, Any]], None]) -> Edit:
    def fields(params: dict[str, Any], _: Stack) -> dict[str, str]:
        edit(params)
        return {"kv_transfer_params": json.dumps(params)}

    return fields


def _blocks_plus_one(p: dict[str, Any]) -> None:
    p["remote_block_ids"] = [[b + 1 for b in g] for g in p["remote_block_ids"]]


EDITS: dict[str, Edit] = {
    "block-ids+1": _params(_blocks_plus_one),
    "num-tokens-100000": _params(lambda p: p.update(remote_num_tokens=100000)),
    "num-tokens-string": _params(lambda p: p.update(remote_num_tokens="12")),
    "garbage": lambda p, s: {"kv_transfer_params": json.dumps({"remote_block_ids": "x"})},
    "other-decode": lambda p, s: {"decode": s.ds[1].url if p["remote_port"] else s.ds[0].url},
    "digest": lambda p, s: {"prefix_digest": "0" * 32},
}


def tamper(redis_url: str, cid: str, edit: Edit, stack: Stack) -> dict[str, str]:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        (key,) = client.keys(f"kvbaton:conv:{{*:{cid}}}")
        state = client.hgetall(key)
        fields = edit(json.loads(state["kv_transfer_params"]), stack)
        if "decode" in fields:  # the handle pointed at the D that does not hold it
            fields["decode"] = next(d.url for d in stack.ds if d.url != state["decode"])
        client.hset(key, mapping=fields)
        return state
    finally:
        client.close()


@pytest.mark.parametrize("edit", list(EDITS), ids=list(EDITS))
def test_a_tampered_session_is_a_miss_and_poisons_nobody(main: Stack, edit: str) -> None:
    owner = Conversation(main.url, main.ref, new_cid("tamper"))
    owner.turn()
    assert owner.turn().reuse == "hit"
    assert owner.cid is not None
    tamper(main.redis_url, owner.cid, EDITS[edit], main)
    # The oracle's answer (checked by turn()), and no read: the MAC no longer matches.
    assert owner.turn().reuse == "miss;reason=handle-unauthenticated"
    # Another tenant, no conversation id, the same history: answers right (P's cache is clean).
    other = Conversation(main.url, main.ref, None, nonce=owner.nonce)
    other.headers = {**JSON, "Authorization": "Bearer another-tenant"}
    other.messages = [dict(m) for m in owner.messages[:-1]]
    other.turns = owner.turns - 1
    other.turn()
    assert owner.turn().reuse == "hit", "the turn after the miss committed a signed state"


def test_without_a_secret_the_handle_checks_still_refuse_a_malformed_handle(main: Stack) -> None:
    flags = [f for f in ROUTER_FLAGS if f not in ("--session-secret", SESSION_SECRET)]
    flags.append("--unsigned-sessions")
    ps, ds = [p.url for p in main.ps], [d.url for d in main.ds]
    with router(ps, ds, *flags, redis_url=main.redis_url, name="rel-unsigned") as r:
        conv = Conversation(r.url, main.ref, new_cid("unsigned"))
        conv.turn()
        assert conv.cid is not None
        for edit in ("garbage", "num-tokens-100000", "num-tokens-string"):
            tamper(main.redis_url, conv.cid, EDITS[edit], main)
            assert conv.turn().reuse == "miss;reason=handle-invalid", edit
