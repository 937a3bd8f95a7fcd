"""Handles cannot aim anywhere (issue 32, item 2): even unsigned, a stored handle reaches a P
only if its engine id, side-channel host and port are those its D announced. One aimed at
another address (here a socket of the test's own) is `miss;reason=handle-invalid`, logged once
for the conversation, and never sent: not for a read, not for a release."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator

import redis

from harness.chat import JSON, post
from harness.metrics import metric
from harness.procs import free_port, wait_until
from tests.reliability.conftest import ROUTER_FLAGS, SESSION_SECRET, Stack
from tests.reliability.helpers import Conversation, instance, new_cid, router, session
from tests.support.fake_d import Shape, fake_d

UNSIGNED = [f for f in ROUTER_FLAGS if f not in ("--session-secret", SESSION_SECRET)]


class Trap:
    """A listening socket on 127.0.0.1 that counts the connections made to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = int(self.sock.getsockname()[1])
        self.connections = 0
        self.done = threading.Event()

    def serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            self.connections += 1
            conn.close()


@contextlib.contextmanager
def trap() -> Iterator[Trap]:
    t = Trap()
    thread = threading.Thread(target=t.serve, daemon=True)
    thread.start()
    try:
        yield t
    finally:
        t.done.set()
        thread.join(5)
        t.sock.close()


def aim(redis_url: str, cid: str, port: int) -> None:
    """Point the stored handle's side channel at `port` (as anyone who can write Redis can)."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        (key,) = client.keys(f"kvbaton:conv:{{*:{cid}}}")
        params = json.loads(client.hget(key, "kv_transfer_params") or "null")
        assert params is not None, "the turn left no handle"
        params["remote_port"] = port
        client.hset(key, "kv_transfer_params", json.dumps(params))
    finally:
        client.close()


def test_a_handle_aimed_at_another_address_is_never_sent(main: Stack) -> None:
    ps, ds = [p.url for p in main.ps], [d.url for d in main.ds]
    flags = [*UNSIGNED, "--unsigned-sessions"]
    with trap() as t, router(ps, ds, *flags, redis_url=main.redis_url, name="rel-aim") as r:
        # A hit: the handle would go to P for a read.
        conv = Conversation(r.url, main.ref, new_cid("aim"))
        conv.turn()
        aim(main.redis_url, str(conv.cid), t.port)
        assert conv.turn().reuse == "miss;reason=handle-invalid"  # the oracle's answer too
        assert conv.turn().reuse == "hit", "the miss committed D's own handle"
        # A turn that cannot use the handle (history edited): it would be released via a P.
        aim(main.redis_url, str(conv.cid), t.port)
        conv.messages[0]["content"] += " (edited)"
        assert conv.turn().reuse == "miss;reason=handle-invalid"
        # An ended conversation: its handle would be released at once.
        aim(main.redis_url, str(conv.cid), t.port)
        ended = post(f"{r.url}/v1/conversations/{conv.cid}", method="DELETE", headers=JSON)
        assert ended.status == 200, ended.body
        assert session(main.redis_url, str(conv.cid)) == {}
        time.sleep(1.0)  # releases are queued: give them the time to go out
        log = r.log.read_text()
    assert t.connections == 0, "P connected to the address the stored handle named"
    invalid = [line for line in log.splitlines() if "not used (handle-invalid)" in line]
    assert len(invalid) == 2, invalid  # one line for each turn that found a handle aimed away


def moved_to(port: int) -> Shape:
    """D's answer with its handle's side channel moved to `port` (a middlebox, a bad D)."""

    def shape(body: bytes) -> tuple[bytes, str]:
        answer = json.loads(body)
        assert answer["kv_transfer_params"]["remote_port"] != port
        answer["kv_transfer_params"]["remote_port"] = port
        return json.dumps(answer).encode(), "application/json"

    return shape


def test_a_d_answer_naming_another_address_sends_no_p_there(main: Stack) -> None:
    """Issue 50, item 2: D's side channel is pinned from its first handle. An answer whose
    handle names another port is not kept (the next turn is `miss;reason=handle-invalid`),
    said once with D's URL, counted, and no P connects there, not to read nor to release."""
    ps = [p.url for p in main.ps]
    with (
        trap() as t,
        fake_d(main.ds[0].url) as d,
        router(ps, [d.url], *ROUTER_FLAGS, redis_url=main.redis_url, name="rel-moved") as r,
    ):
        wait_until(lambda: instance(r.url, "decode", d.url)["usable"], "the fake D is not usable")
        conv = Conversation(r.url, main.ref, new_cid("moved"))
        conv.turn()  # pins D's side channel
        assert conv.turn().reuse == "hit"
        moved = metric(r.url, "kvbaton_decode_moved_handles_total", instance=d.url)
        d.shape = moved_to(t.port)
        conv.turn()  # served as usual; its handle names the trap
        assert d.broken == 1
        assert conv.turn().reuse == "miss;reason=handle-invalid"
        assert conv.turn().reuse == "hit", "D's next own handle was not kept"
        assert metric(r.url, "kvbaton_decode_moved_handles_total", instance=d.url) == moved + 1
        log = r.log.read_text()
    assert t.connections == 0, "P connected to the address D's answer named"
    said = [
        line for line in log.splitlines() if "another side channel than the one it showed" in line
    ]
    assert len(said) == 1 and d.url in said[0], said


def test_a_d_restarted_on_a_new_side_channel_is_followed(main: Stack) -> None:
    """A D that restarts on another side-channel port (a new engine id too) before the health
    loop reads its new start time: its first new handle is believed once D's /metrics shows
    the new process, asked at once, so the turn after is a hit on the new address."""
    ps = [p.url for p in main.ps]
    slow_health = [*ROUTER_FLAGS, "--health-interval", "3600"]
    with router(ps, [main.ds[0].url], *slow_health, redis_url=main.redis_url, name="rel-mv") as r:
        conv = Conversation(r.url, main.ref, new_cid("moved-restart"))
        conv.turn()
        assert conv.turn().reuse == "hit"
        new_port = free_port()
        main.restart("decode", 0, "--kv-port", str(new_port), "--engine-id", f"re-{new_cid('e')}")
        wait_until(lambda: instance(r.url, "decode", main.ds[0].url)["usable"], "D not usable")
        conv.turn(check=False)  # the old handle names blocks of the old process
        assert conv.turn().reuse == "hit", "the restarted D's handle was not kept"
        assert conv.turn().reuse == "hit"
        assert metric(r.url, "kvbaton_decode_moved_handles_total", instance=main.ds[0].url) == 0
        params = json.loads(session(main.redis_url, str(conv.cid))["kv_transfer_params"])
    assert params["remote_port"] == new_port
