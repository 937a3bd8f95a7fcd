"""Every upstream call has a timeout: a D stream that goes silent mid-answer is cut after
--decode-idle-timeout with one SSE error event, D's request is cancelled, nothing is committed.
P's total timeout and D's first-byte timeout: test_prefill_failover.py, test_decode_failures.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import pytest

from harness.chat import chat_body, post
from harness.procs import wait_until
from harness.router import RouterProc
from tests.reliability.conftest import SLOW_TOKEN_MS, Slow
from tests.reliability.helpers import Conversation, metric, new_cid, router, running, session

IDLE_TIMEOUT = 0.3  # below the slow D's gap between tokens (SLOW_TOKEN_MS)


@pytest.fixture(scope="module")
def impatient(slow: Slow) -> Iterator[RouterProc]:
    args = ("--stream-kv-params", "--decode-idle-timeout", str(IDLE_TIMEOUT))
    with router([slow.p.url], [slow.d.url], *args, redis_url=slow.redis_url, name="rel-idle") as r:
        yield r


@pytest.mark.timeout(60)
def test_silent_decode_stream_is_cut_after_the_idle_timeout(
    slow: Slow, impatient: RouterProc
) -> None:
    assert SLOW_TOKEN_MS / 1000 > IDLE_TIMEOUT
    wait_until(lambda: running(slow.d) == 0, "the slow D is busy")
    conv = Conversation(impatient.url, slow.ref, new_cid("idle"))
    messages = [*conv.messages, {"role": "user", "content": f"Long story ({conv.nonce})?"}]
    broke = metric(impatient.url, "kvbaton_turns_aborted_total", reason="decode-broke")
    tokens = metric(slow.d.url, "vllm:generation_tokens_total")
    started = time.monotonic()
    reply = post(
        impatient.url + "/v1/chat/completions",
        chat_body(messages, cid=conv.cid, stream=True, max_tokens=10),  # 5 s if not cut
    )
    assert time.monotonic() - started < 10
    assert reply.status == 200
    events = [e for e in reply.events() if e != b"[DONE]"]
    errors = reply.error_events()
    assert len(errors) == 1 and "timed out" in errors[0]["message"]
    assert json.loads(events[-1]) == {"error": errors[0]}
    content = [e for e in events[:-1] if b'"content":"' in e and b'"content":""' not in e]
    assert 1 <= len(content) < 10, "cut mid-answer, after the first token"
    wait_until(lambda: running(slow.d) == 0, "D still decodes for nobody")
    assert metric(slow.d.url, "vllm:generation_tokens_total") - tokens < 10
    assert metric(impatient.url, "kvbaton_turns_aborted_total", reason="decode-broke") == broke + 1
    assert session(slow.redis_url, str(conv.cid)) == {}, "nothing committed"
