"""Admin API on conversations against real processes (Redis store, JSON logs): look up without
the raw handle, delete, list by decode instance with SCAN paging; the redis-cli recipes of
docs/operations.md; the router's log lines parse as JSON."""

from __future__ import annotations

import json
import urllib.parse
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from harness.procs import SimProc
from harness.router import RouterProc
from router.turn.tenant import tenant_of
from tests.ops.conftest import call, chat, log_path, ops_router

TAG = "conversations"


@pytest.fixture(scope="module")
def r(p: SimProc, d: SimProc, d2: SimProc, ops_redis: str) -> Iterator[RouterProc]:
    with ops_router(p, [d, d2], "--log-format", "json", redis_url=ops_redis, tag=TAG) as proc:
        yield proc


@pytest.fixture(scope="module")
def conversations(r: RouterProc) -> list[str]:
    """Six one-turn conversations of the default tenant, spread over d and d2."""
    ids = [f"ops-c{i}-{uuid.uuid4().hex[:6]}" for i in range(6)]
    for cid in ids:
        assert chat(r.url, cid, "Hello, how is the weather?") == (200, "miss;reason=no-session")
    return ids


def get(r: RouterProc, path: str) -> tuple[int, Any]:
    return call("GET", r.url + path)


def test_get_shows_the_state_without_the_handle(
    r: RouterProc, conversations: list[str], d: SimProc, d2: SimProc, ops_redis: str
) -> None:
    cid = conversations[0]
    code, body = get(r, f"/admin/conversations/{cid}")
    assert code == 200
    assert body["conversation_id"] == cid and body["tenant"] == "default"
    assert body["key"] == f"kvbaton:conv:{{default:{cid}}}"
    assert body["turn"] == 1 and body["api"] == "chat"
    assert body["decode"] in (d.url, d2.url)
    handle = body["handle"]
    assert handle["present"] is True and handle["tokens"] > 0
    assert 0 < handle["expires_in_s"] <= 450 and handle["claimed_by"] == ""
    assert 0 < body["ttl_s"] <= 3600
    assert body["created_at"] > 0 and body["updated_at"] >= body["created_at"]
    raw = redis.Redis.from_url(ops_redis).hget(body["key"], "kv_transfer_params")
    assert raw and b"remote_block_ids" in raw
    text = json.dumps(body)
    assert "remote_block_ids" not in text and "kv_transfer_params" not in text


def test_tenant_scoped_lookup(r: RouterProc) -> None:
    cid = f"ops-tenant-{uuid.uuid4().hex[:6]}"
    assert chat(r.url, cid, "Hi from a tenant", bearer="tenant-token")[0] == 200
    assert get(r, f"/admin/conversations/{cid}")[0] == 404
    tenant = tenant_of("Bearer tenant-token")
    code, body = get(r, f"/admin/conversations/{cid}?tenant={tenant}")
    assert code == 200 and body["tenant"] == tenant
    assert get(r, f"/admin/conversations/{cid}?tenant=a{{b")[0] == 400
    assert get(r, "/admin/conversations/bad%20id")[0] == 400


def test_delete_forgets_the_conversation(r: RouterProc, conversations: list[str]) -> None:
    cid = conversations[-1]
    code, body = call("DELETE", r.url + f"/admin/conversations/{cid}")
    assert code == 200 and body["deleted"] is True
    assert get(r, f"/admin/conversations/{cid}")[0] == 404
    assert call("DELETE", r.url + f"/admin/conversations/{cid}")[0] == 404
    assert chat(r.url, cid, "Hello again")[1] == "miss;reason=no-session"


def walk(r: RouterProc, path: str, count: int) -> list[dict[str, Any]]:
    """Every page of a listing, following the cursor to "0"."""
    found: list[dict[str, Any]] = []
    cursor = "0"
    for _ in range(1000):
        sep = "&" if "?" in path else "?"
        code, page = get(r, f"{path}{sep}count={count}&cursor={cursor}")
        assert code == 200
        found += page["conversations"]
        cursor = page["cursor"]
        assert page["complete"] == (cursor == "0")
        if cursor == "0":
            return found
    raise AssertionError("the listing never completed")


def test_list_by_decode_instance(
    r: RouterProc, conversations: list[str], d: SimProc, d2: SimProc
) -> None:
    by_decode: dict[str, set[str]] = {}
    for cid in conversations:
        by_decode.setdefault(get(r, f"/admin/conversations/{cid}")[1]["decode"], set()).add(cid)
    for url in (d.url, d2.url):
        mine = by_decode.get(url, set())
        listed = walk(r, "/admin/conversations?decode=" + urllib.parse.quote(url, safe=""), 2)
        assert mine <= {c["conversation_id"] for c in listed}
        assert all(c["decode"] == url for c in listed)
        assert all(set(c) >= {"tenant", "key", "turn", "has_handle", "token_count"} for c in listed)
        encoded = urllib.parse.quote(url, safe="")
        same = walk(r, f"/admin/decode/{encoded}/conversations", 100)
        assert {c["key"] for c in same} == {c["key"] for c in listed}
    everything = {c["conversation_id"] for c in walk(r, "/admin/conversations", 3)}
    assert set(conversations[:-1]) <= everything
    assert get(r, "/admin/conversations?count=0")[0] == 400
    assert get(r, "/admin/conversations?cursor=x")[0] == 400


def test_redis_cli_recipes_find_and_read_a_conversation(
    conversations: list[str], ops_redis: str
) -> None:
    """docs/operations.md: --scan --pattern 'kvbaton:conv:{*:ID}', HGETALL, TTL."""
    client = redis.Redis.from_url(ops_redis, decode_responses=True)
    cid = conversations[1]
    (key,) = list(client.scan_iter(match=f"kvbaton:conv:{{*:{cid}}}"))
    fields = client.hgetall(key)
    assert fields["turn"] == "1" and fields["decode"].startswith("http://")
    assert 0 < client.ttl(key) <= 3600


def test_log_lines_are_json_with_structured_turns(r: RouterProc, conversations: list[str]) -> None:
    log = log_path(TAG)
    lines = [ln for ln in log.read_text().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]
    for rec in records:
        assert set(rec) >= {"ts", "level", "logger", "message"}
    turns = [rec["turn"] for rec in records if rec["logger"] == "kvbaton.turn" and "turn" in rec]
    assert len(turns) >= len(conversations)
    first = turns[0]
    assert first["p"].startswith("http://") and first["d"].startswith("http://")
    assert first["reuse"] == "miss;reason=no-session"
    assert isinstance(first["e2e_ms"], float) and isinstance(first["prompt_tokens"], int)
    assert first["result"] == "committed"
    assert any(rec["logger"] == "hypercorn.error" for rec in records)
    assert "weather" not in log.read_text()
