"""kvbaton in front of real vLLM 0.32 (CPU build, NixlConnector over UCX on loopback).

P and D run `kv_both` with `bidirectional_kv_xfer`; a third engine without a connector
computes every answer from scratch, and greedy answers through the router must equal its
answers exactly. The tiny model tokenizes one character per token and never writes a
special token, so an answer sent back as history re-tokenizes to exactly the ids D
generated (checked below), and a chat conversation can reuse all of D's KV.
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import pytest
import redis

from harness.chat import get_json, responses_turn
from harness.procs import free_port, wait_until
from harness.router import RouterProc
from tests.vllm import engines, pins, responses
from tests.vllm.conftest import PYTHON_ENV, Engines
from tests.vllm.engines import MODEL_NAME, by_source, failed_transfers
from tests.vllm.turns import (
    MAX_TOKENS,
    Message,
    chat,
    client,
    opening,
    reference,
    session_fields,
    streamed_decode_plan,
)

if not os.environ.get(PYTHON_ENV):
    pytest.skip(
        f"real-vLLM tier: {PYTHON_ENV} is not set (run `make test-vllm`)",
        allow_module_level=True,
    )

# Each test takes seconds here (docs/real-vllm.md); on a machine loaded by something else,
# engine legs were measured to stall for minutes. Budget for that.
pytestmark = pytest.mark.timeout(300)


def test_single_turn_prefill_then_decode(vllm_engines: Engines, vllm_router: RouterProc) -> None:
    """P prefills, D reads P's blocks over NIXL, and the answer is the from-scratch one."""
    d = vllm_engines.d.url
    pulled, failed = by_source(d, "external_kv_transfer"), failed_transfers(d)
    messages = opening("single")
    answer, reuse, body = chat(vllm_router, messages, cid=None)
    assert reuse == "miss;reason=no-session"  # a new history session
    assert by_source(d, "external_kv_transfer") > pulled, "D read nothing from P"
    assert failed_transfers(d) == failed
    assert answer == reference(vllm_engines, messages)
    assert len(answer) == MAX_TOKENS  # one character per token, no EOS
    # The router keeps its own fields away from the client.
    assert "kv_transfer_params" not in body
    assert "prompt_token_ids" not in body


def test_single_turn_completions(vllm_engines: Engines, vllm_router: RouterProc) -> None:
    d = vllm_engines.d.url
    pulled = by_source(d, "external_kv_transfer")
    prompt = f"[{uuid.uuid4().hex}] The weather report for the valley this week says that"
    with client(vllm_router.base_url) as api:
        raw = api.completions.with_raw_response.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
    with client(vllm_engines.ref.url + "/v1") as ref:
        expected = ref.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0
        )
    assert raw.parse().choices[0].text == expected.choices[0].text
    assert by_source(d, "external_kv_transfer") > pulled


def test_multi_turn_reads_previous_turn_from_decode(
    vllm_engines: Engines, vllm_router: RouterProc, redis_url_session: str
) -> None:
    """Turns 2..N hit: P reads the earlier turns' KV (D's prompt + answer) from D."""
    p, d = vllm_engines.p.url, vllm_engines.d.url
    cid = f"multi-{uuid.uuid4().hex[:8]}"
    messages = opening("multi")
    for turn in range(1, 5):
        p_pulled, failed = by_source(p, "external_kv_transfer"), failed_transfers(p)
        ids_legs = ids_leg_calls(p)
        # return_token_ids: the client sees D's token ids (the router passes them through).
        answer, reuse, body = chat(vllm_router, messages, cid=cid, extra={"return_token_ids": True})
        assert answer == reference(vllm_engines, messages), f"turn {turn}"
        if turn == 1:
            assert reuse == "miss;reason=no-session"
        else:
            assert reuse == "hit", f"turn {turn}: {reuse}"
            assert by_source(p, "external_kv_transfer") > p_pulled, f"turn {turn}: no D->P read"
            # P got the prompt as the token ids of its own /tokenize (not the chat body).
            assert ids_leg_calls(p) == ids_legs + 1, f"turn {turn}"
            assert failed_transfers(p) == failed
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        held = body["prompt_token_ids"] + body["choices"][0]["token_ids"]
        messages += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"Thanks. And what about hour {turn} of the afternoon?"},
        ]
        # The answer text round-trips: the next prompt starts with exactly D's token ids.
        assert engines.tokenize_chat(p, messages)[: len(held)] == held, f"turn {turn}"
    _, fields = session_fields(redis_url_session, cid)
    assert fields["turn"] == "4"
    assert fields["decode"] == d and fields["prefill"] == p


