"""Isolation and secrecy: conversations are scoped by tenant (bearer token or --tenant-header),
client-supplied kv_transfer_params never reach an engine, and neither responses nor INFO logs
carry handles or engine side-channel addresses."""

from __future__ import annotations

import json
import socket
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis

from harness.chat import JSON, Reply, chat_body, post
from tests.reliability.conftest import ENGINE_KEY, TENANT_HEADER, Stack
from tests.reliability.helpers import Conversation, new_cid, reference, router, total


def bearer(token: str) -> dict[str, str]:
    return {**JSON, "Authorization": f"Bearer {token}"}


def intruder(owner: Conversation, headers: dict[str, str]) -> Reply:
    """Another client replays the owner's conversation (same id, same history) and asks on."""
    messages = [*owner.messages, {"role": "user", "content": "What did I ask before?"}]
    reply = post(
        owner.router + "/v1/chat/completions", chat_body(messages, cid=owner.cid), headers=headers
    )
    assert reply.status == 200
    assert reply.answer() == reference(owner.ref, messages)
    return reply


def test_tenants_never_share_a_handle_by_bearer_token(main: Stack) -> None:
    token_a, token_b = f"sk-a-{uuid.uuid4().hex}", f"sk-b-{uuid.uuid4().hex}"
    owner = Conversation(main.url, main.ref, new_cid("tenant"), headers=bearer(token_a))
    assert owner.turn().reuse == "miss;reason=no-session"
    assert intruder(owner, bearer(token_b)).reuse == "miss;reason=no-session"
    assert intruder(owner, dict(JSON)).reuse == "miss;reason=no-session"  # no credentials
    assert intruder(owner, bearer(token_a + " ")).reuse == "hit"  # the same token, padded
    owner.turn()
    # The owner's handle went to the owner's own replay above; the next turn hits again.
    assert owner.turn().reuse == "hit"
    client = redis.Redis.from_url(main.redis_url, decode_responses=True)
    try:
        keys = client.keys(f"kvbaton:conv:{{*:{owner.cid}}}")
        assert len(keys) == 3  # token A, token B, and the default tenant
        dump = json.dumps([client.hgetall(k) for k in keys]) + " ".join(keys)
    finally:
        client.close()
    assert token_a not in dump and token_b not in dump, "tokens are hashed, never stored"


def test_tenant_header_scopes_conversations(main: Stack) -> None:
    shared = bearer("sk-shared-gateway-key")
    alpha = Conversation(
        main.url, main.ref, new_cid("hdr"), headers={**shared, TENANT_HEADER: "alpha"}
    )
    assert alpha.turn().reuse == "miss;reason=no-session"
    assert intruder(alpha, {**shared, TENANT_HEADER: "beta"}).reuse == "miss;reason=no-session"
    # A bearer token equal to the header value is another tenant (hashed apart).
    assert intruder(alpha, bearer("alpha")).reuse == "miss;reason=no-session"
    assert alpha.turn().reuse == "hit"


def test_engine_credentials_come_from_config_not_from_the_client(stack: Stack) -> None:
    """The shared engines need a key. The shared router sends it from --engine-api-key whatever
    the client sends; a router without it does not pass on the client's token, even when that
    token is the engines' key."""
    messages = [{"role": "user", "content": f"Who am I? {uuid.uuid4().hex}"}]
    body = chat_body(messages)
    with_key = post(stack.url + "/v1/chat/completions", body, headers=bearer("client-token"))
    assert with_key.status == 200 and with_key.answer() == reference(stack.ref, messages)
    ps, ds = [p.url for p in stack.ps], [d.url for d in stack.ds]
    # No start-up check: it would find every engine refusing /v1/models and route nothing.
    args = ("--no-check-models", "--model", "sim-model", "--block-size", "16")
    with router(ps, ds, *args, redis_url=stack.redis_url, name="rel-keyless") as keyless:
        reply = post(keyless.url + "/v1/chat/completions", body, headers=bearer(ENGINE_KEY))
    assert reply.status == 401, reply.body[:200]  # the engine refused: no key was forwarded


