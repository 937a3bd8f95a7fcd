"""Degradation: never a failed request where a path exists (Redis down, P rejecting a handle,
D failing before its first byte, stock vLLM streams without a handle)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

from harness.chat import chat_turn, client
from harness.metrics import metric
from harness.procs import ROOT, free_port, sim
from harness.router import router
from tests.e2e.conftest import (
    V032,
    Stack,
    p_route_calls,
    pd_stack,
    post_json,
    pulled,
    reference_chat,
)


@pytest.fixture(scope="module")
def stock(redis_url_session: str) -> Iterator[Stack]:
    """Engines as stock vLLM 0.32: no kv_transfer_params in streams (PR #40186 unmerged).
    The decode plan is off here, so the P/D paths are what these tests see (the plan is
    tests/e2e/test_placement.py's)."""
    with pd_stack(redis_url_session, "stock", "--decode-local-max-tokens", "0", engines=V032) as st:
        yield st


def test_streaming_on_stock_engines_keeps_affinity_and_says_why(stock: Stack) -> None:
    api = client(stock.router.base_url)
    cid = f"stock-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": "Stream me the weather for the tea gardens."}]
    for turn in range(1, 4):
        answer, reuse, _ = chat_turn(api, messages, stream=True, cid=cid)
        assert answer == reference_chat(stock, messages, 24)
        assert reuse == (
            "miss;reason=no-session" if turn == 1 else "miss;reason=stream-no-kv-params"
        ), turn
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"and at hour {turn}?"},
        ]
    # A non-streaming turn captures D's handle; the turn after it hits.
    answer, reuse, _ = chat_turn(api, messages, stream=False, cid=cid)
    assert reuse == "miss;reason=stream-no-kv-params"
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "ok?"}]
    before = pulled(stock.p.url)
    answer, reuse, _ = chat_turn(api, messages, stream=True, cid=cid)
    assert reuse == "hit"
    assert pulled(stock.p.url) > before
    assert answer == reference_chat(stock, messages, 24)


def test_prefill_rejecting_the_handle_is_retried_as_a_miss(stock: Stack) -> None:
    api = client(stock.router.base_url)
    cid = f"reject-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": "What is the forecast for the valley?"}]
    answer, _, _ = chat_turn(api, messages, stream=False, cid=cid)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Sure?"}]
    # kv_load_failure_policy=fail answers 500 for a failed D->P read (vLLM #34896).
    post_json(stock.p.url + "/sim/faults", {"fail_next": 1, "status": 500})
    answer, reuse, _ = chat_turn(api, messages, stream=False, cid=cid)
    assert reuse == "miss;reason=handle-rejected"
    assert answer == reference_chat(stock, messages, 24)


def test_prefill_refusing_token_ids_gets_the_body_and_ids_stay_off(stock: Stack) -> None:
    """P answering 4xx to the prompt as token ids (say, an engine whose /v1/completions is
    blocked) gets the client's body on the same turn, which still hits; the router then stops
    sending ids and says why on /status."""
    with router([stock.p.url], [stock.d.url], redis_url=stock.redis_url, name="ids-router") as r:
        api = client(r.base_url)
        cid = f"ids-{uuid.uuid4().hex[:8]}"
        messages = [{"role": "user", "content": "Will the ferry run in this wind?"}]
        for turn in range(1, 4):
            if turn == 2:
                post_json(stock.p.url + "/sim/faults", {"fail_next": 1, "status": 404})
            calls = p_route_calls(stock.p.url)
            refused = metric(stock.p.url, "http_requests_total", status="4xx")
            answer, reuse, _ = chat_turn(api, messages, stream=False, cid=cid)
            assert answer == reference_chat(stock, messages, 24), turn
            assert reuse == ("miss;reason=no-session" if turn == 1 else "hit"), turn
            # Turn 2: the ids leg is refused, then P gets the chat body; turn 3: the body only.
            assert p_route_calls(stock.p.url) == (calls[0] + 1, calls[1]), turn
            assert metric(stock.p.url, "http_requests_total", status="4xx") == refused + (turn == 2)
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "?"}]
        with urllib.request.urlopen(r.url + "/status", timeout=5) as resp:
            ids_leg = json.load(resp)["prefill_token_ids"]
        assert ids_leg["on"] is False
        assert "answered 404 to /v1/completions with token ids" in ids_leg["off_reason"]


