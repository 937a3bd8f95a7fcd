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

from tests.reliability.conftest import ROUTER_FLAGS, SESSION_SECRET, Stack
from tests.reliability.helpers import Conversation, new_cid, router, session
from tests.support.chat import JSON, post

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
