"""Signed by default (issue 32, item 1): a router on a shared store (Redis) does not start
without a session secret, and says how to make one; `--unsigned-sessions` runs unsigned on
purpose, with one WARNING and `"signed": false` in /status; the memory store signs with a
secret of its own."""

from __future__ import annotations

import os
import subprocess
import sys

from harness.chat import get_json
from harness.procs import ROOT, free_port
from harness.router import router as plain_router
from tests.reliability.conftest import ROUTER_FLAGS, SESSION_SECRET, Stack
from tests.reliability.helpers import Conversation, new_cid, router

UNSIGNED_FLAGS = [f for f in ROUTER_FLAGS if f not in ("--session-secret", SESSION_SECRET)]


def serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`kvbaton serve` on Redis without a secret (no engine needed: it stops before them)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("KVBATON_")}
    argv = ["serve", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:1"]
    argv += ["--redis-url", "redis://127.0.0.1:1/0", "--port", str(free_port()), *args]
    return subprocess.run(
        [sys.executable, "-m", "router", *argv],
        cwd=ROOT,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )


def test_a_router_on_redis_without_a_secret_does_not_start_and_says_how_to_make_one() -> None:
    done = serve()
    assert done.returncode == 2, done.stderr
    assert "KVBATON_SESSION_SECRET" in done.stderr
    assert "secrets.token_urlsafe(32)" in done.stderr  # how to make one
    assert "--unsigned-sessions" in done.stderr
    assert "Traceback" not in done.stderr
    # A secret too short, or both a secret and --unsigned-sessions: refused too.
    assert serve(env={"KVBATON_SESSION_SECRET": "short"}).returncode == 2
    both = serve("--unsigned-sessions", env={"KVBATON_SESSION_SECRET": SESSION_SECRET})
    assert both.returncode == 2 and "choose one" in both.stderr


def test_unsigned_on_purpose_warns_once_and_says_so_in_status(main: Stack) -> None:
    ps, ds = [p.url for p in main.ps], [d.url for d in main.ds]
    flags = [*UNSIGNED_FLAGS, "--unsigned-sessions"]
    with router(ps, ds, *flags, redis_url=main.redis_url, name="rel-unsigned-warn") as r:
        assert get_json(r.url + "/status")["signed"] is False
        conv = Conversation(r.url, main.ref, new_cid("unsigned-warn"))
        conv.turn()
        assert conv.turn().reuse == "hit"  # unsigned still reuses
        log = r.log.read_text()
    warnings = [line for line in log.splitlines() if "WARNING" in line and "unsigned" in line]
    assert len(warnings) == 1, warnings
    assert "KVBATON_SESSION_SECRET" in warnings[0]


def test_signed_routers_say_so(main: Stack) -> None:
    assert get_json(main.url + "/status")["signed"] is True
    ps, ds = [p.url for p in main.ps], [d.url for d in main.ds]
    # The memory store signs with a secret of its own: no flag, no warning.
    memory = [*UNSIGNED_FLAGS, "--session-store", "memory"]
    with plain_router(ps, ds, *memory, name="rel-memory-signed", ready_timeout=60) as r:
        assert get_json(r.url + "/status")["signed"] is True
        conv = Conversation(r.url, main.ref, new_cid("memory-signed"))
        conv.turn()
        assert conv.turn().reuse == "hit"
        assert "unsigned" not in r.log.read_text()
