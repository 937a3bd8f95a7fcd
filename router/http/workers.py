"""`kvbaton serve --workers N`: N router processes serving one listening socket.

The supervisor opens the socket, starts each worker as `python -m router serve` with the
same arguments (the socket and a readiness pipe inherited, WORKER_ENV saying which), forwards
SIGTERM/SIGINT to them and exits when they have. A worker that dies after it was ready is
started again (so is a replacement that fails at start, with a growing pause); one of the
first workers that fails before it was ready (the start-up check of the engines) stops the
whole server with its exit status, as a single process would.

Each worker has its own event loop, engine connections, health checks and store breaker;
sessions and the instance registry live in Redis, so any worker serves any turn.
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from types import FrameType

from prometheus_client.multiprocess import mark_process_dead

from router.config import WORKER_ENV, Settings, WorkerSlot

log = logging.getLogger("kvbaton.workers")

BACKLOG = 1024
POLL_INTERVAL = 0.1
# A worker that dies again within this many seconds of its start waits before the next one.
CRASH_WINDOW = 10.0
MAX_BACKOFF = 30.0


def listen(host: str, port: int) -> socket.socket:
    """The shared listening socket (TCP_NODELAY, inherited by the accepted connections)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host.strip("[]"), port), family=family, backlog=BACKLOG)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.set_inheritable(True)
    return sock


def describe(status: int) -> str:
    """A Popen return code in words."""
    if status < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-status).name}"
        return f"was killed by signal {-status}"
    return f"exited with status {status}"


@dataclass
class Worker:
    index: int
    proc: subprocess.Popen[bytes]
    ready_fd: int  # the read end of its readiness pipe; -1 once it reported or died
    started: float
    ready: bool = False
    backoff: float = 0.0
    replacement: bool = False  # started after another worker in its slot died


@dataclass
class Supervisor:
    settings: Settings
    argv: Sequence[str]
    sock: socket.socket
    metrics_dir: str
    workers: dict[int, Worker] = field(default_factory=dict)
    due: dict[int, tuple[float, float]] = field(default_factory=dict)  # index: (when, backoff)
    signals: int = 0
    exit_status: int = 0

    def spawn(self, index: int, backoff: float = 0.0, replacement: bool = False) -> Worker:
        read_fd, write_fd = os.pipe()
        slot = WorkerSlot(index, self.sock.fileno(), write_fd)
        env = dict(os.environ, PROMETHEUS_MULTIPROC_DIR=self.metrics_dir)
        env[WORKER_ENV] = slot.encode()
        proc = subprocess.Popen(
            [sys.executable, "-m", "router", "serve", *self.argv],
            env=env,
            pass_fds=(self.sock.fileno(), write_fd),
            start_new_session=True,  # Ctrl-C reaches the supervisor only; it forwards SIGTERM
        )
        os.close(write_fd)
        worker = Worker(
            index, proc, read_fd, time.monotonic(), backoff=backoff, replacement=replacement
        )
        self.workers[index] = worker
        return worker

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signals += 1
        for worker in self.workers.values():
            with contextlib.suppress(ProcessLookupError):
                worker.proc.send_signal(signal.SIGTERM)

    def check_ready(self) -> None:
        waiting = {w.ready_fd: w for w in self.workers.values() if w.ready_fd >= 0}
        if not waiting:
            return
        readable, _, _ = select.select(list(waiting), [], [], 0)
        for fd in readable:
            worker = waiting[fd]
            worker.ready = os.read(fd, 1) == b"1"
            os.close(fd)
            worker.ready_fd = -1
            if worker.ready:
                log.info("worker %d ready (pid %d)", worker.index, worker.proc.pid)

    def reap(self) -> None:
        for index, worker in list(self.workers.items()):
            status = worker.proc.poll()
            if status is None:
                continue
            del self.workers[index]
            if worker.ready_fd >= 0:
                os.close(worker.ready_fd)
            mark_process_dead(worker.proc.pid, self.metrics_dir)  # type: ignore[no-untyped-call]
            if self.signals:
                continue
            if not worker.ready and not worker.replacement:
                log.error("worker %d failed at start (%s): stopping", index, describe(status))
                self.exit_status = status if status > 0 else 1
                self.on_signal(signal.SIGTERM, None)
                continue
            lived = time.monotonic() - worker.started
            short = lived < CRASH_WINDOW or not worker.ready
            backoff = min(max(worker.backoff * 2, 1.0), MAX_BACKOFF) if short else 0.0
            log.error(
                "worker %d (pid %d) %s; starting another in %.0f s",
                index,
                worker.proc.pid,
                describe(status),
                backoff,
            )
            self.due[index] = (time.monotonic() + backoff, backoff)

    def replace(self) -> None:
        """Start the replacements whose pause is over (none once stopping)."""
        for index, (when, backoff) in list(self.due.items()):
            if self.signals:
                self.due.clear()
            elif time.monotonic() >= when:
                del self.due[index]
                self.spawn(index, backoff, replacement=True)

    def run(self) -> int:
        for index in range(self.settings.workers):
            if not self.signals:  # a signal during the start: the rest would never get one
                self.spawn(index)
        log.info(
            "kvbaton serve: %d workers on %s:%d (pids %s)",
            self.settings.workers,
            self.settings.host,
            self.sock.getsockname()[1],
            " ".join(str(w.proc.pid) for w in self.workers.values()),
        )
        while self.workers or self.due:
            self.check_ready()
            self.reap()
            self.replace()
            time.sleep(POLL_INTERVAL)
        return self.exit_status


def supervise(settings: Settings, argv: Sequence[str]) -> int:
    """Run `settings.workers` workers until a signal (or a start-up failure) stops them."""
    try:
        sock = listen(settings.host, settings.port)
    except OSError as exc:
        print(
            f"kvbaton serve: cannot listen on {settings.host}:{settings.port}: {exc}",
            file=sys.stderr,
        )
        return 1
    metrics_dir = tempfile.mkdtemp(prefix="kvbaton-metrics-")
    sup = Supervisor(settings, argv, sock, metrics_dir)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, sup.on_signal)
    try:
        return sup.run()
    finally:
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
