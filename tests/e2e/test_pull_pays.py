"""A pull only when it pays (issue 49): P at vLLM's defaults skips a read of fewer than 64
tokens (`kv_recompute_threshold`) and recomputes them. After it has skipped two, the router
sends it no handle it would skip: no /tokenize, no verification; the turn says what P's own
cache held. A long answer, which P does read, is still pulled."""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator

import pytest

from harness.chat import chat_turn, client
from harness.metrics import metric
from harness.stack import Stack, start_stack
from router.engines.reads import VLLM_RECOMPUTE_THRESHOLD
from tests.e2e.conftest import pulled

ENGINE = ("--bidirectional",)  # vLLM's defaults with bidirectional_kv_xfer
SYSTEM = "You answer questions about the weather on a tea plantation, briefly. " * 4
PREFILL_CACHE = "hit;via=prefill-cache"


@pytest.fixture(scope="module")
def stack(redis_url_session: str) -> Iterator[Stack]:
    with start_stack(
        prefill=[ENGINE], decode=[ENGINE], reference=None, redis=redis_url_session, name="pays"
    ) as st:
        yield st


def tokenize_calls(st: Stack) -> float:
    return sum(
        metric(e.url, "http_requests_total", handler="/tokenize", status="2xx") for e in st.engines
    )


def test_reads_p_skips_stop_costing_a_tokenize(stack: Stack) -> None:
    cid = f"pays-{uuid.uuid4().hex[:8]}"
    messages = [{"role": "system", "content": f"{cid} {SYSTEM}"}]
    seen: list[tuple[str, float, float]] = []  # (X-KV-Reuse, tokens P read, /tokenize calls)
    with client(stack.router.base_url) as api:
        for turn, max_tokens in enumerate([20, 20, 20, 20, 20, 120, 20], 1):
            messages.append({"role": "user", "content": f"Question {turn}: and the rain?"})
            read, asked = pulled(stack.p.url), tokenize_calls(stack)
            answer, reuse, _ = chat_turn(api, messages, cid=cid, max_tokens=max_tokens)
            seen.append((reuse, pulled(stack.p.url) - read, tokenize_calls(stack) - asked))
            messages.append({"role": "assistant", "content": answer})
    reuses = [s[0] for s in seen]
    assert reuses[0] == "miss;reason=no-session"
    # Turns 2-3: the handle was sent (P's /tokenize verified it) and P skipped the read.
    assert seen[1:3] == [(PREFILL_CACHE, 0, 1)] * 2, seen
    # Turns 4-6: learned; no handle, no /tokenize (the 6th answer is long: its turn too).
    assert seen[3:6] == [(PREFILL_CACHE, 0, 0)] * 3, seen
    # Turn 7 lacks the long answer (over 64 tokens): verified and read from D.
    assert reuses[6] == "hit" and seen[6][1] > 0 and seen[6][2] == 1, seen
    # What the router learned of P, as /status shows it to an operator.
    with urllib.request.urlopen(stack.url + "/status", timeout=10) as resp:
        status = json.loads(resp.read())
    (p,) = status["instances"]["prefill"]
    assert (p["read_floor"], p["kept"]) == (VLLM_RECOMPUTE_THRESHOLD, 1.0), p
