"""vllm#51919 on the simulator: first-token seeding and parked D requests released by
/v1/pd_kv_ready, between real processes; the from-scratch answer is the oracle."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from harness.chat import NULL_HANDOFF
from harness.procs import SimProc, sims
from tests.sim.client import chat, get, metric, post, words
from vllm_sim import handover
from vllm_sim.config import SimSettings
from vllm_sim.metrics import Counters
from vllm_sim.request import GenRequest
from vllm_sim.steps import StepLoop
from vllm_sim.tokenizer import Tokenizer

PARKED = {"do_remote_decode": False, "do_remote_prefill": True, "remote_ready": False}


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, SimProc]]:
    """P seeds; D honours seeds and parks (a short park timeout); Dold has neither feature;
    R computes from scratch."""
    specs = {
        "P": ("prefill", "--bidirectional", "--seed-first-token"),
        "D": (
            "decode",
            "--bidirectional",
            "--seed-first-token",
            "--pd-kv-ready",
            "--pd-park-timeout",
            "1.5",
            "--kv-load-failure-policy",
            "recompute",
        ),
        "Dold": ("decode", "--bidirectional"),
        "R": ("prefill",),
    }
    with sims(*specs.values(), name="handover") as procs:
        yield dict(zip(specs, procs, strict=True))


async def _prefill(p: SimProc, msgs: list[dict[str, Any]], rid: str = "") -> dict[str, Any]:
    headers = {"X-Request-Id": rid} if rid else None
    body = {"messages": msgs, "max_tokens": 1, "kv_transfer_params": NULL_HANDOFF}
    status, answer = await post(p.url + "/v1/chat/completions", body, headers)
    assert status == 200, answer
    return dict(answer["kv_transfer_params"])


async def _decode(
    d: SimProc, msgs: list[dict[str, Any]], params: dict[str, Any] | None, n: int = 12, **extra: Any
) -> tuple[list[int], str]:
    kv = {"kv_transfer_params": params} if params is not None else {}
    status, body = await chat(d.url, msgs, max_tokens=n, return_token_ids=True, **kv, **extra)
    assert status == 200, body
    choice = body["choices"][0]
    return choice["token_ids"], choice["message"]["content"]


async def _fallbacks(d: SimProc, reason: str) -> float:
    try:
        return await metric(d.url, "vllm_sim:seed_fallbacks_total", reason=reason)
    except KeyError:
        return 0.0


def _msgs(seed: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": words(seed, 50)}]


async def test_p_ships_its_token_and_seeding_gives_the_same_answer(
    cluster: dict[str, SimProc],
) -> None:
    p, d, old, r = cluster["P"], cluster["D"], cluster["Dold"], cluster["R"]
    msgs = _msgs(1)
    want = await _decode(r, msgs, None)
    seeded = await metric(d.url, "vllm_sim:seeded_first_tokens_total")
    params = await _prefill(p, msgs)
    assert params["first_token_ids"] == want[0][:1]
    assert await _decode(d, msgs, params) == want
    assert await metric(d.url, "vllm_sim:seeded_first_tokens_total") == seeded + 1
    # An engine without the feature ignores the field and computes token 1 itself.
    assert await _decode(old, msgs, await _prefill(p, msgs)) == want
    assert await metric(d.url, "vllm_sim:seed_mismatches_total") == 0


async def test_a_seed_unlike_the_engines_token_changes_the_answer(
    cluster: dict[str, SimProc],
) -> None:
    p, d, r = cluster["P"], cluster["D"], cluster["R"]
    msgs = _msgs(2)
    want = await _decode(r, msgs, None)
    params = await _prefill(p, msgs)
    params["first_token_ids"] = (await _prefill(p, _msgs(3)))["first_token_ids"]
    assert params["first_token_ids"] != want[0][:1]
    before = await metric(d.url, "vllm_sim:seed_mismatches_total")
    got = await _decode(d, msgs, params)
    assert got[0][0] == params["first_token_ids"][0] and got != want  # the oracle sees it
    assert await metric(d.url, "vllm_sim:seed_mismatches_total") == before + 1


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ({"logprobs": True, "top_logprobs": 2}, handover.LOGPROBS),
        ({"response_format": {"type": "json_object"}}, handover.STRUCTURED),
        ({"max_tokens": 1}, handover.FINISHES),
    ],
)
async def test_fallbacks_compute_token_one(
    cluster: dict[str, SimProc], extra: dict[str, Any], reason: str
) -> None:
    p, d, r = cluster["P"], cluster["D"], cluster["R"]
    msgs = _msgs(4)
    n = extra.pop("max_tokens", 6)
    want = await _decode(r, msgs, None, n)
    before = await _fallbacks(d, reason)
    seeded = await metric(d.url, "vllm_sim:seeded_first_tokens_total")
    assert await _decode(d, msgs, await _prefill(p, msgs), n, **extra) == want
    assert await _fallbacks(d, reason) == before + 1
    assert await metric(d.url, "vllm_sim:seeded_first_tokens_total") == seeded


async def test_a_failed_load_falls_back(cluster: dict[str, SimProc]) -> None:
    p, d, r = cluster["P"], cluster["D"], cluster["R"]
    msgs = _msgs(5)
    want = await _decode(r, msgs, None)
    params = await _prefill(p, msgs)
    params["remote_engine_id"] = "gone"  # P's side channel refuses the read
    before = await _fallbacks(d, handover.LOAD_FAILED)
    assert await _decode(d, msgs, params) == want
    assert await _fallbacks(d, handover.LOAD_FAILED) == before + 1


async def test_learnable_by_an_empty_ready_body(cluster: dict[str, SimProc]) -> None:
    status, body = await post(cluster["D"].url + "/v1/pd_kv_ready", {})
    assert status == 400 and body["error"]["type"] == "BadRequestError"
    status, _ = await post(cluster["Dold"].url + "/v1/pd_kv_ready", {})
    assert status == 404


async def _parked(d: SimProc, msgs: list[dict[str, Any]], rid: str) -> asyncio.Task[Any]:
    """D's request sent first, parked; returns when D shows it parked."""
    body = {"messages": msgs, "max_tokens": 12, "return_token_ids": True}
    body["kv_transfer_params"] = PARKED
    task = asyncio.create_task(
        post(d.url + "/v1/chat/completions", body, headers={"X-Request-Id": rid})
    )
    await _until(d, lambda parked: rid in parked)
    return task


