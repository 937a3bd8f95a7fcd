"""D's pinned blocks on real vLLM 0.32 (CPU build, NIXL, bidirectional_kv_xfer): the router's
read-nothing request through P makes D free the blocks of a handle nobody will read, long
before decoder_kv_blocks_ttl (480 s). Run by the char and the BPE modules on their engines."""

from __future__ import annotations

import uuid

import redis

from harness.chat import post
from harness.metrics import metric, samples
from harness.procs import wait_until
from harness.router import RouterProc
from tests.vllm import engines
from tests.vllm.conftest import Engines
from tests.vllm.engines import by_source
from tests.vllm.turns import chat, opening, reference, session_fields


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
    wait_until(
        lambda: metric(r.url, "kvbaton_pin_releases_total", **labels) >= 1,
        "counted",
        10,
        seen=lambda: {k: v for k, v in samples(r.url).items() if "pin_releases" in k},
    )
    assert p_completions(e) == calls + 1, "one read-nothing request to P"


def a_restored_record_is_never_read(e: Engines, r: RouterProc, redis_url: str) -> None:
    """issue 48: turn 1's session record, put back (`DUMP`/`RESTORE`) after turn 2 took its
    handle, names blocks D freed once it was read or released: the next turn is
    `miss;reason=stale-handle`, P reads nothing from D, and every answer is the reference's."""
    cid = f"restore-{uuid.uuid4().hex[:8]}"
    messages = opening("restore")
    answer, _, _ = chat(r, messages, cid=cid)
    key, _ = session_fields(redis_url, cid)
    raw = redis.Redis.from_url(redis_url)
    try:
        record = raw.dump(key)
        assert isinstance(record, bytes)
        for follow_up in ("And the afternoon?", "And the evening?"):
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": follow_up},
            ]
            external = by_source(e.p.url, "external_kv_transfer")
            answer, reuse, _ = chat(r, messages, cid=cid)
            assert answer == reference(e, messages), reuse
            if follow_up.endswith("evening?"):  # turn 1's record again, its handle spent
                assert reuse == "miss;reason=stale-handle"
                assert by_source(e.p.url, "external_kv_transfer") == external, "P read from D"
            else:
                assert reuse.startswith("hit"), reuse  # turn 2 took turn 1's handle
                raw.restore(key, 0, record, replace=True)
    finally:
        raw.close()
