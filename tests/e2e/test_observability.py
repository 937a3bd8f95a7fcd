"""Metrics scraped and parsed after a conversation; one log line per turn without content;
the in-flight gauge through a whole D leg."""

from __future__ import annotations

import time
import urllib.request
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness.chat import chat_turn, client
from harness.metrics import metric
from harness.procs import wait_until
from harness.waiting import scaled
from tests.e2e.conftest import Stack, pd_stack


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name and all(dict(ls).get(k) == w for k, w in labels.items())
    )


def test_metrics_after_a_conversation(stack: Stack) -> None:
    before = scrape(stack.router.url)
    api = client(stack.router.base_url)
    cid = f"metrics-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "user", "content": "Count my turns please."}]
    for _ in range(3):
        answer, _, _ = chat_turn(api, messages, stream=False, cid=cid)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "go"}]
    after = scrape(stack.router.url)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    route = "/v1/chat/completions"
    assert delta("kvbaton_requests_total", route=route, status="200") == 3
    assert delta("kvbaton_kv_reuse_total", outcome="hit") == 2
    assert delta("kvbaton_kv_reuse_total", outcome="miss", reason="no-session") == 1
    assert delta("kvbaton_kv_reused_tokens_total") > 0
    assert delta("kvbaton_session_commits_total", result="committed") == 3
    assert delta("kvbaton_ttft_seconds_count", route="chat") == 3
    assert delta("kvbaton_request_duration_seconds_count", route="chat") == 3
    assert delta("kvbaton_upstream_duration_seconds_count", role="prefill", outcome="ok") >= 3
    assert delta("kvbaton_upstream_duration_seconds_count", role="decode", outcome="ok") == 3
    assert value(after, "kvbaton_backend_healthy", role="decode", instance=stack.d.url) == 1
    assert value(after, "kvbaton_store_circuit_open") == 0


def test_one_log_line_per_turn_without_content(stack: Stack) -> None:
    secret = f"zebra{uuid.uuid4().hex[:6]}"
    cid = f"log-{uuid.uuid4().hex[:8]}"
    chat_turn(
        client(stack.router.base_url), [{"role": "user", "content": secret}], stream=False, cid=cid
    )
    log = stack.router.log
    deadline = time.monotonic() + scaled(5)
    while time.monotonic() < deadline:
        text = log.read_text()
        lines = [ln for ln in text.splitlines() if "turn request_id=" in ln]
        if lines and "result=committed" in lines[-1]:
            break
        time.sleep(0.05)
    assert secret not in text
    assert cid not in text
    assert "remote_block_ids" not in text and "remote_engine_id" not in text
    last = lines[-1]
    for field in ("conv=", "p=http://", "d=http://", "reuse=", "ttft_ms=", "prompt_tokens="):
        assert field in last


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_turn_counts_in_flight_on_d_until_its_answer_is_done(
    redis_url_session: str, stream: bool
) -> None:
    """kvbaton_backend_inflight_requests (and placement's load) count a turn on D for its
    whole D leg: a JSON answer comes whole, so all of it is the request's open."""
    slow = ("--decode-ms-per-token", "40")
    with pd_stack(redis_url_session, f"inflight-{stream}", decode=slow) as st:
        api = client(st.url + "/v1")

        def on_d() -> float:
            return metric(st.url, "kvbaton_backend_inflight_requests", role="decode")

        question = [{"role": "user", "content": "a long answer, please"}]
        with ThreadPoolExecutor(1) as pool:
            turn = pool.submit(chat_turn, api, question, stream=stream, cid=None, max_tokens=60)
            wait_until(lambda: on_d() == 1, "the turn in flight on D", 10)
            assert not turn.done()  # 60 tokens at 40 ms: D is still answering
            turn.result(timeout=30)
        assert on_d() == 0
