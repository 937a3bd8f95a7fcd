"""MoRI-IO's pure parts: announcements, the announced instances and their timeout, the request
id and params the router builds, and the simulator's reading of them."""

from __future__ import annotations

import re
from typing import Any

import pytest

from router.config import load_settings
from router.connectors.moriio import params as moriio
from router.connectors.moriio.announce import Peer, Peers, parse
from router.connectors.select import select
from router.errors import ConfigError
from vllm_sim import moriio as sim_moriio
from vllm_sim.errors import KVLoadError

P_ZMQ = "host:10.0.0.1,handshake:6301,notify:61005"
D_ZMQ = "host:10.0.0.2,handshake:6302,notify:61006"


def hello(**over: Any) -> dict[str, Any]:
    msg = {
        "type": "P",
        "http_address": "10.0.0.1:8100",
        "zmq_address": P_ZMQ,
        "dp_size": 2,
        "tp_size": 1,
        "transfer_mode": "READ",
    }
    msg.update(over)
    return msg


def test_an_announcement_parses_to_a_peer_with_an_http_url() -> None:
    peer = parse(hello(), 5.0)
    assert isinstance(peer, Peer)
    assert (peer.role, peer.url, peer.dp_size, peer.transfer_mode) == (
        "prefill",
        "http://10.0.0.1:8100",
        2,
        "READ",
    )
    d = parse(hello(type="D", http_address="http://h:1/"), 0.0)
    assert isinstance(d, Peer) and (d.role, d.url) == ("decode", "http://h:1")


@pytest.mark.parametrize(
    "over",
    [
        {"type": "HELLO"},
        {"type": "X"},
        {"http_address": ""},
        {"zmq_address": "10.0.0.1:6301"},
        {"dp_size": 0},
        {"tp_size": True},
        {"transfer_mode": "read"},
    ],
)
def test_a_bad_announcement_is_refused(over: dict[str, Any]) -> None:
    assert isinstance(parse(hello(**over), 0.0), str)
    assert isinstance(parse(["not", "a", "map"], 0.0), str)


def test_peers_expire_after_the_ttl_and_refuse_another_mode() -> None:
    now = [0.0]
    peers = Peers(ttl=2.0, clock=lambda: now[0])
    p = parse(hello(), now[0])
    assert isinstance(p, Peer) and peers.note(p) is True
    assert peers.note(p) is False  # heard again: no change
    d = parse(hello(type="D", http_address="h:2", transfer_mode="WRITE"), now[0])
    assert isinstance(d, Peer) and peers.note(d) is False  # the mode is READ
    assert peers.urls("decode") == () and peers.mode == "READ"
    now[0] = 1.5
    assert peers.expire() is False and peers.urls("prefill") == ("http://10.0.0.1:8100",)
    now[0] = 2.5
    assert peers.expire() is True and peers.urls("prefill") == ()


def test_the_request_id_is_the_toy_proxys_and_names_both_peers() -> None:
    rid = moriio.request_id(P_ZMQ, D_ZMQ)
    assert re.fullmatch(
        rf"___prefill_addr_{re.escape(P_ZMQ)}___decode_addr_{re.escape(D_ZMQ)}_[0-9a-f]{{32}}", rid
    )
    # vLLM wraps it (chatcmpl-<id>-<8 random>); both sides still find their peer.
    internal = f"chatcmpl-{rid}-a1b2c3d4"
    assert sim_moriio.peer(internal, producer=False) == ("10.0.0.1", 6301)
    assert sim_moriio.peer(internal, producer=True) == ("10.0.0.2", 6302)
    with pytest.raises(KVLoadError):
        sim_moriio.peer("chatcmpl-plain-id", producer=False)


def test_params_for_p_and_d() -> None:
    p = moriio.p_params("tx-1", 2, 1)
    assert p["do_remote_decode"] is True and p["transfer_id"] == "tx-1"
    assert (p["remote_dp_size"], p["remote_tp_size"]) == (2, 1)
    answered = {"remote_engine_id": "e_dp1", "remote_block_ids": [[3, 4]], "transfer_id": "tx-1"}
    assert moriio.read_handoff(answered, "tx-1") == ""
    assert moriio.read_handoff({**answered, "transfer_id": "tx-2"}, "tx-1")
    assert moriio.read_handoff({"transfer_id": "tx-1"}, "tx-1")
    d = moriio.d_params("tx-1", 2, 1, 1, answered)
    assert d["do_remote_prefill"] is True and d["remote_dp_rank"] == 1
    assert (d["remote_engine_id"], d["remote_block_ids"]) == ("e_dp1", [[3, 4]])
    assert "remote_dp_rank" not in moriio.d_params("tx-1", 1, 1, -1, {})


def test_the_simulator_reads_ds_params_at_the_ids_address_plus_the_rank() -> None:
    rid = moriio.request_id(P_ZMQ, D_ZMQ)
    d = moriio.d_params("tx-1", 2, 1, 1, {"remote_engine_id": "e_dp1", "remote_block_ids": [[3]]})
    read = sim_moriio.as_rules(d, rid, "READ")
    assert read is not None
    assert (read["remote_host"], read["remote_port"]) == ("10.0.0.1", 6302)
    assert read["remote_request_id"] == "tx-1"  # P pinned its blocks under the transfer id
    write = sim_moriio.as_rules(d, rid, "WRITE")
    assert write is not None and write["remote_request_id"] == rid
    assert sim_moriio.as_rules({"do_remote_prefill": True}, rid, "READ") == {}


MORI = ["--kv-connector", "moriio", "--moriio-register", "tcp://h:1"]


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (["--kv-connector", "moriio"], "go together"),  # no registration: nothing addressable
        (["--moriio-register", "tcp://h:1"], "announce themselves"),  # for another connector
        ([*MORI, "--workers", "2", "--redis-url", "redis://r:1"], "--workers 1"),
        ([*MORI, "--moriio-register-ttl", "0"], "ttl must be"),
    ],
)
def test_moriio_settings_that_cannot_work_are_refused(argv: list[str], why: str) -> None:
    with pytest.raises(ConfigError, match=why):
        select(load_settings(["--prefill", "http://p:1", "--decode", "http://d:1", *argv], env={}))


def test_with_registration_no_static_urls_are_needed() -> None:
    settings = load_settings(MORI, env={})
    assert settings.prefill == () and settings.decode == ()
