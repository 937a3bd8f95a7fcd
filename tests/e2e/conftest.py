"""E2E fixtures: simulator P and D, a from-scratch reference instance, and routers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import pytest

from harness.chat import Message, chat_turn, client, post, reference_answer
from harness.metrics import metric
from harness.stack import Stack, start_stack

BIDIR = ("--bidirectional", "--kv-recompute-threshold", "0")
# Engines as stock vLLM 0.32 (the simulator's default is 0.33): streams carry no handle.
V032 = ("--vllm-version", "0.32")


def reference_chat(stack: Stack, messages: list[dict[str, str]], max_tokens: int) -> str:
    """The answer of the stack's from-scratch reference engine."""
    return reference_answer(stack.ref.url, messages, max_tokens)


def streamed_turns(
    st: Stack, messages: list[Message], cid: str, follow_ups: Sequence[str]
) -> list[str]:
    """A streamed chat turn, then one more after each follow-up question; every answer equal
    to the reference engine's. Each turn's X-KV-Reuse (messages grows with the history)."""
    api = client(st.router.base_url)
    reuses = []
    for follow in [*follow_ups, ""]:
        answer, reuse, _ = chat_turn(api, messages, stream=True, cid=cid)
        assert answer == reference_chat(st, messages, 24)
        reuses.append(reuse)
        if follow:
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": follow},
            ]
    return reuses


def p_route_calls(url: str) -> tuple[float, float]:
    """(/v1/chat/completions, /v1/completions) requests an engine answered with 2xx."""
    return tuple(  # type: ignore[return-value]
        metric(url, "http_requests_total", handler=h, status="2xx")
        for h in ("/v1/chat/completions", "/v1/completions")
    )


def pulled(url: str) -> float:
    return metric(url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


@contextlib.contextmanager
def pd_stack(
    redis_url: str,
    name: str,
    *router_args: str,
    engines: Sequence[str] = (),
    decode: Sequence[str] = (),
    ready_timeout: float = 20.0,
) -> Iterator[Stack]:
    """Simulator P and D (bidirectional; `engines` on all three, `decode` on D only), a
    from-scratch reference engine, and a router on Redis."""
    with start_stack(
        prefill=[(*BIDIR, *engines)],
        decode=[(*BIDIR, *engines, *decode)],
        reference=engines,
        routers=[router_args],
        redis=redis_url,
        name=name,
        router_timeout=ready_timeout,
    ) as st:
        yield st


@pytest.fixture(scope="module")
def stack(redis_url_session: str) -> Iterator[Stack]:
    kv = "--stream-kv-params"
    with pd_stack(redis_url_session, "e2e", kv, decode=[kv]) as st:
        yield st


@pytest.fixture(scope="module")
def stack_reasoning(redis_url_session: str) -> Iterator[Stack]:
    """Engines whose template drops reasoning from earlier turns (vllm#43094)."""
    with pd_stack(redis_url_session, "think", engines=["--reasoning-tokens", "8"]) as st:
        yield st


def post_json(url: str, body: dict[str, object]) -> int:
    """A plain JSON POST (fault injection, admin calls); returns the status."""
    reply = post(url, body, timeout=5)
    assert reply.status < 400, (url, reply.status, reply.body[:300])
    return reply.status


@pytest.fixture(scope="module")
def stock_responses(redis_url_session: str) -> Iterator[Stack]:
    """Stock-vLLM-like engines (no kv_transfer_params in chat streams)."""
    with pd_stack(redis_url_session, "resp") as st:
        yield st
