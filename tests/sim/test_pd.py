"""P/D handoffs between real simulator processes: the answers are the correctness oracle."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from harness.chat import NULL_HANDOFF
from harness.procs import SimProc, free_port, sim, sims
from tests.sim.client import chat, external, get, metric, parse_sse, post, stream, tokenize, words
from tests.sim.handoff import answer, as_p_handle, decode, prefill, scratch, turn1, turn2_messages

BS = 16


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, SimProc]]:
    """P and D (bidirectional), a reference R computing from scratch, and special-purpose ones."""
    specs = {
        "P": ("prefill", "--bidirectional"),
        "D": ("decode", "--bidirectional"),
        "R": ("prefill",),
        # D2's pins are always inside P's 5 s safety margin, and D2 is small enough that
        # freed blocks are soon reused.
        "D2": (
            "decode",
            "--bidirectional",
            "--decoder-kv-blocks-ttl",
            "4",
            "--num-blocks",
            "34",
            "--max-model-len",
            "512",
        ),
        "Prec": ("prefill", "--bidirectional", "--kv-load-failure-policy", "recompute"),
    }
    with sims(*specs.values(), name="pd") as procs:
        yield dict(zip(specs, procs, strict=True))


async def test_p_to_d_handoff_equals_from_scratch(cluster: dict[str, SimProc]) -> None:
    p, d, r = cluster["P"], cluster["D"], cluster["R"]
    msgs = [{"role": "user", "content": words(1, 100)}]
    before = await external(d.url)
    pb = await prefill(p, msgs, NULL_HANDOFF)
    params = pb["kv_transfer_params"]
    assert params["do_remote_prefill"] is True and params["remote_engine_id"] == p.engine_id
    assert params["remote_port"] == p.kv_port and params["transfer_mode"] == "pull"
    n_prompt = pb["usage"]["prompt_tokens"]
    assert params["remote_num_tokens"] == n_prompt
    assert len(params["remote_block_ids"][0]) == -(-n_prompt // BS)
    assert params["remote_request_id"].startswith(pb["id"] + "-")

    status, db = await decode(d, msgs, params, 20)
    assert status == 200, db
    assert answer(db) == await scratch(r, msgs, 20)
    assert db["choices"][0]["message"]["content"].startswith(pb["choices"][0]["message"]["content"])
    assert await external(d.url) - before == n_prompt
    assert db["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # P's count, echoed
    # D notified P, so P released the lease.
    _, state = await get(p.url + "/sim/state")
    assert params["remote_request_id"] not in {x["request_id"] for x in state["pins"]}


async def test_repeated_prompt_reports_p_cache_hits_on_both_legs(
    cluster: dict[str, SimProc],
) -> None:
    p, d = cluster["P"], cluster["D"]
    msgs = [{"role": "user", "content": words(2, 70)}]
    await prefill(p, msgs, NULL_HANDOFF)
    pb = await prefill(p, msgs, NULL_HANDOFF)
    cached = pb["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 0 and cached % BS == 0
    assert pb["kv_transfer_params"]["remote_prefill_cached_tokens"] == cached
    _, db = await decode(d, msgs, pb["kv_transfer_params"], 5)
    assert db["usage"]["prompt_tokens_details"]["cached_tokens"] == cached


async def test_bidirectional_turn2_pulls_from_d_with_exact_answer(
    cluster: dict[str, SimProc],
) -> None:
    p, d, r = cluster["P"], cluster["D"], cluster["R"]
    msgs, db = await turn1(cluster, 3)
    hd = db["kv_transfer_params"]
    out_ids, content = answer(db)
    n1 = db["usage"]["prompt_tokens"]
    assert hd["do_remote_decode"] is True and hd["remote_engine_id"] == d.engine_id
    assert hd["remote_num_tokens"] == n1 + len(out_ids) - 1
    assert isinstance(hd["remote_blocks_expiry_time"], float)

    msgs2 = turn2_messages(msgs, content, 33)
    ids2 = await tokenize(p.url, msgs2)
    assert ids2[: n1 + len(out_ids)] == db["prompt_token_ids"] + out_ids  # exact extension
    p_hit = (n1 // BS) * BS  # P cached turn 1's full prompt blocks
    before = await external(p.url)
    reads = await metric(p.url, "vllm_sim:kv_read_wait_seconds_count")
    waited = await metric(p.url, "vllm_sim:kv_read_wait_seconds_sum")
    pb = await prefill(p, msgs2, as_p_handle(hd))
    assert await external(p.url) - before == hd["remote_num_tokens"] - p_hit
    # The pull's side-channel exchange, timed on P (a histogram: every read under +Inf).
    assert await metric(p.url, "vllm_sim:kv_read_wait_seconds_count") == reads + 1
    assert await metric(p.url, "vllm_sim:kv_read_wait_seconds_sum") > waited
    assert await metric(p.url, "vllm_sim:kv_read_wait_seconds_bucket", le="+Inf") == reads + 1
    assert pb["usage"]["prompt_tokens_details"]["cached_tokens"] == hd["remote_num_tokens"]
    status, db2 = await decode(d, msgs2, pb["kv_transfer_params"], 20)
    assert status == 200
    assert answer(db2) == await scratch(r, msgs2, 20)
    # P notified D after reading, so D released turn 1's pin.
    _, state = await get(d.url + "/sim/state")
    assert hd["remote_request_id"] not in {x["request_id"] for x in state["pins"]}


async def test_wrong_prefix_gives_wrong_answer_and_poisons_p(cluster: dict[str, SimProc]) -> None:
    p, d, r = cluster["P"], cluster["D"], cluster["R"]
    _, db = await turn1(cluster, 4)
    _, content = answer(db)
    # Same length, different first message: the handle does not describe this prompt.
    edited = [{"role": "user", "content": words(44, 60)}]
    msgs2 = turn2_messages(edited, content, 34)
    pb = await prefill(p, msgs2, as_p_handle(db["kv_transfer_params"]))
    _, db2 = await decode(d, msgs2, pb["kv_transfer_params"], 20)
    right = await scratch(r, msgs2, 20)
    assert answer(db2) != right  # HTTP 200, wrong answer
    # The wrong KV entered P's prefix cache under msgs2's tokens: no handle, still wrong.
    status, again = await decode(p, msgs2, None, 20)
    assert status == 200
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert answer(again) != right


async def test_truncated_handle_pulls_exactly_the_verified_prefix(
    cluster: dict[str, SimProc],
) -> None:
    p, d, r = cluster["P"], cluster["D"], cluster["R"]
    msgs, db = await turn1(cluster, 5)
    out_ids, content = answer(db)
    held = db["prompt_token_ids"] + out_ids
    # Edit the tail of the previous answer: only a prefix of D's sequence still matches.
    edited_content = " ".join([*content.split()[:-6], "edited", "tail"])
    msgs2 = turn2_messages(msgs, " " + edited_content, 35)
    ids2 = await tokenize(p.url, msgs2)
    common = next(i for i, (a, b) in enumerate(zip(ids2, held, strict=False)) if a != b)
    keep = common // BS * BS
    hd = db["kv_transfer_params"]
    handle = {
        **as_p_handle(hd),
        "remote_num_tokens": keep,
        "remote_block_ids": [hd["remote_block_ids"][0][: keep // BS]],
    }
    n1 = db["usage"]["prompt_tokens"]
    p_hit = (n1 // BS) * BS
    assert keep - p_hit >= 64  # above P's kv_recompute_threshold
    before = await external(p.url)
    pb = await prefill(p, msgs2, handle)
    assert await external(p.url) - before == keep - p_hit
    _, db2 = await decode(d, msgs2, pb["kv_transfer_params"], 20)
    assert answer(db2) == await scratch(r, msgs2, 20)


async def test_expired_deadline_declined_or_read_silently(cluster: dict[str, SimProc]) -> None:
    p, prec, d2, r = cluster["P"], cluster["Prec"], cluster["D2"], cluster["R"]
    msgs, db = await turn1(cluster, 6, p="P", d="D2")
    hd = db["kv_transfer_params"]
    _, content = answer(db)
    msgs2 = turn2_messages(msgs, content, 36)
    right = await scratch(r, msgs2, 20)

    # Deadline forwarded and within the margin: policy fail -> 500.
    failed = await metric(p.url, "vllm:nixl_num_failed_transfers_total")
    status, body = await chat(p.url, msgs2, max_tokens=1, kv_transfer_params=as_p_handle(hd))
    assert status == 500
    assert body == {
        "error": {
            "message": "Internal server error",
            "type": "InternalServerError",
            "param": None,
            "code": 500,
        }
    }
    assert await metric(p.url, "vllm:nixl_num_failed_transfers_total") == failed + 1

    # Policy recompute -> the right answer, nothing pulled.
    before = await external(prec.url)
    status, body = await decode(prec, msgs2, as_p_handle(hd), 20)
    assert status == 200 and answer(body) == right
    assert await external(prec.url) == before

    # Deadline dropped by the router: nobody protects the blocks. Let D2's pin expire and
    # its blocks be reused, then P reads them anyway: HTTP 200 and a wrong answer.
    status, clock = await post(d2.url + "/sim/clock", {"advance_s": 10})
    assert status == 200 and clock["expired_requests"] >= 1
    big = [{"role": "user", "content": words(66, 480)}]
    status, _ = await chat(d2.url, big, max_tokens=1)
    assert status == 200
    no_deadline = {**as_p_handle(hd), "remote_blocks_expiry_time": None}
    status, body = await decode(p, msgs2, no_deadline, 20)
    assert status == 200 and answer(body) != right
    assert await metric(d2.url, "vllm:nixl_num_kv_expired_reqs_total") >= 1


async def test_dead_or_wrong_engine_fails_per_policy(cluster: dict[str, SimProc]) -> None:
    p, d, prec, r = cluster["P"], cluster["D"], cluster["Prec"], cluster["R"]
    msgs = [{"role": "user", "content": words(7, 40)}]
    pb = await prefill(p, msgs, NULL_HANDOFF)
    dead = {**pb["kv_transfer_params"], "remote_port": free_port()}
    failed = await metric(d.url, "vllm:nixl_num_failed_transfers_total")
    status, body = await decode(d, msgs, dead, 5)
    assert status == 500 and body["error"]["type"] == "InternalServerError"
    wrong_id = {**pb["kv_transfer_params"], "remote_engine_id": "nonexistent-engine"}
    status, _ = await decode(d, msgs, wrong_id, 5)
    assert status == 500
    assert await metric(d.url, "vllm:nixl_num_failed_transfers_total") == failed + 2

    # Streaming: the status is already 200, then one error event and [DONE].
    status, raw = await stream(
        d.url + "/v1/chat/completions",
        {"messages": msgs, "max_tokens": 5, "stream": True, "kv_transfer_params": dead},
    )
    events = parse_sse(raw)
    assert status == 200 and events[-2]["error"]["code"] == 500 and events[-1] == "[DONE]"

    # Policy recompute: the request succeeds with the from-scratch answer.
    status, body = await decode(prec, msgs, dead, 5)
    assert status == 200 and answer(body) == await scratch(r, msgs, 5)


async def test_a_reader_keeps_a_producers_agent_across_its_restart(
    cluster: dict[str, SimProc],
) -> None:
    """As vLLM's NIXL connector (measured on the CPU build): P handshakes an engine id once;
    after that D restarts with the same engine id, every read from it fails, new handles
    too (NIXL_ERR_REMOTE_DISCONNECT), while D still pulls from P. A new engine id works."""
    p, r = cluster["P"], cluster["R"]
    engine_id, port, kv_port = f"fixed-{free_port()}", str(free_port()), str(free_port())
    flags = ("--bidirectional", "--port", port, "--kv-port", kv_port)

    async def hit_on_p(d: SimProc, seed: int) -> tuple[int, Any]:
        """One P->D turn, then P reading the next turn's prefix back from D."""
        msgs, db = await turn1({"P": p, "D": d}, seed)
        assert answer(db) == await scratch(r, msgs, 80)
        msgs2 = turn2_messages(msgs, answer(db)[1], seed + 50)
        handle = as_p_handle(db["kv_transfer_params"])
        return await chat(p.url, msgs2, max_tokens=1, kv_transfer_params=handle)

    with sim("decode", *flags, "--engine-id", engine_id, name="pd-fixed") as d:
        assert (await hit_on_p(d, 81))[0] == 200
    failed = await metric(p.url, "vllm:nixl_num_failed_transfers_total")
    with sim("decode", *flags, "--engine-id", engine_id, name="pd-fixed") as d:
        for seed in (82, 83):  # handles of the new process, not only the old one's
            status, body = await hit_on_p(d, seed)  # D pulls from P: fine
            assert status == 500 and body["error"]["type"] == "InternalServerError"
    assert await metric(p.url, "vllm:nixl_num_failed_transfers_total") == failed + 2
    with sim("decode", *flags, "--engine-id", f"{engine_id}-new", name="pd-fixed") as d:
        assert (await hit_on_p(d, 84))[0] == 200
