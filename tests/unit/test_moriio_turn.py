"""A MoRI-IO turn (`--kv-connector moriio`) through the fake engines: only announced instances
serve, both legs carry the request id that names both peers, READ mode hands P's blocks to D
after P answers, WRITE mode sends both legs at once, and a failed leg is one 502."""

from __future__ import annotations

import re

import pytest

from router.connectors.moriio.announce import Peer
from router.connectors.moriio.connector import MoriIO
from router.errors import UpstreamError
from router.services import Services
from tests.unit.fake_engines import FakeEngines
from tests.unit.turns import D1, D2, P1, P2, services, turn

ZMQ = {
    url: f"host:10.0.0.{i},handshake:{6300 + i},notify:{6400 + i}" for i, url in enumerate((P1, D1))
}
HI = [{"role": "user", "content": "hi"}]


def mori_services(engines: FakeEngines, mode: str) -> Services:
    svc = services(engines, kv_connector="moriio", moriio_register="tcp://127.0.0.1:1")
    assert isinstance(svc.connector, MoriIO)
    for url, role in ((P1, "prefill"), (D1, "decode")):  # P2 and D2 never announce
        svc.connector.peers.note(Peer(role, url, ZMQ[url], 1, 1, mode, svc.clock()))  # type: ignore[arg-type]
    return svc


def legs(engines: FakeEngines) -> tuple[dict[str, object], dict[str, object], str, str]:
    p = [c for c in engines.calls if "/v1/" in c.url and c.url.startswith((P1, P2))][-1]
    d = [c for c in engines.calls if "/v1/" in c.url and c.url.startswith((D1, D2))][-1]
    assert p.url.startswith(P1) and d.url.startswith(D1), "only announced instances serve"
    return p.body["kv_transfer_params"], d.body["kv_transfer_params"], p.request_id, d.request_id


async def test_read_mode_hands_p_s_blocks_to_d_under_the_addressed_request_id() -> None:
    engines = FakeEngines()
    svc = mori_services(engines, "READ")
    for _ in range(2):
        status, headers, body = await turn(svc, HI, "client-rid")
        assert status == 200 and headers["x-request-id"] == "client-rid"
        assert body["choices"][0]["message"]["content"]
        p_kv, d_kv, p_rid, d_rid = legs(engines)
        assert p_rid == d_rid
        assert re.fullmatch(
            rf"___prefill_addr_{re.escape(ZMQ[P1])}___decode_addr_{re.escape(ZMQ[D1])}_[0-9a-f]{{32}}",
            p_rid,
        )
        assert p_kv["transfer_id"] == d_kv["transfer_id"] and p_kv["do_remote_decode"] is True
        assert d_kv["remote_block_ids"] and d_kv["remote_engine_id"] == "engine-p1"
    assert headers["x-kv-reuse"] == "miss;reason=push-affinity"  # no D->P handle: affinity


async def test_write_mode_sends_both_legs_at_once_without_block_ids() -> None:
    engines = FakeEngines()
    svc = mori_services(engines, "WRITE")
    status, _, _ = await turn(svc, HI)
    assert status == 200
    p_kv, d_kv, p_rid, d_rid = legs(engines)
    assert p_rid == d_rid and d_kv["transfer_id"] == p_kv["transfer_id"]
    assert d_kv["remote_block_ids"] is None and d_kv["do_remote_prefill"] is True


@pytest.mark.parametrize("mode", ["READ", "WRITE"])
async def test_a_failed_prefill_leg_ends_the_turn_in_one_upstream_error(mode: str) -> None:
    engines = FakeEngines()
    engines.scripts[P1] = lambda call: 500 if "/v1/" in call.url else None
    svc = mori_services(engines, mode)
    with pytest.raises(UpstreamError, match="MoRI-IO turn failed: http://p1 answered 500"):
        await turn(svc, HI, "rid-7")  # the app maps it to a 502 with X-Request-Id rid-7
    d_legs = [c for c in engines.calls if c.url.startswith(D1)]
    assert len(d_legs) == (1 if mode == "WRITE" else 0)  # READ: D is never asked
    assert len(engines.calls_to(P1, "/v1/")) == 1  # no redo (MoRI-IO frees on its own timeout)