async def _until(d: SimProc, cond: Any) -> None:
    async with asyncio.timeout(10):
        while True:
            _, state = await get(d.url + "/sim/state")
            if cond(state["parked"]):
                return
            await asyncio.sleep(0.02)


def _answer(result: tuple[int, Any]) -> tuple[list[int], str]:
    status, body = result
    assert status == 200, body
    choice = body["choices"][0]
    return choice["token_ids"], choice["message"]["content"]


async def test_a_parked_request_is_released_by_the_ready_notification(
    cluster: dict[str, SimProc],
) -> None:
    p, d, r = cluster["P"], cluster["D"], cluster["R"]
    msgs, rid = _msgs(6), uuid.uuid4().hex
    want = await _decode(r, msgs, None, 12)
    task = await _parked(d, msgs, rid)
    params = await _prefill(p, msgs, rid)
    ready = {"request_id": rid, "kv_transfer_params": params}
    status, _ = await post(d.url + "/v1/pd_kv_ready", ready)
    assert status == 200
    _, body = result = await task
    assert _answer(result) == want
    assert body["kv_transfer_params"]["do_remote_decode"] is True  # D's handle, as ever
    # P's blocks were read (the pin freed), and the id is not parked any more.
    _, state = await get(p.url + "/sim/state")
    assert params["remote_request_id"] not in {x["request_id"] for x in state["pins"]}
    assert (await post(d.url + "/v1/pd_kv_ready", ready))[0] == 404


async def test_a_lost_notification_is_covered_by_the_park_timeout(
    cluster: dict[str, SimProc],
) -> None:
    p, d, r = cluster["P"], cluster["D"], cluster["R"]
    msgs, rid = _msgs(7), uuid.uuid4().hex
    want = await _decode(r, msgs, None, 12)
    timeouts = await metric(d.url, "vllm_sim:park_timeouts_total")
    await post(d.url + "/sim/faults", {"drop_ready_next": 1})
    task = await _parked(d, msgs, rid)
    ready = {"request_id": rid, "kv_transfer_params": await _prefill(p, msgs, rid)}
    assert (await post(d.url + "/v1/pd_kv_ready", ready))[0] == 200  # 2xx, then lost
    _, body = result = await task  # D prefills locally after its park timeout
    assert _answer(result) == want
    assert body["kv_transfer_params"]["do_remote_decode"] is True
    assert await metric(d.url, "vllm_sim:park_timeouts_total") == timeouts + 1


