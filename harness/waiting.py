"""Waiting for test processes on a machine that may be busy: deadlines that scale with its
load (or with KVBATON_TEST_TIMEOUT_SCALE), a start-up that goes on waiting while the child is
alive and working, and failures that say which it was: the child's exit code, the CPU it got,
the machine's load and the last lines of the child's log.

A hang still fails: a child that does nothing fails at its scaled deadline, one that works
without ever becoming ready at PROGRESS_CAP times it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from pathlib import Path

SCALE_ENV = "KVBATON_TEST_TIMEOUT_SCALE"
MAX_LOAD_SCALE = 4.0  # the most the load alone stretches a deadline
PROGRESS_CAP = 3.0  # a child still working may take this many times its scaled deadline
STALL = 5.0  # ... if its CPU time or its log grew within this many seconds
TAIL_LINES = 40


def cpus() -> int:
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def load() -> float:
    """The 1-minute load average (0 where the platform has none)."""
    with contextlib.suppress(AttributeError, OSError):
        return os.getloadavg()[0]
    return 0.0


def timeout_scale() -> float:
    """How many times longer than on an idle machine a test waits: KVBATON_TEST_TIMEOUT_SCALE
    when set, else the load average per CPU, between 1 and MAX_LOAD_SCALE."""
    given = os.environ.get(SCALE_ENV, "").strip()
    if given:
        try:
            value = float(given)
        except ValueError:
            raise ValueError(f"{SCALE_ENV}={given!r} is not a number") from None
        if value <= 0:
            raise ValueError(f"{SCALE_ENV}={given!r} must be above 0")
        return value
    return min(MAX_LOAD_SCALE, max(1.0, load() / cpus()))


def scaled(seconds: float) -> float:
    """seconds times timeout_scale(): a timeout of a wait not made here (a subprocess's)."""
    return seconds * timeout_scale()


def machine() -> str:
    """The machine's state, for a failure message."""
    return f"load average {load():.1f} on {cpus()} CPUs"


class Child(subprocess.Popen[bytes]):
    """A process whose output goes to a log file (`log`), for the waits to show."""

    log: Path | None = None


def log_of(proc: subprocess.Popen[bytes] | None) -> Path | None:
    return proc.log if isinstance(proc, Child) else None


def log_tail(path: Path | None, lines: int = TAIL_LINES) -> str:
    """The last lines of a log file, each cut to 300 characters, under a header naming it."""
    if path is None:
        return ""
    try:
        text = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError as exc:
        return f"\n(its log {path} cannot be read: {exc})"
    if not text:
        return f"\n(its log {path} is empty)"
    body = "\n".join("    " + line[:300] for line in text)
    return f"\nlast {len(text)} lines of {path}:\n{body}"


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds used by a process and its children, reaped or not (Linux /proc; None
    elsewhere or once it is gone)."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        # utime, stime, cutime, cstime: fields 14-17 of proc(5), 12-15 after "pid (comm) state"
        total = sum(int(f) for f in fields[11:15]) / tick
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except (OSError, IndexError, ValueError):
        return None
    return total + sum(cpu_seconds(int(k)) or 0.0 for k in kids)


def _size(path: Path | None) -> int:
    with contextlib.suppress(OSError):
        return path.stat().st_size if path is not None else 0
    return 0


class Deadline:
    """A wait's deadline: `timeout` seconds times timeout_scale(); for a start-up (`proc`),
    extended while the child works (its CPU time or its log grows), up to PROGRESS_CAP."""

    def __init__(self, timeout: float, proc: subprocess.Popen[bytes] | None = None) -> None:
        self.timeout = timeout
        self.scale = timeout_scale()
        self.limit = timeout * self.scale
        self.proc = proc
        self.log = log_of(proc)
        self.start = time.monotonic()
        self._cpu = self._cpu_now()
        self._size = _size(self.log)
        self._worked = self._sampled = self.start

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def _cpu_now(self) -> float | None:
        return cpu_seconds(self.proc.pid) if self.proc is not None else None

    def _working(self, now: float) -> bool:
        """Whether the child's CPU time or log grew within STALL seconds (sampled twice a
        second)."""
        if now - self._sampled >= 0.5:
            self._sampled = now
            cpu, size = self._cpu_now(), _size(self.log)
            if size != self._size or (
                cpu is not None and self._cpu is not None and cpu > self._cpu + 0.01
            ):
                self._worked = now
            self._cpu, self._size = cpu if cpu is not None else self._cpu, size
        return now - self._worked < STALL

    def expired(self) -> bool:
        """Past the scaled timeout, unless the child is alive and working (then past
        PROGRESS_CAP times it)."""
        now = time.monotonic()
        elapsed = now - self.start
        working = self.proc is not None and self._working(now)
        if elapsed <= self.limit:
            return False
        if elapsed > self.limit * PROGRESS_CAP:
            return True
        return not (working and self.exited() is None)

    def exited(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def report(self, what: str) -> str:
        """`what` (e.g. "... not ready") with the numbers that tell overload from a bug."""
        head = (
            f"{what} [waited {self.elapsed():.1f}s: timeout {self.timeout:g}s x scale "
            f"{self.scale:.2f}; {machine()}]"
        )
        if self.proc is None:
            return head
        code = self.proc.poll()
        cpu = cpu_seconds(self.proc.pid)
        state = (
            f"exited with {code}"
            if code is not None
            else "still running" + (f", {cpu:.1f}s of CPU so far" if cpu is not None else "")
        )
        return f"{head}; process {self.proc.pid} {state}{log_tail(self.log)}"


class StartupError(RuntimeError):
    """A child exited before it was ready."""