def ids_leg_calls(url: str) -> float:
    """Requests vLLM's /v1/completions answered with 2xx (its HTTP instrumentator)."""
    return engines.metric(url, "http_requests_total", handler="/v1/completions", status="2xx")


def test_token_verification_against_real_tokenize(
    vllm_engines: Engines, vllm_router: RouterProc, redis_url_session: str
) -> None:
    """The router's defaults work on real vLLM: block size from vllm:cache_config_info, token
    digests from return_token_ids, and P's /tokenize for verification. An edited earlier
    turn is a miss; an edited tail of the last answer reuses the verified blocks only."""
    p = vllm_engines.p.url
    cid = f"verify-{uuid.uuid4().hex[:8]}"
    messages = opening("verify")
    answer, _, _ = chat(vllm_router, messages, cid=cid)
    _, fields = session_fields(redis_url_session, cid)
    assert fields["block_size"] == str(engines.BLOCK_SIZE)
    handle = json.loads(fields["kv_transfer_params"])
    held = int(fields["token_count"])
    assert held == handle["remote_num_tokens"]
    assert len(fields["block_digests"].split()) == held // engines.BLOCK_SIZE

    # The last answer edited near its end: the blocks before the edit are still D's.
    edited = [*messages, {"role": "assistant", "content": answer[:-6] + "EDITED"}]
    edited.append({"role": "user", "content": "Are you sure about that?"})
    before = by_source(p, "external_kv_transfer")
    got, reuse, _ = chat(vllm_router, edited, cid=cid)
    assert reuse == "hit"
    assert got == reference(vllm_engines, edited)
    assert by_source(p, "external_kv_transfer") > before

    # An edited system message: nothing D holds is the new prompt's prefix.
    changed = [{"role": "system", "content": "Another system prompt."}, *edited[1:]]
    changed += [{"role": "assistant", "content": got}, {"role": "user", "content": "Why?"}]
    got, reuse, _ = chat(vllm_router, changed, cid=cid)
    assert reuse == "miss;reason=prefix-mismatch"
    assert got == reference(vllm_engines, changed)


def test_streaming_on_stock_vllm_runs_later_turns_on_d(
    vllm_engines: Engines, vllm_router: RouterProc, redis_url_session: str
) -> None:
    """Stock 0.32 streams no kv_transfer_params, so a streamed turn leaves no handle; with
    the decode plan (on by default) turns 2..4 run on D alone (`hit;via=decode`): no P leg,
    no KV moved, D's own prefix cache serves the earlier turns (prompt and answer)."""
    streamed_decode_plan(vllm_engines, vllm_router, redis_url_session, "stream")
    # A non-streaming turn then captures D's handle again, and the streaming turn after it
    # pulls from D.
    cid = f"stream-pull-{uuid.uuid4().hex[:8]}"
    messages = opening("stream-pull")
    answer, reuse, _ = chat(vllm_router, messages, cid=cid)
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Ok?"}]
    before = by_source(vllm_engines.p.url, "external_kv_transfer")
    answer, reuse, _ = chat(vllm_router, messages, cid=cid, stream=True)
    assert reuse == "hit"
    assert by_source(vllm_engines.p.url, "external_kv_transfer") > before
    assert answer == reference(vllm_engines, messages)


