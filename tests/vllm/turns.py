"""What the real-vLLM tier's tests share: greedy chat turns through the router and on the
reference engine, conversation openings, and the session a turn left in Redis."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import openai
import redis

from harness.chat import Turn, chat_turn, reference_answer
from harness.chat import client as support_client
from harness.router import RouterProc
from tests.vllm.conftest import Engines
from tests.vllm.engines import MODEL_NAME, by_source, external_tokens, metric

MAX_TOKENS = 48
SYSTEM = "You are a terse assistant. You answer questions about tea, rain and the valley."
QUESTION = "Is it going to rain in the valley today, and should I bring tea?"

Message = dict[str, str]
T = TypeVar("T", bound=tuple[Any, ...])  # (answer, X-KV-Reuse, ...)


TIMEOUT = 330  # seconds an SDK call may take


def client(url: str) -> openai.OpenAI:
    return support_client(url, timeout=TIMEOUT)


def reference(engines_: Engines, messages: list[Message], max_tokens: int = MAX_TOKENS) -> str:
    """The answer of an engine without a connector, computed from scratch."""
    return reference_answer(
        engines_.ref.url, messages, max_tokens, model=MODEL_NAME, timeout=TIMEOUT, temperature=0
    )


def chat(
    r: RouterProc,
    messages: list[Message],
    *,
    cid: str | None,
    stream: bool = False,
    max_tokens: int = MAX_TOKENS,
    extra: dict[str, Any] | None = None,
) -> Turn:
    """One greedy turn through the router: (answer, X-KV-Reuse, the JSON body or {} when
    streamed); a plain `hit` must have moved KV from D (`moved_if_hit`)."""
    with client(r.base_url) as api:
        return moved_if_hit(
            r,
            lambda: chat_turn(
                api,
                messages,
                cid=cid,
                stream=stream,
                max_tokens=max_tokens,
                model=MODEL_NAME,
                extra=extra,
                temperature=0,
            ),
        )


def reads_from_d(reuse: str) -> bool:
    """Whether an X-KV-Reuse value says P read KV from D: `hit`, or `hit;id=history`."""
    return reuse.split(";")[0] == "hit" and "via=" not in reuse


def moved_if_hit(r: RouterProc, run: Callable[[], T]) -> T:
    """Run one turn through a tier router (its result's second item is X-KV-Reuse): a turn
    that says plain `hit` must have raised its P's `external_kv_transfer` prompt tokens (a
    hit means KV moved from D; one P read nothing from is `hit;via=prefill-cache`)."""
    before = external_tokens(r.url)
    result = run()
    reuse = result[1]
    if before is not None and reads_from_d(reuse):
        after = external_tokens(r.url)
        assert after is not None and after > before, (
            f"X-KV-Reuse {reuse!r}, but P read nothing from D (external_kv_transfer {before})"
        )
    return result


def opening(tag: str, *, unique: bool = True) -> list[Message]:
    """A conversation start no earlier test shares a prefix block with (`unique`: a fresh
    uuid in it; without, the same text, and so the same greedy answers, on every run)."""
    mark = f"{tag} {uuid.uuid4().hex}" if unique else tag
    return [
        {"role": "system", "content": f"[{mark}] {SYSTEM}"},
        {"role": "user", "content": QUESTION},
    ]


def session_fields(r_url: str, cid: str) -> tuple[str, dict[str, str]]:
    client_ = redis.Redis.from_url(r_url, decode_responses=True)
    try:
        keys = list(client_.scan_iter(f"kvbaton:conv:{{*:{cid}}}"))
        assert len(keys) == 1, keys
        return keys[0], client_.hgetall(keys[0])
    finally:
        client_.close()


def p_requests(url: str) -> float:
    """Requests P's HTTP server answered on its OpenAI routes (chat, completions, tokenize)."""
    return sum(
        metric(url, "http_requests_total", handler=h)
        for h in ("/v1/chat/completions", "/v1/completions", "/tokenize")
    )


def streamed_decode_plan(
    engines_: Engines, r: RouterProc, redis_url: str, tag: str, *, exact: bool = True
) -> None:
    """A 4-turn streamed chat conversation on stock engines: turn 1 is P/D; turns 2..4 say
    `hit;via=decode` with no request to P and no KV read by D, D's `local_cache_hit` rising
    (its cache held the earlier turns) and, where answers re-tokenize exactly (`exact`), D
    computing fewer tokens than its cache served; every answer is the from-scratch one."""
    p, d = engines_.p.url, engines_.d.url
    cid = f"{tag}-{uuid.uuid4().hex[:8]}"
    messages = opening(tag)
    for turn in range(1, 5):
        cached, computed = by_source(d, "local_cache_hit"), by_source(d, "local_compute")
        external, asked_p = by_source(d, "external_kv_transfer"), p_requests(p)
        answer, reuse, _ = chat(r, messages, cid=cid, stream=True)
        assert answer == reference(engines_, messages), f"turn {turn}"
        _, fields = session_fields(redis_url, cid)
        assert fields["kv_transfer_params"] == "", f"turn {turn}: stock 0.32 streams no handle"
        if turn == 1:
            assert reuse == "miss;reason=no-session"
        else:
            assert reuse == "hit;via=decode", f"turn {turn}: {reuse}"
            assert p_requests(p) == asked_p, f"turn {turn}: P was called"
            assert by_source(d, "external_kv_transfer") == external, f"turn {turn}: KV moved"
            assert by_source(d, "local_cache_hit") > cached, f"turn {turn}: D's cache unused"
            held = by_source(d, "local_cache_hit") - cached
            if exact:
                assert by_source(d, "local_compute") - computed < held, f"turn {turn}"
            assert fields["no_handle_reason"] == "decode-local"
        assert fields["decode"] == d
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"And in hour {turn}?"},
        ]
