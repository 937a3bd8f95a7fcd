"""The tests' own waits (harness/waiting.py): a start-up that fails says whether the
child died, hung or is still working on a busy machine, with its last log lines; a child that
works goes on being waited for, one that hangs does not; deadlines scale."""

from __future__ import annotations

import os
import socket
import sys
import time
import urllib.request
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import waiting
from harness.procs import (
    RUN_ENV,
    Child,
    _start_redis,
    free_port,
    log_file,
    logged,
    stop,
    wait_http,
    wait_tcp,
    wait_until,
)
from harness.router import PORT_RACES, http_process, serve_argv
from harness.waiting import SCALE_ENV, StartupError, timeout_scale
from router.config import load_settings

pytestmark = pytest.mark.timeout(60)

# A child that says what it does, works (spins) for WORK seconds, then serves /health.
SERVE_LATE = """
import http.server, sys, time
port, work = int(sys.argv[1]), float(sys.argv[2])
print("warming up", flush=True)
end = time.monotonic() + work
while time.monotonic() < end:
    pass
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


@pytest.fixture(autouse=True)
def unscaled(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deadlines as written, whatever the machine's load (the tests time them)."""
    monkeypatch.setenv(SCALE_ENV, "1")


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for proc in started:
        stop(proc)


def child(children: list[Child], name: str, code: str, *args: str) -> Child:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # logged() lets its file object go
        proc = logged([sys.executable, "-c", code, *args], name)
    children.append(proc)
    return proc


def test_a_child_that_exits_fails_at_once_with_its_code_and_log(children: list[Child]) -> None:
    code = "import sys\nfor i in range(60): print(f'line {i}')\nsys.exit(3)"
    proc = child(children, "waiting-exits", code)
    t0 = time.monotonic()
    with pytest.raises(StartupError) as failed:
        wait_http(f"http://127.0.0.1:{free_port()}/health", timeout=30, proc=proc)
    assert time.monotonic() - t0 < 10
    message = str(failed.value)
    assert "exited with 3" in message, message
    assert "line 59" in message and "line 20" in message, message  # the last 40 lines
    assert "line 19\n" not in message, message
    assert str(log_file("waiting-exits")) in message