def test_handle_naming_a_dead_engine_is_retried_as_a_miss(
    vllm_engines: Engines, vllm_router: RouterProc, redis_url_session: str
) -> None:
    """A stored handle edited to name another engine (a dead one) than the session recorded:
    the session's signature no longer matches (routers sign by default), so the router
    refuses it before P (no NIXL handshake, no failed transfer), the turn is a plain miss with
    the right answer, and the next turn reads from D. (Unsigned, the handle check refuses it:
    handle-invalid, tests/reliability; before both, P tried the dead engine and answered 500:
    handle-rejected.)"""
    p = vllm_engines.p.url
    cid = f"dead-{uuid.uuid4().hex[:8]}"
    messages = opening("dead")
    answer, _, _ = chat(vllm_router, messages, cid=cid)
    key, fields = session_fields(redis_url_session, cid)
    handle = json.loads(fields["kv_transfer_params"])
    # Same blocks and token count (so the prefix digests still verify), another engine.
    handle["remote_engine_id"] = f"gone-{uuid.uuid4()}"
    handle["remote_port"] = free_port()
    store = redis.Redis.from_url(redis_url_session, decode_responses=True)
    try:
        store.hset(key, "kv_transfer_params", json.dumps(handle))
    finally:
        store.close()
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Really?"}]
    failed = failed_transfers(p)
    answer, reuse, _ = chat(vllm_router, messages, cid=cid)
    assert reuse == "miss;reason=handle-unauthenticated"
    assert answer == reference(vllm_engines, messages)
    assert failed_transfers(p) == failed, "nothing was sent to P"
    # The turn committed a good handle again: the next turn reads from D.
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Fine."}]
    before = by_source(p, "external_kv_transfer")
    answer, reuse, _ = chat(vllm_router, messages, cid=cid)
    assert reuse == "hit"
    assert by_source(p, "external_kv_transfer") > before
    assert answer == reference(vllm_engines, messages)


def test_kv_events_from_both_engines(vllm_engines: Engines, vllm_router: RouterProc) -> None:
    """Both engines publish BlockStored for a turn's prompt; msgspec decodes them without
    vLLM; block hashes agree between P and D."""
    messages = opening("events")
    chat(vllm_router, messages, cid=None)
    first_block = engines.tokenize_chat(vllm_engines.p.url, messages)[: engines.BLOCK_SIZE]

    def stores_first_block(event: dict[str, Any]) -> bool:
        return (
            event.get("type") == "BlockStored"
            and event.get("token_ids", [])[: engines.BLOCK_SIZE] == first_block
        )

    on_p = vllm_engines.events.wait_for("p", stores_first_block)
    on_d = vllm_engines.events.wait_for("d", stores_first_block)
    assert on_p["block_size"] == on_d["block_size"] == engines.BLOCK_SIZE
    assert on_p["block_hashes"][0] == on_d["block_hashes"][0]
    batch = vllm_engines.events.batches["p"][0]
    assert len(batch) == 3 and isinstance(batch[1], list)  # [ts, events, dp rank]
    assert not vllm_engines.events.errors

    # The router's own subscribers index both engines from the same events.
    def indexed() -> bool:
        status = get_json(vllm_router.url + "/status")["kv_events"]
        views = [status["engines"][e.url] for e in (vllm_engines.p, vllm_engines.d)]
        return status["on"] and all(v["in_sync"] and v["blocks"] > 0 for v in views)

    wait_until(indexed, "the router's KV-events index did not follow both engines", timeout=30)


def responses_reference(engines_: Engines, items: list[Message]) -> str:
    """The from-scratch answer of the engine without a connector, on /v1/responses."""
    with client(engines_.ref.url + "/v1") as ref:
        out = ref.responses.create(
            model=MODEL_NAME,
            input=items,  # type: ignore[arg-type]
            max_output_tokens=MAX_TOKENS,
            temperature=0,
        )
    return out.output_text


def responses_stream(
    r: RouterProc, items: list[Message], cid: str
) -> tuple[str, str, dict[str, Any]]:
    """One streaming /v1/responses turn: (answer, X-KV-Reuse, the completed response; {}
    without one)."""
    return responses.turn(r, list(items), cid, stream=True)


