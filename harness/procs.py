"""Real processes for tests: a private redis-server, simulators, logs, waiting for readiness
(harness/waiting.py says how long), on free ports (harness/ports.py says where)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from harness.ports import free_port as free_port  # where the tests have it from
from harness.waiting import Child, Deadline, StartupError

ROOT = Path(__file__).resolve().parents[1]
LOG_ROOT = Path(tempfile.gettempdir()) / "kvbaton-test-logs"
RUN_ENV = "KVBATON_TEST_RUN"  # the log folder's run id, set by tests/conftest.py


def wait_tcp(port: int, timeout: float = 15.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until something listens on 127.0.0.1:port; fail at once if proc exits (see
    waiting.Deadline for how long it waits)."""
    deadline = Deadline(timeout, proc)
    while True:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 0.2):
            return
        _check(deadline, f"nothing listens on 127.0.0.1:{port}", "")
        time.sleep(0.05)


def wait_http(url: str, timeout: float = 20.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Poll url until it answers 200; fail at once if proc exits (see waiting.Deadline for
    how long it waits). A failure shows proc's exit code and last log lines (spawn's log)."""
    deadline = Deadline(timeout, proc)
    last = ""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError) as exc:
            # An error status (a 503 while it starts) holds its socket: closed here, or the
            # garbage collector warns of it later, in whatever test runs then.
            if isinstance(exc, urllib.error.HTTPError):
                exc.close()
            last = str(exc)
        _check(deadline, f"{url} not ready", last)
        time.sleep(0.05)


def _check(deadline: Deadline, what: str, last: str) -> None:
    """Raise StartupError if the child exited, TimeoutError if the deadline passed."""
    seen = f" (last: {last})" if last else ""
    if deadline.exited() is not None:
        raise StartupError(deadline.report(f"{what}: its process exited{seen}"))
    if deadline.expired():
        raise TimeoutError(deadline.report(f"{what}{seen}"))


def wait_until(
    predicate: Callable[[], object],
    what: str,
    timeout: float = 30.0,
    seen: Callable[[], object] | None = None,
) -> float:
    """Poll until predicate holds, at most timeout seconds times timeout_scale(); returns the
    seconds it took. A failure says what `seen()` (else the predicate) gave last."""
    deadline = Deadline(timeout)
    while not (value := predicate()):
        if deadline.expired():
            last = seen() if seen is not None else value
            raise AssertionError(deadline.report(f"{what}: not in time; last seen: {last!r}"))
        time.sleep(0.05)
    return deadline.elapsed()


def stop(proc: subprocess.Popen[bytes], timeout: float = 5.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)


def log_file(name: str) -> Path:
    """Where spawn writes the output of the process started as `name`: a folder per test run
    (two sessions at once must not share a log) and in it one per pytest-xdist worker (nor
    two workers' stacks of one name)."""
    run = os.environ.get(RUN_ENV) or str(os.getpid())
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    return LOG_ROOT / f"run-{run}" / worker / f"{name}.log"


def prune_logs() -> None:
    """Remove the log folders of test runs whose process is gone (their pid in the name)."""
    for folder in LOG_ROOT.glob("run-*"):
        pid = folder.name.removeprefix("run-")
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # someone else's process
        return True
    return True


def logged(argv: Sequence[str], log_name: str, **kwargs: Any) -> Child:
    """Start argv (Popen's other arguments in kwargs), its stdout and stderr in
    log_file(log_name), truncated first."""
    path = log_file(log_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as log:  # the child keeps its own descriptor
        proc = Child(argv, stdout=log, stderr=subprocess.STDOUT, **kwargs)
    proc.log = path
    return proc


def spawn(args: Sequence[str], log_name: str) -> Child:
    """Start a Python module of this project (args after `python -m`), logging to a temp file
    (log_file(log_name), truncated first; `.log` of what it returns)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    return logged([sys.executable, "-m", *args], log_name, cwd=ROOT, env=env)


def _start_redis(port: int, directory: str) -> subprocess.Popen[bytes]:
    """redis-server on 127.0.0.1:port, no persistence, once it accepts connections; its
    output in log_file("redis-<port>")."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise RuntimeError("redis-server is not installed (make install installs it)")
    flags = ["--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no"]
    flags += ["--dir", directory, "--daemonize", "no", "--loglevel", "warning"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # the log file object is let go
        proc = logged([exe, *flags], f"redis-{port}")
    try:
        wait_tcp(port, proc=proc)
    except BaseException:
        stop(proc)
        raise
    return proc


@contextlib.contextmanager
def redis_server() -> Iterator[tuple[str, int, subprocess.Popen[bytes]]]:
    """A private redis-server on a free loopback port, no persistence; yields (url, port, proc)."""
    with tempfile.TemporaryDirectory() as tmp:
        for attempt in range(3):  # a port taken meanwhile: redis-server exits at once
            port = free_port()
            try:
                proc = _start_redis(port, tmp)
                break
            except StartupError:
                if attempt == 2:
                    raise
        try:
            yield f"redis://127.0.0.1:{port}/0", port, proc
        finally:
            stop(proc)


def restart_redis(port: int, directory: str | None = None) -> subprocess.Popen[bytes]:
    """Start a redis-server on a given port (after a test stopped the first one): fresh, or
    loading the `dump.rdb` in `directory` (a snapshot a test put back there)."""
    return _start_redis(port, directory or tempfile.gettempdir())


@dataclasses.dataclass(frozen=True)
class SimProc:
    """A running vllm_sim instance (see docs/simulator.md)."""

    url: str  # http://127.0.0.1:<port>
    port: int
    kv_port: int  # the KV side channel (remote_port in its kv_transfer_params)
    engine_id: str
    proc: subprocess.Popen[bytes]


def _flag(flags: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(flags):
        if a == flag and i + 1 < len(flags):
            return flags[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def _spawn_sim(role: str, flags: Sequence[str], name: str, engine_id: str) -> SimProc:
    port = int(_flag(flags, "--port") or 0) or free_port()
    kv_port = int(_flag(flags, "--kv-port") or 0) or free_port()
    while kv_port == port and not _flag(flags, "--kv-port"):  # free_port() may repeat itself
        kv_port = free_port()
    extra = [] if _flag(flags, "--port") else ["--port", str(port)]
    extra += [] if _flag(flags, "--kv-port") else ["--kv-port", str(kv_port)]
    extra += [] if _flag(flags, "--engine-id") else ["--engine-id", engine_id]
    with warnings.catch_warnings():
        # spawn() lets its log file object go once Popen has the descriptor; the child keeps
        # writing to it, so the parent's ResourceWarning is noise here.
        warnings.simplefilter("ignore", ResourceWarning)
        proc = spawn(["vllm_sim", "--role", role, *extra, *flags], f"{name}-{port}")
    url = f"http://127.0.0.1:{port}"
    return SimProc(url=url, port=port, kv_port=kv_port, engine_id=engine_id, proc=proc)


def _start_sim(
    role: str,
    flags: Sequence[str],
    name: str,
    started: SimProc | None,
    ready_timeout: float = 45.0,  # generous: several simulators may be starting at once
) -> SimProc:
    """Wait for a spawned simulator (or spawn one); retry a start that lost a port race."""
    engine_id = _flag(flags, "--engine-id") or f"{role}-{uuid.uuid4()}"
    ours = not (_flag(flags, "--port") or _flag(flags, "--kv-port"))
    attempts = 3 if ours else 1
    for attempt in range(attempts):
        sp = started or _spawn_sim(role, flags, name, engine_id)
        started = None
        try:
            wait_http(sp.url + "/health", timeout=ready_timeout, proc=sp.proc)
            return sp
        except RuntimeError:  # exited before ready (e.g. a port taken meanwhile)
            stop(sp.proc)
            if attempt + 1 == attempts:
                raise
        except BaseException:
            stop(sp.proc)
            raise
    raise AssertionError("unreachable")


@contextlib.contextmanager
def sim(role: str, *args: str, name: str = "sim", ready_timeout: float = 45.0) -> Iterator[SimProc]:
    """Start `python -m vllm_sim --role ROLE` on free ports (extra flags in args); stop it after.

    `--engine-id`, `--port` and `--kv-port` may be given in args; otherwise they are chosen
    here (engine id `<role>-<uuid4>`), and a start that loses a port race is retried.
    """
    proc = _start_sim(role, list(args), name, None, ready_timeout)
    try:
        yield proc
    finally:
        stop(proc.proc)


@contextlib.contextmanager
def sims(
    *specs: Sequence[str], name: str = "sim", ready_timeout: float = 45.0
) -> Iterator[list[SimProc]]:
    """Several simulators started in parallel; each spec is (role, *flags). Same rules as sim()."""
    started: list[SimProc] = []
    ready: list[SimProc] = []
    try:
        for i, (role, *flags) in enumerate(specs):
            engine_id = _flag(flags, "--engine-id") or f"{role}-{uuid.uuid4()}"
            started.append(_spawn_sim(role, flags, f"{name}{i}", engine_id))
        for i, ((role, *flags), sp) in enumerate(zip(specs, started, strict=True)):
            ready.append(_start_sim(role, flags, f"{name}{i}", sp, ready_timeout))
        yield ready
    finally:
        for sp in (*started, *ready):
            if sp.proc.poll() is None:
                sp.proc.terminate()
        for sp in (*started, *ready):
            stop(sp.proc)


def output_until(proc: subprocess.Popen[str], prefix: str) -> str:
    """The child's text output up to and including its first line starting with `prefix`;
    the test fails, with everything it printed, if the child ends before that line."""
    assert proc.stdout is not None
    seen: list[str] = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(prefix):
            return "".join(seen)
    raise AssertionError(f"the process ended before {prefix!r}:\n" + "".join(seen))