@pytest.fixture
def trap() -> Iterator[socket.socket]:
    """A listening socket nobody should connect to: the address in the forged params."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        sock.setblocking(False)
        yield sock


def forged(port: int) -> dict[str, Any]:
    """A D-style handle an engine would read at once: one block from 127.0.0.1:port."""
    return {
        "do_remote_prefill": False,
        "do_remote_decode": True,
        "remote_engine_id": "attacker-engine",
        "remote_block_ids": [[1]],
        "remote_request_id": "chatcmpl-victim-00000000",
        "remote_host": "127.0.0.1",
        "remote_port": port,
        "remote_num_tokens": 16,
        "tp_size": 1,
    }


def connected(sock: socket.socket) -> bool:
    try:
        conn, _ = sock.accept()
    except BlockingIOError:
        return False
    conn.close()
    return True


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_client_kv_transfer_params_never_reach_an_engine(
    main: Stack, trap: socket.socket, stream: bool
) -> None:
    port = trap.getsockname()[1]
    engines = [*main.engines, main.ref]
    failed = total(engines, "vllm:nixl_num_failed_transfers_total")
    failed += total(engines, "vllm:nixl_num_failed_notifications_total")
    conv = Conversation(main.url, main.ref, new_cid("forged"))
    first = conv.turn(stream=stream, kv_transfer_params=forged(port))
    assert first.reuse == "miss;reason=no-session"
    assert conv.turn(stream=stream, kv_transfer_params=forged(port)).reuse == "hit"
    prompt = f"Rain in {conv.nonce}"
    body = {"model": "sim-model", "prompt": prompt, "max_tokens": 4}
    completion = post(main.url + "/v1/completions", {**body, "kv_transfer_params": forged(port)})
    assert completion.status == 200
    assert completion.answer() == post(main.ref.url + "/v1/completions", body).answer()
    assert not connected(trap), "an engine dialled the forged side-channel address"
    after = total(engines, "vllm:nixl_num_failed_transfers_total")
    after += total(engines, "vllm:nixl_num_failed_notifications_total")
    assert after == failed


FORBIDDEN = (
    b"kv_transfer_params",
    b"remote_block_ids",
    b"remote_engine_id",
    b"remote_request_id",
    b"remote_host",
    b"remote_port",
)


def leaks(main: Stack, data: bytes) -> list[bytes]:
    secrets = [*FORBIDDEN, *(e.engine_id.encode() for e in main.engines)]
    # vLLM 0.33's own `"kv_transfer_params":null` in each content chunk names nothing: it
    # passes as D sent it (only a handle is stripped).
    data = data.replace(b'"kv_transfer_params":null', b"")
    return [s for s in secrets if s in data]


@pytest.mark.parametrize(
    ("path", "stream", "extra"),
    [
        ("/v1/chat/completions", False, {}),
        ("/v1/chat/completions", True, {}),
        ("/v1/chat/completions", True, {"stream_options": {"include_usage": True}}),
        ("/v1/chat/completions", False, {"return_token_ids": True}),
        ("/v1/completions", False, {}),
        ("/v1/completions", True, {"return_token_ids": True}),
    ],
    ids=["chat-json", "chat-sse", "chat-sse-usage", "chat-token-ids", "cmpl-json", "cmpl-sse"],
)
def test_responses_never_carry_handles_or_addresses(
    main: Stack, path: str, stream: bool, extra: dict[str, Any]
) -> None:
    cid = new_cid("leak")
    for turn in range(2):  # a miss, then a hit: D's handle is in its final chunk both times
        body: dict[str, Any] = {"model": "sim-model", "max_tokens": 6, "stream": stream, **extra}
        if path.endswith("completions") and "chat" not in path:
            body["prompt"] = f"Weather report {cid} part {turn}"
        else:
            body["messages"] = [{"role": "user", "content": f"Weather? {cid} {turn}"}]
        body["conversation_id"] = cid
        reply = post(main.url + path, body)
        assert reply.status == 200
        assert leaks(main, reply.body) == []
        assert leaks(main, json.dumps(dict(reply.headers)).encode()) == []
        if stream:
            events = reply.events()
            assert events[-1] == b"[DONE]" and len(events) > 2
            for event in events:
                assert leaks(main, event) == []


def test_router_logs_hold_no_handles_or_addresses(main: Stack) -> None:
    """INFO logs (the router's own log file) never name a handle, its blocks or D's side channel."""
    token = f"sk-log-{uuid.uuid4().hex}"
    conv = Conversation(main.url, main.ref, new_cid("logs"), headers=bearer(token))
    handles: list[dict[str, Any]] = []
    client = redis.Redis.from_url(main.redis_url, decode_responses=True)
    try:
        for _ in range(3):
            conv.turn(stream=conv.turns % 2 == 1)
            key = client.keys(f"kvbaton:conv:{{*:{conv.cid}}}")[0]
            handles.append(json.loads(client.hget(key, "kv_transfer_params") or "null"))
    finally:
        client.close()
    log = main.log.read_text(errors="replace")
    assert "turn request_id=" in log
    for handle in handles:
        assert handle is not None
        for value in (handle["remote_request_id"], handle["remote_engine_id"]):
            assert value not in log
        assert f":{handle['remote_port']}" not in log
        assert f"remote_port={handle['remote_port']}" not in log
    for word in ("kv_transfer_params", "remote_block_ids", "remote_request_id", "remote_port"):
        assert word not in log
    for engine in main.engines:
        assert f":{engine.kv_port}" not in log
    assert token not in log