def test_a_child_that_hangs_fails_at_its_deadline(
    children: list[Child], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(waiting, "STALL", 1.0)  # its start-up (CPU time) is not progress then
    code = "import time\nprint('stuck', flush=True)\ntime.sleep(60)"
    proc = child(children, "waiting-hangs", code)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as failed:
        wait_http(f"http://127.0.0.1:{free_port()}/health", timeout=2, proc=proc)
    took = time.monotonic() - t0
    assert 2 <= took < 2 * waiting.PROGRESS_CAP, took  # not extended: it does nothing
    message = str(failed.value)
    assert f"process {proc.pid} still running" in message, message
    assert "stuck" in message and "load average" in message, message
    assert "timeout 2s x scale 1.00" in message, message


def test_a_child_still_working_is_waited_for(
    children: list[Child], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A start-up that takes longer than its timeout because the child needs more CPU time
    (as on a loaded machine) still succeeds, within PROGRESS_CAP times the timeout."""
    monkeypatch.setattr(waiting, "PROGRESS_CAP", 20.0)
    port = free_port()
    proc = child(children, "waiting-works", SERVE_LATE, str(port), "3")
    t0 = time.monotonic()
    wait_http(f"http://127.0.0.1:{port}/health", timeout=1, proc=proc)
    assert time.monotonic() - t0 >= 2.5


def test_a_child_that_works_forever_fails_at_the_cap(
    children: list[Child], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(waiting, "PROGRESS_CAP", 3.0)
    proc = child(children, "waiting-spins", SERVE_LATE, str(free_port()), "600")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as failed:
        wait_http(f"http://127.0.0.1:{free_port()}/health", timeout=1, proc=proc)
    assert 3 <= time.monotonic() - t0 < 10
    message = str(failed.value)
    assert "s of CPU so far" in message and "warming up" in message, message


def test_redis_that_cannot_start_shows_its_log(tmp_path: object) -> None:
    with pytest.raises(StartupError) as failed:
        _start_redis(free_port(), "/nonexistent/kvbaton-test-dir")
    message = str(failed.value)
    assert "exited with" in message and "nonexistent" in message, message


def test_wait_tcp_without_a_process_fails_at_its_deadline() -> None:
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="nothing listens"):
        wait_tcp(free_port(), timeout=0.5)
    assert time.monotonic() - t0 < 5


def test_wait_until_says_what_it_saw_last() -> None:
    counter = iter(range(1000))
    with pytest.raises(AssertionError) as failed:
        wait_until(lambda: False, "counted", 0.3, seen=lambda: {"releases": next(counter)})
    message = str(failed.value)
    assert message.startswith("counted: not in time; last seen: {'releases': "), message
    assert "timeout 0.3s x scale 1.00" in message
    assert wait_until(lambda: True, "at once", 0.3) < 0.3


def test_the_scale_follows_the_variable_else_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SCALE_ENV, "2.5")
    assert timeout_scale() == 2.5
    monkeypatch.setenv(SCALE_ENV, "0")
    with pytest.raises(ValueError, match=SCALE_ENV):
        timeout_scale()
    monkeypatch.delenv(SCALE_ENV)
    monkeypatch.setattr(waiting, "load", lambda: 100.0)
    assert timeout_scale() == waiting.MAX_LOAD_SCALE
    monkeypatch.setattr(waiting, "load", lambda: 0.1)
    assert timeout_scale() == 1.0


def test_routers_get_a_store_timeout_stretched_only_on_a_loaded_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def argv(scale: str, *args: str) -> list[str]:
        monkeypatch.setenv(SCALE_ENV, scale)
        return serve_argv(["http://p"], ["http://d"], *args, port=1, redis_url="redis://r")

    assert "--store-timeout" not in argv("1")  # the router's own default
    loaded = argv("4")
    assert loaded[loaded.index("--store-timeout") + 1] == "1"  # 0.25 s x 4
    mine = argv("4", "--store-timeout", "0.1")
    assert mine[-2:] == ["--store-timeout", "0.1"]  # the test's own flag comes last: it wins
    assert load_settings(mine[2:], env={}).store_timeout == 0.1


def test_each_run_logs_in_a_folder_of_its_own() -> None:
    path = log_file("x")
    assert f"run-{os.environ[RUN_ENV]}" in path.parts
    assert path.parent.name == os.environ.get("PYTEST_XDIST_WORKER", f"run-{os.environ[RUN_ENV]}")


def test_a_start_that_lost_its_port_is_tried_on_another(tmp_path: Path) -> None:
    """A second test run beside this one took the port between free_port() and the child's
    bind: the child exits with "Address already in use" and the start goes on, on a fresh
    port, whatever `attempts` says (here 1)."""
    (tmp_path / "health").write_text("ok")
    ports: list[int] = []
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = taken.getsockname()[1]

        def argv(port: int) -> list[str]:
            ports.append(port)
            bind = held if len(ports) == 1 else port  # the first start finds its port taken
            return ["http.server", "--bind", "127.0.0.1", "-d", str(tmp_path), str(bind)]

        with http_process(argv, "port-race", attempts=1) as served:
            assert len(ports) == 2 and served.port == ports[1] != held
            with urllib.request.urlopen(served.url + "/health", timeout=10) as resp:
                assert resp.read() == b"ok"


def test_a_port_taken_every_time_fails_after_the_retries(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        held = taken.getsockname()[1]
        starts: list[int] = []

        def argv(port: int) -> list[str]:
            starts.append(port)
            return ["http.server", "--bind", "127.0.0.1", str(held)]

        refused = pytest.raises(StartupError, match="Address already in use")
        with refused, http_process(argv, "port-taken"):
            pass
    assert len(starts) == PORT_RACES