def test_no_prefill_token_ids_sends_p_the_body_on_hits(stock: Stack) -> None:
    """--no-prefill-token-ids: hits still verify with /tokenize, but P gets the chat body."""
    with router(
        [stock.p.url],
        [stock.d.url],
        "--no-prefill-token-ids",
        redis_url=stock.redis_url,
        name="no-ids-router",
    ) as r:
        api = client(r.base_url)
        cid = f"no-ids-{uuid.uuid4().hex[:8]}"
        messages = [{"role": "user", "content": "Which way does the wind turn tonight?"}]
        for turn in range(1, 3):
            calls = p_route_calls(stock.p.url)
            answer, reuse, _ = chat_turn(api, messages, stream=False, cid=cid)
            assert answer == reference_chat(stock, messages, 24), turn
            assert reuse == ("miss;reason=no-session" if turn == 1 else "hit"), turn
            assert p_route_calls(stock.p.url) == (calls[0] + 1, calls[1]), turn
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "?"}]
        with urllib.request.urlopen(r.url + "/status", timeout=5) as resp:
            assert json.load(resp)["prefill_token_ids"] == {"on": False, "off_reason": ""}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_decode_failing_before_first_byte_redoes_the_turn(stock: Stack, stream: bool) -> None:
    api = client(stock.router.base_url)
    messages = [{"role": "user", "content": f"Is the harbour calm? ({stream})"}]
    post_json(stock.d.url + "/sim/faults", {"fail_next": 1, "status": 503})
    answer, reuse, _ = chat_turn(api, messages, stream=stream, cid=None)
    assert answer == reference_chat(stock, messages, 24)
    assert reuse == "miss;reason=no-session"  # a new history session


def test_redis_down_routes_without_reuse(stock: Stack) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    with router([stock.p.url], [stock.d.url], redis_url=dead, name="router-noredis") as r:
        api = client(r.base_url)
        cid = f"noredis-{uuid.uuid4().hex[:8]}"
        messages = [{"role": "user", "content": "Any storms tonight?"}]
        for _ in range(3):
            answer, reuse, _ = chat_turn(api, messages, stream=False, cid=cid)
            assert reuse == "miss;reason=store-unavailable"
            assert answer == reference_chat(stock, messages, 24)
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "and then?"},
            ]


def test_model_mismatch_refuses_to_start() -> None:
    with (
        sim("prefill", "--model", "model-a", name="mm-p") as p,
        sim("decode", "--model", "model-b", name="mm-d") as d,
    ):
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "router",
                "serve",
                "--prefill",
                p.url,
                "--decode",
                d.url,
                "--session-store",
                "memory",
                "--port",
                str(free_port()),
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    assert done.returncode == 1
    assert "different models" in done.stderr
    assert "Traceback" not in done.stderr


def test_no_reuse_keeps_affinity_without_handles(stock: Stack) -> None:
    with router(
        [stock.p.url], [stock.d.url], "--no-reuse", redis_url=stock.redis_url, name="router-noreuse"
    ) as r:
        api = client(r.base_url)
        cid = f"aff-{uuid.uuid4().hex[:8]}"
        messages = [{"role": "user", "content": "Only affinity, please."}]
        before = pulled(stock.p.url)
        for _ in range(3):
            answer, reuse, _ = chat_turn(api, messages, stream=False, cid=cid)
            assert reuse == "skip;reason=reuse-disabled"
            assert answer == reference_chat(stock, messages, 24)
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": "and?"},
            ]
        assert pulled(stock.p.url) == before
