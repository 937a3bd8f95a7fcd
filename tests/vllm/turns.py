"""What the real-vLLM tier's tests share: greedy chat turns through the router and on the
reference engine, conversation openings, and the session a turn left in Redis."""

from __future__ import annotations

import uuid
from typing import Any

import openai
import redis

from tests.support.chat import Turn, chat_turn, reference_answer
from tests.support.chat import client as support_client
from tests.support.router import RouterProc
from tests.vllm.conftest import Engines
from tests.vllm.engines import MODEL_NAME

MAX_TOKENS = 48
SYSTEM = "You are a terse assistant. You answer questions about tea, rain and the valley."
QUESTION = "Is it going to rain in the valley today, and should I bring tea?"

Message = dict[str, str]


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
    streamed)."""
    with client(r.base_url) as api:
        return chat_turn(
            api,
            messages,
            cid=cid,
            stream=stream,
            max_tokens=max_tokens,
            model=MODEL_NAME,
            extra=extra,
            temperature=0,
        )


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