async def test_a_parked_request_whose_client_left_is_gone(cluster: dict[str, SimProc]) -> None:
    d = cluster["D"]
    msgs, rid = _msgs(8), uuid.uuid4().hex
    body = {"messages": msgs, "max_tokens": 4, "stream": True, "kv_transfer_params": PARKED}
    session = aiohttp.ClientSession()
    try:
        resp = await session.post(
            d.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": rid}
        )
        await _until(d, lambda parked: rid in parked)
        resp.close()
    finally:
        await session.close()
    await _until(d, lambda parked: rid not in parked)
    ready = {"request_id": rid, "kv_transfer_params": {"do_remote_prefill": True}}
    assert (await post(d.url + "/v1/pd_kv_ready", ready))[0] == 404


@pytest.mark.parametrize(
    ("body", "blocker"),
    [
        ({}, ""),
        ({"logprobs": False, "top_logprobs": None}, ""),
        ({"logprobs": 0}, handover.LOGPROBS),
        ({"prompt_logprobs": 1}, handover.LOGPROBS),
        ({"response_format": {"type": "text"}}, ""),
        ({"response_format": {"type": "json_schema"}}, handover.STRUCTURED),
        ({"guided_regex": "a+"}, handover.STRUCTURED),
        ({"structured_outputs": {"json": {}}}, handover.STRUCTURED),
        ({"text": {"format": {"type": "json_schema"}}}, handover.STRUCTURED),
    ],
)
def test_request_blocker(body: dict[str, Any], blocker: str) -> None:
    assert handover.request_blocker(body) == blocker


@pytest.mark.parametrize(
    ("params", "token"),
    [
        (None, None),
        ({"first_token_ids": [7]}, 7),
        ({"first_token_ids": []}, None),
        ({"first_token_ids": [1, 2]}, None),
        ({"first_token_ids": [True]}, None),
        ({"first_token_ids": [-1]}, None),
        ({"first_token_ids": "7"}, None),
    ],
)
def test_seeded_token(params: dict[str, Any] | None, token: int | None) -> None:
    assert handover.seeded_token(params) == token


def test_ready_body_and_parked_leg() -> None:
    assert handover.ready_body({"request_id": "r", "kv_transfer_params": {"a": 1}}) == (
        "r",
        {"a": 1},
    )
    for bad in (None, [], {"request_id": "r"}, {"request_id": "", "kv_transfer_params": {"a": 1}}):
        with pytest.raises(ValueError):
            handover.ready_body(bad)
    assert handover.is_parked_leg(PARKED)
    assert not handover.is_parked_leg({**PARKED, "remote_ready": True})
    assert not handover.is_parked_leg(None)
    assert handover.local_params(PARKED) == {"do_remote_prefill": False, "do_remote_decode": False}


async def test_parking_delivers_times_out_and_forgets() -> None:
    parking = handover.Parking(timeout=5.0)
    waiter = asyncio.create_task(parking.wait("a"))
    await asyncio.sleep(0)
    assert parking.ids() == ["a"] and not parking.deliver("b", {})
    assert parking.deliver("a", {"x": 1}) and await waiter == {"x": 1}
    assert len(parking) == 0
    quick = handover.Parking(timeout=0.01)
    assert await quick.wait("c") is None and len(quick) == 0
    waiter = asyncio.create_task(parking.wait("d"))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert not parking.deliver("d", {})


async def test_a_forward_cost_alone_takes_a_step() -> None:
    loop = StepLoop()
    await loop.prefill(1)  # no cost at all: nothing waits
    assert loop.steps == 0
    await loop.prefill(1, forward_ms=1.0)
    assert loop.steps == 1
    await loop.prefill(0, forward_ms=1.0)  # a D leg that pulled every prompt token
    assert loop.steps == 2
    assert StepLoop(prefill_ms_per_token=1.0).step_s(10, 0, 5.0) == 0.015


def test_speculative_decoding_and_other_legs_never_seed() -> None:
    tok, token = Tokenizer(), Tokenizer().emittable[0]
    req = GenRequest("r", [1, 2, 3], 8, kv_params={"first_token_ids": [token]})
    on = SimSettings(seed_first_token=True)
    counters = Counters()
    assert handover.seed_for(on, counters, tok, req, "pull_prompt", False) == token
    assert handover.seed_for(on, counters, tok, req, "plain", False) is None  # not a D leg
    off = SimSettings()
    assert handover.seed_for(off, counters, tok, req, "pull_prompt", False) is None
    spec = SimSettings(seed_first_token=True, num_speculative_tokens=2)
    assert handover.seed_for(spec, counters, tok, req, "pull_prompt", False) is None
    assert counters.sim_seed_fallbacks == {handover.SPECULATIVE: 1}
    assert counters.sim_seeded_first_tokens == 1
