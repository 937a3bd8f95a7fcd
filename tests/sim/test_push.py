"""Push mode (`--kv-connector nixl-push`) between simulators, called as vLLM's push demo proxy
calls them: P and D concurrently, one request id and a fresh transfer id per dispatch. Each
wrong wiring (wrong coordinates, a reused transfer id, P before D) must fail, never succeed."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from harness.chat import NULL_HANDOFF
from tests.sim.client import metric, post, words
from tests.sim.conftest import InProc, running

N = 8


def p_params(transfer_id: str) -> dict[str, Any]:
    return {**NULL_HANDOFF, "transfer_id": transfer_id}


def d_params(p: InProc, request_id: str, transfer_id: str, **override: Any) -> dict[str, Any]:
    engine = p.sim.engine
    out = {
        "do_remote_decode": False,
        "do_remote_prefill": True,
        "remote_engine_id": engine.engine_id,
        "remote_host": "127.0.0.1",
        "remote_port": engine.kv_port,
        "tp_size": 1,
        "pp_size": 1,
        "remote_request_id": request_id,
        "transfer_id": transfer_id,
    }
    out.update(override)
    return out


@pytest.fixture
async def trio() -> AsyncIterator[tuple[InProc, InProc, InProc]]:
    push: dict[str, Any] = {"kv_connector": "nixl-push", "kv_lease_duration": 1.0}
    async with (
        running(role="prefill", **push) as p,
        running(role="decode", push_registration_timeout=1.5, **push) as d,
        running(role="prefill") as ref,
    ):
        yield p, d, ref


def messages(seed: int) -> list[dict[str, Any]]:
    return [{"role": "user", "content": words(seed, 70)}]


async def leg(
    url: str, msgs: list[dict[str, Any]], rid: str, kv: dict[str, Any] | None, n: int
) -> tuple[int, Any]:
    body: dict[str, Any] = {"messages": msgs, "max_tokens": n}
    if kv is not None:
        body["kv_transfer_params"] = kv
    return await post(url + "/v1/chat/completions", body, headers={"X-Request-Id": rid})


async def both(
    p: InProc, d: InProc, msgs: list[dict[str, Any]], rid: str, xfer: str, **override: Any
) -> tuple[tuple[int, Any], tuple[int, Any]]:
    got = await asyncio.gather(
        leg(p.url, msgs, rid, p_params(xfer), 1),
        leg(d.url, msgs, rid, d_params(p, rid, xfer, **override), N),
    )
    return got[0], got[1]


def text(body: Any) -> str:
    return str(body["choices"][0]["message"]["content"])


async def test_concurrent_push_answers_as_from_scratch(
    trio: tuple[InProc, InProc, InProc],
) -> None:
    p, d, ref = trio
    msgs = messages(1)
    rid = uuid.uuid4().hex
    (ps, pb), (ds, db) = await both(p, d, msgs, rid, f"xfer-{uuid.uuid4()}")
    assert ps == 200 and ds == 200, (pb, db)
    rs, rb = await leg(ref.url, msgs, "ref", None, N)
    assert rs == 200
    assert text(db) == text(rb)
    # P learned nothing from D; what the router learns from P's answer: its coordinates.
    kv = pb["kv_transfer_params"]
    assert kv["transfer_mode"] == "push"
    assert kv["remote_engine_id"] == p.sim.engine.engine_id
    assert kv["remote_port"] == p.sim.engine.kv_port
    assert await metric(p.url, "vllm_sim:push_writes_total") == 1
    written = await metric(p.url, "vllm_sim:push_blocks_written_total")
    assert written >= 71 // 16  # the prompt's blocks
    assert await metric(d.url, "vllm_sim:push_blocks_received_total") == written
    assert await metric(d.url, "vllm:external_prefix_cache_hits_total") > 0


@pytest.mark.parametrize(
    "override",
    [
        {"remote_engine_id": "not-p"},
        {"remote_port": 1},
        {"tp_size": 2},
        {"remote_request_id": "another-request"},
    ],
    ids=["engine-id", "port", "tp-size", "request-id"],
)
async def test_wrong_coordinates_fail(
    trio: tuple[InProc, InProc, InProc], override: dict[str, Any]
) -> None:
    p, d, _ = trio
    (_, _), (ds, db) = await both(
        p, d, messages(2), uuid.uuid4().hex, f"xfer-{uuid.uuid4()}", **override
    )
    assert ds == 500, db
    assert await metric(p.url, "vllm_sim:push_writes_total") == 0


async def test_reused_transfer_id_fails(trio: tuple[InProc, InProc, InProc]) -> None:
    p, d, _ = trio
    xfer = f"xfer-{uuid.uuid4()}"
    (_, _), (ds, _) = await both(p, d, messages(3), uuid.uuid4().hex, xfer)
    assert ds == 200
    msgs = messages(4)
    (_, _), (ds, db) = await both(p, d, msgs, uuid.uuid4().hex, xfer)
    assert ds == 500, db  # P refuses a registration for a transfer it already served
    assert await metric(p.url, "vllm_sim:push_writes_total") == 1


async def test_sequential_dispatch_fails(trio: tuple[InProc, InProc, InProc]) -> None:
    """P first, then D (the pull proxies' order): P waits its lease for a registration that
    cannot come yet, gives up, and D's registration is then refused."""
    p, d, _ = trio
    msgs, rid, xfer = messages(5), uuid.uuid4().hex, f"xfer-{uuid.uuid4()}"
    started = time.monotonic()
    ps, _ = await leg(p.url, msgs, rid, p_params(xfer), 1)
    assert ps == 200
    assert time.monotonic() - started >= 1.0  # the lease
    ds, db = await leg(d.url, msgs, rid, d_params(p, rid, xfer), N)
    assert ds == 500, db
    assert await metric(p.url, "vllm_sim:push_lease_expired_total") == 1
    assert await metric(p.url, "vllm_sim:push_writes_total") == 0


async def test_d_times_out_without_p(trio: tuple[InProc, InProc, InProc]) -> None:
    """P never gets its leg (it failed): D gives up after push_registration_timeout."""
    p, d, _ = trio
    rid, xfer = uuid.uuid4().hex, f"xfer-{uuid.uuid4()}"
    started = time.monotonic()
    ds, db = await leg(d.url, messages(6), rid, d_params(p, rid, xfer), N)
    assert ds == 500, db
    assert time.monotonic() - started >= 1.5
    assert await metric(d.url, "vllm_sim:push_registration_timeouts_total") == 1