def test_streaming_responses_turns_read_from_decode(
    vllm_engines: Engines, vllm_router: RouterProc, redis_url_session: str
) -> None:
    """Stock 0.32 streams D's handle in `response.completed` on /v1/responses: streaming
    turns 2..3 hit, P reads the earlier turns from D, and answers equal from-scratch ones."""
    p, d = vllm_engines.p.url, vllm_engines.d.url
    cid = f"responses-{uuid.uuid4().hex[:8]}"
    items = opening("responses")
    for turn in range(1, 4):
        p_pulled, failed = by_source(p, "external_kv_transfer"), failed_transfers(p)
        answer, reuse, completed = responses_stream(vllm_router, items, cid)
        assert completed, f"turn {turn}: no response.completed"
        assert "kv_transfer_params" not in completed  # the router keeps D's handle
        assert answer == responses_reference(vllm_engines, items), f"turn {turn}"
        if turn == 1:
            assert reuse == "miss;reason=no-session"
        else:
            assert reuse == "hit", f"turn {turn}: {reuse}"
            assert by_source(p, "external_kv_transfer") > p_pulled, f"turn {turn}: no D->P read"
            assert failed_transfers(p) == failed
        _, fields = session_fields(redis_url_session, cid)
        assert fields["kv_transfer_params"], f"turn {turn}: no handle captured from the stream"
        assert (fields["prefill"], fields["decode"]) == (p, d)
        items += [
            {"role": "assistant", "content": answer},
            {"role": "user", "content": f"Thanks. And what about hour {turn} of the evening?"},
        ]


def test_a_previous_response_id_chain_reads_from_decode(
    vllm_engines: Engines, vllm_router: RouterProc
) -> None:
    """The OpenAI SDK's own loop (issue 54): each turn sends only its new input and the
    previous response's id; the router stores each response, expands the chain into the whole
    input for P and D, and keys the conversation by it: turns 2..4 (JSON and streamed) read
    D's KV with no conversation id, and every answer equals the from-scratch one."""
    p = vllm_engines.p.url
    items = opening("chain")
    new: list[Message] = list(items)
    previous: str | None = None
    with client(vllm_router.base_url) as api:
        for turn in range(1, 5):
            kwargs: dict[str, Any] = {
                "model": MODEL_NAME,
                "input": new,
                "max_output_tokens": MAX_TOKENS,
                "temperature": 0,
            }
            if previous is not None:
                kwargs["previous_response_id"] = previous
            p_pulled, failed = by_source(p, "external_kv_transfer"), failed_transfers(p)
            answer, reuse, done = responses_turn(api, kwargs, stream=turn % 2 == 0)
            assert answer == responses_reference(vllm_engines, items), f"turn {turn}"
            assert done["id"] and "kv_transfer_params" not in done
            if turn == 1:
                assert reuse == "miss;reason=no-session"
            else:
                assert reuse == "hit", f"turn {turn}: {reuse}"
                assert by_source(p, "external_kv_transfer") > p_pulled, f"turn {turn}: no read"
                assert failed_transfers(p) == failed
            assert api.responses.retrieve(done["id"]).output_text == answer
            previous = done["id"]
            new = [{"role": "user", "content": f"Thanks. And hour {turn} of the evening?"}]
            items += [{"role": "assistant", "content": answer}, *new]


def test_ending_a_conversation_frees_its_blocks_on_d(
    vllm_engines: Engines, vllm_router: RouterProc
) -> None:
    """One-turn conversations pin D's blocks for 480 s; ending one releases them at once."""
    pins.ending_a_conversation_frees_its_blocks_on_d(vllm_engines, vllm_router)


def test_a_restored_session_record_is_never_read(
    vllm_engines: Engines, vllm_router: RouterProc, redis_url_session: str
) -> None:
    """A record older than the conversation (a restore): a miss, never a read of blocks D freed."""
    pins.a_restored_record_is_never_read(vllm_engines, vllm_router, redis_url_session)


def test_responses_turns_are_verified_by_p_s_render(
    vllm_engines: Engines, vllm_router: RouterProc, redis_url_session: str
) -> None:
    """P and D serve /v1/responses/render (--enable-scale-out): every later Responses turn is
    verified by P's render against D's token ids, and with one character per token the answer
    sent back re-tokenizes exactly, so each reuses all D held. vLLM's default refuses it."""
    verdicts = responses.conversation(vllm_engines, vllm_router, redis_url_session, "char")
    assert all(v.reuse == "hit" and v.reused == v.held for v in verdicts), verdicts
    responses.default_engine_refuses_render(vllm_engines)
