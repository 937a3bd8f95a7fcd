"""A push-mode turn (`--kv-connector nixl-push`) through the fake engines: both legs carry the
turn's request id and one fresh transfer id, D gets P's coordinates and no block ids, a busy P
hands the turn to another P."""

from __future__ import annotations

from router.connectors.nixl_push.connector import NixlPush
from router.connectors.nixl_push.coords import Coordinates
from router.services import Services
from tests.unit.fake_engines import FakeEngines
from tests.unit.turns import D1, P1, P2, services, turn


def push_services(engines: FakeEngines) -> Services:
    svc = services(engines, kv_connector="nixl-push")
    assert isinstance(svc.connector, NixlPush)
    for i, url in enumerate((P1, P2)):
        svc.connector.known.given(url, Coordinates(f"p{i}", "10.0.0.1", 5600 + i, source="config"))
    return svc


async def test_both_legs_carry_one_request_id_and_a_fresh_transfer_id() -> None:
    engines = FakeEngines()
    svc = push_services(engines)
    seen = []
    for rid in ("r1", "r2"):
        assert isinstance(svc.connector, NixlPush)
        told = {url: svc.connector.known.of(url).coords for url in (P1, P2)}
        status, headers, _ = await turn(svc, [{"role": "user", "content": "hi"}], rid)
        assert status == 200 and headers["x-request-id"] == rid
        p_call = [c for c in engines.calls if c.url.startswith((P1, P2)) and "/v1/" in c.url][-1]
        d_call = [c for c in engines.calls if c.url.startswith(D1) or "d2" in c.url][-1]
        p_kv, d_kv = p_call.body["kv_transfer_params"], d_call.body["kv_transfer_params"]
        assert p_call.request_id == d_call.request_id == rid
        assert p_call.body["max_tokens"] == 1
        assert p_kv["do_remote_decode"] is True and p_kv["remote_engine_id"] is None
        assert d_kv["transfer_id"] == p_kv["transfer_id"]
        assert d_kv["remote_request_id"] == rid and "remote_block_ids" not in d_kv
        coords = told[p_call.url.split("/v1/")[0]]  # what the router knew when it sent D
        assert coords is not None
        assert (d_kv["remote_engine_id"], d_kv["remote_port"]) == (coords.engine_id, coords.port)
        seen.append(p_kv["transfer_id"])
    assert len(set(seen)) == 2


async def test_a_busy_push_prefill_429_goes_to_another() -> None:
    engines = FakeEngines()
    engines.scripts[P1] = lambda call: 429 if "/v1/" in call.url else None
    svc = push_services(engines)
    for _ in range(3):
        status, _, _ = await turn(svc, [{"role": "user", "content": "hi"}])
        assert status == 200
    assert engines.calls_to(P1, "/v1/"), "P1 was tried"
    assert svc.pool.find("prefill", P1).failures == 0  # type: ignore[union-attr]
    engines.scripts[P2] = engines.scripts[P1]
    status, headers, _ = await turn(svc, [{"role": "user", "content": "hi"}])
    assert status == 429 and headers["x-request-id"] == "rid"
