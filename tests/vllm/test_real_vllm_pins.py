"""D's pinned blocks on real vLLM 0.32 (CPU build, NIXL, bidirectional_kv_xfer): the router's
read-nothing request through P makes D free the blocks of a handle nobody will read, long
before decoder_kv_blocks_ttl (480 s): D's own vllm:kv_cache_usage_perc drops to where it was."""

from __future__ import annotations

import os
import uuid

import pytest

from tests.support.chat import post
from tests.support.metrics import metric
from tests.support.procs import wait_until
from tests.support.router import RouterProc
from tests.vllm import engines
from tests.vllm.conftest import PYTHON_ENV, Engines
from tests.vllm.turns import chat, opening, reference

if not os.environ.get(PYTHON_ENV):
    pytest.skip(
        f"real-vLLM tier: {PYTHON_ENV} is not set (run `make test-vllm`)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.timeout(300)


def d_usage(e: Engines) -> float:
    return engines.metric(e.d.url, "vllm:kv_cache_usage_perc")


def test_ending_a_conversation_frees_its_blocks_on_d(
    vllm_engines: Engines, vllm_router: RouterProc
) -> None:
    before = d_usage(vllm_engines)
    cid = f"pins-{uuid.uuid4().hex[:8]}"
    messages = opening("pins")
    answer, reuse, _ = chat(vllm_router, messages, cid=cid)
    assert answer == reference(vllm_engines, messages) and reuse == "miss;reason=no-session"
    pinned = d_usage(vllm_engines)
    assert pinned > before, "D pins the finished request's blocks (bidirectional_kv_xfer)"
    p_calls = engines.metric(vllm_engines.p.url, "http_requests_total", handler="/v1/completions")
    ended = post(
        f"{vllm_router.url}/v1/conversations/{cid}",
        method="DELETE",
        headers={"authorization": "Bearer test-key"},
    )
    assert ended.status == 200, ended.body
    took = wait_until(lambda: d_usage(vllm_engines) <= before, "D freed the pinned blocks", 60)
    released = metric(vllm_router.url, "kvbaton_pin_releases_total", reason="ended")
    assert (
        released == 1
        and metric(
            vllm_router.url, "kvbaton_pin_releases_total", reason="ended", outcome="released"
        )
        == 1
    )
    # One read-nothing request reached P; D's blocks are free within seconds, not 480 s.
    assert (
        engines.metric(vllm_engines.p.url, "http_requests_total", handler="/v1/completions")
        == p_calls + 1
    )
    assert took < 30
