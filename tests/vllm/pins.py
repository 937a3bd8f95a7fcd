"""D's pinned blocks on real vLLM 0.32 (CPU build, NIXL, bidirectional_kv_xfer): the router's
read-nothing request through P makes D free the blocks of a handle nobody will read, long
before decoder_kv_blocks_ttl (480 s). Run by the char and the BPE modules on their engines."""

from __future__ import annotations

import uuid

from tests.support.chat import post
from tests.support.metrics import metric
from tests.support.procs import wait_until
from tests.support.router import RouterProc
from tests.vllm import engines
from tests.vllm.conftest import Engines
from tests.vllm.turns import chat, opening, reference


def d_usage(e: Engines) -> float:
    """D's own vllm:kv_cache_usage_perc: pinned blocks count as used until D frees them."""
    return engines.metric(e.d.url, "vllm:kv_cache_usage_perc")


def p_completions(e: Engines) -> float:
    return engines.metric(e.p.url, "http_requests_total", handler="/v1/completions")


def ending_a_conversation_frees_its_blocks_on_d(e: Engines, r: RouterProc) -> None:
    before = d_usage(e)
    cid = f"pins-{uuid.uuid4().hex[:8]}"
    messages = opening("pins")
    answer, reuse, _ = chat(r, messages, cid=cid)
    assert answer == reference(e, messages) and reuse == "miss;reason=no-session"
    assert d_usage(e) > before, "D pins the finished request's blocks (bidirectional_kv_xfer)"
    calls = p_completions(e)
    ended = post(
        f"{r.url}/v1/conversations/{cid}",
        method="DELETE",
        headers={"authorization": "Bearer test-key"},
    )
    assert ended.status == 200, ended.body
    took = wait_until(lambda: d_usage(e) <= before, "D freed the pinned blocks", 60)
    assert took < 30, "freed by the release, not by D's 480 s TTL"
    labels = {"reason": "ended", "outcome": "released"}
    # Counted once P answers the release; D frees the blocks when P notifies it, before that.
    wait_until(lambda: metric(r.url, "kvbaton_pin_releases_total", **labels) >= 1, "counted", 10)
    assert p_completions(e) == calls + 1, "one read-nothing request to P"
