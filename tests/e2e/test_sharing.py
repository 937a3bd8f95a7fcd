"""Single use under concurrency, and two router replicas sharing one Redis."""

from __future__ import annotations

import uuid
from concurrent.futures import ThreadPoolExecutor

import redis

from harness.chat import chat_turn, client
from harness.router import router
from sessions.model import conversation_digest
from tests.e2e.conftest import Stack, post_json, reference_chat


def test_concurrent_turns_use_the_handle_at_most_once(stack: Stack) -> None:
    cid = f"race-{uuid.uuid4().hex[:8]}"
    api = client(stack.router.base_url)
    messages = [{"role": "user", "content": "Describe the rain on the hills."}]
    answer, _, _ = chat_turn(api, messages, stream=False, cid=cid)
    follow = [*messages, {"role": "assistant", "content": answer}]

    def turn(i: int) -> tuple[str, str, list[dict[str, str]]]:
        msgs = [*follow, {"role": "user", "content": f"Variant {i}: and the tea?"}]
        text, reuse, _ = chat_turn(client(stack.router.base_url), msgs, stream=False, cid=cid)
        return text, reuse, msgs

    # D stalls before its first byte, so all four turns claim before any of them commits.
    post_json(stack.d.url + "/sim/faults", {"stall_s": 0.5, "stall_next": 4})
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(turn, range(4)))
    reuses = [r for _, r, _ in results]
    # The first claim takes the handle; the other three find the turn in flight.
    assert sorted(reuses) == ["hit", *["miss;reason=busy"] * 3], reuses
    for text, _, msgs in results:
        assert text == reference_chat(stack, msgs, 24)
    r = redis.Redis.from_url(stack.redis_url, decode_responses=True)
    (key,) = r.keys(f"kvbaton:conv:{{*:{cid}}}")
    assert r.hget(key, "turn") == "2"  # exactly one of the four turns committed on turn 1
    assert r.hget(key, "inflight") == ""
    committed = r.hget(key, "prompt_digest")
    digests = [conversation_digest("chat", msgs) for _, _, msgs in results]
    assert committed in digests
    r.close()


def test_two_routers_share_sessions(stack: Stack) -> None:
    with router(
        [stack.p.url],
        [stack.d.url],
        "--stream-kv-params",
        redis_url=stack.redis_url,
        name="router-b",
    ) as second:
        cid = f"pair-{uuid.uuid4().hex[:8]}"
        messages = [{"role": "user", "content": "What about the weather at sea?"}]
        answer, reuse, _ = chat_turn(client(stack.router.base_url), messages, stream=False, cid=cid)
        assert reuse == "miss;reason=no-session"
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": "And on land?"},
        ]
        answer2, reuse2, _ = chat_turn(client(second.base_url), messages, stream=False, cid=cid)
        assert reuse2 == "hit"
        assert answer2 == reference_chat(stack, messages, 24)
