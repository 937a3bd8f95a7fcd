"""kvbaton in front of real vLLM 0.32 with a byte-level BPE tokenizer, like real models'.

The character-level tier (test_real_vllm.py) cannot see what happens when D's answer does
not re-tokenize into the ids D generated: then the verified prefix stops near the end of
the previous prompt, which the previous turn's P already holds in its own prefix cache. The
router must not call that a read from D: with the engines' KV events it sends no handle and
says `hit;via=prefill-cache`, and a plain `hit` must mean P read KV from D over NIXL (P's
external tokens rise). Answers equal a from-scratch engine's either way.
"""

from __future__ import annotations

import os

import pytest

from harness.metrics import metric
from harness.router import RouterProc
from tests.vllm import pins, responses
from tests.vllm.conftest import PYTHON_ENV, Engines
from tests.vllm.engines import by_source, failed_transfers
from tests.vllm.turns import chat, opening, reference, streamed_decode_plan

if not os.environ.get(PYTHON_ENV):
    pytest.skip(
        f"real-vLLM tier: {PYTHON_ENV} is not set (run `make test-vllm`)",
        allow_module_level=True,
    )

pytestmark = pytest.mark.timeout(300)

FOLLOW_UPS = (
    "Thanks. And what about the afternoon?",
    "Should I walk to the village or take the bus?",
    "What would you pack for the evening?",
)


def reused(r: RouterProc, source: str) -> float:
    return metric(r.url, "kvbaton_kv_reused_tokens_total", source=source)


def test_every_hit_moves_kv_or_says_it_was_in_p(
    vllm_bpe_engines: Engines, vllm_bpe_router: RouterProc
) -> None:
    """Two 4-turn conversations: each turn after the first is `hit` with P's external
    tokens rising and kvbaton's decode_pull counter rising by the reused tokens, or
    `hit;via=prefill-cache` with no NIXL read at all and P's local cache hits rising."""
    p = vllm_bpe_engines.p.url
    verdicts: dict[str, int] = {}
    for tag in ("bpe-a", "bpe-b"):
        messages = opening(tag, unique=False)  # the same greedy answers on every run
        cid = f"{tag}-{os.getpid()}"
        for turn, follow_up in enumerate(("", *FOLLOW_UPS), start=1):
            if follow_up:
                messages.append({"role": "user", "content": follow_up})
            external, local = by_source(p, "external_kv_transfer"), by_source(p, "local_cache_hit")
            pulled, in_p = (
                reused(vllm_bpe_router, "decode_pull"),
                reused(vllm_bpe_router, "prefill_cache"),
            )
            failed = failed_transfers(p)
            answer, reuse, _ = chat(vllm_bpe_router, messages, cid=cid)
            assert answer == reference(vllm_bpe_engines, messages), f"{tag} turn {turn}"
            assert failed_transfers(p) == failed
            verdicts[reuse] = verdicts.get(reuse, 0) + 1
            if turn == 1:
                assert reuse.startswith("miss;"), f"{tag} turn 1: {reuse}"
            elif reuse == "hit":
                assert by_source(p, "external_kv_transfer") > external, f"{tag} {turn}: no read"
                assert reused(vllm_bpe_router, "decode_pull") > pulled
            else:
                assert reuse == "hit;via=prefill-cache", f"{tag} turn {turn}: {reuse}"
                assert by_source(p, "external_kv_transfer") == external, f"{tag} {turn}: read"
                assert by_source(p, "local_cache_hit") > local, f"{tag} {turn}"
                assert reused(vllm_bpe_router, "prefill_cache") > in_p
            messages.append({"role": "assistant", "content": answer})
    # The byte-level tokenizer makes the case the character tier cannot: at least one turn
    # whose verified prefix P already held (measured: see docs/real-vllm.md).
    assert verdicts.get("hit;via=prefill-cache", 0) > 0, verdicts


def test_streaming_on_stock_vllm_runs_later_turns_on_d(
    vllm_bpe_engines: Engines, vllm_bpe_router: RouterProc, redis_url_session: str
) -> None:
    """The decode plan with a byte-level tokenizer: D verifies its own ids with its own
    `/tokenize` (an answer that re-tokenizes otherwise verifies fewer blocks, and D computes
    the rest); the turns still run on D alone, and answer right."""
    streamed_decode_plan(
        vllm_bpe_engines, vllm_bpe_router, redis_url_session, "bpe-stream", exact=False
    )


def test_ending_a_conversation_frees_its_blocks_on_d(
    vllm_bpe_engines: Engines, vllm_bpe_router: RouterProc
) -> None:
    """One-turn conversations pin D's blocks for 480 s; ending one releases them at once."""
    pins.ending_a_conversation_frees_its_blocks_on_d(vllm_bpe_engines, vllm_bpe_router)


def test_a_restored_session_record_is_never_read(
    vllm_bpe_engines: Engines, vllm_bpe_router: RouterProc, redis_url_session: str
) -> None:
    """A record older than the conversation (a restore): a miss, never a read of blocks D freed."""
    pins.a_restored_record_is_never_read(vllm_bpe_engines, vllm_bpe_router, redis_url_session)


def test_responses_turns_reuse_only_what_p_s_render_verifies(
    vllm_bpe_engines: Engines, vllm_bpe_router: RouterProc, redis_url_session: str
) -> None:
    """With a byte-level BPE, an answer sent back as an output item re-tokenizes into other
    ids than D generated: P's /v1/responses/render shows where, and the turn reuses only the
    blocks before it (the item digests alone would have sent all of D's tokens)."""
    verdicts = responses.conversation(vllm_bpe_engines, vllm_bpe_router, redis_url_session, "bpe")
    assert any(v.reused < v.held for v in verdicts), verdicts
