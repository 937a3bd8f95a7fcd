"""Every response, errors included, carries the X-Request-Id that P and D received and that
the turn's log line names: an operator can follow a failed request from the client to the
engines."""

from __future__ import annotations

import pytest

from harness.procs import log_file, wait_until
from tests.reliability.conftest import Stack
from tests.reliability.helpers import Conversation, faults, new_cid

pytestmark = pytest.mark.e2e


def engine_logs(main: Stack) -> str:
    """What the stack's engines logged (a simulator logs to `<name>-<port>.log`)."""
    folder = log_file("any").parent
    paths = [p for e in main.engines for p in folder.glob(f"*-{e.port}.log")]
    return "".join(p.read_text(errors="replace") for p in paths)


def test_a_502_carries_the_id_the_engines_got_and_the_turn_logged(main: Stack) -> None:
    for d in main.ds:
        faults(d, fail_next=1, status=500)  # each D fails once: "decode failed twice"
    reply = Conversation(main.url, main.ref, new_cid("rid")).turn(check=False)
    assert reply.status == 502, reply.body
    rid = reply.headers["x-request-id"]
    assert reply.json()["error"]["type"] == "upstream_error"
    wait_until(lambda: f"request_id={rid} " in main.log.read_text(errors="replace"), "no turn line")
    seen = engine_logs(main)
    # Both P legs (the turn was redone) and both D legs got the same id.
    assert seen.count(f"Received request {rid} on /v1/") == 4, seen[-2000:]


def test_an_engine_4xx_carries_the_turn_s_id(main: Stack) -> None:
    for p in main.ps:
        faults(p, fail_next=1, status=400)  # P's own 400 to the client's body: relayed
    reply = Conversation(main.url, main.ref, new_cid("rid")).turn(check=False)
    assert reply.status == 400, reply.body
    rid = reply.headers["x-request-id"]
    assert f"Received request {rid} on /v1/" in engine_logs(main)
    wait_until(lambda: f"request_id={rid} " in main.log.read_text(errors="replace"), "no turn line")
