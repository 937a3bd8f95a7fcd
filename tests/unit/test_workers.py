"""The supervisor's policy for workers that exit: a first worker that fails at start stops the
server, a worker that dies later is replaced, a replacement that fails is retried with a
growing pause, and nothing is replaced once stopping. (The processes themselves are in
tests/e2e/test_workers.py; here their exits are made up.)"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from router.config import Settings
from router.http.workers import CRASH_WINDOW, Supervisor, Worker


class Exited:
    """A stand-in for the Popen of a worker that has exited (or is still running: None)."""

    def __init__(self, status: int | None, pid: int = 999999) -> None:
        self.status = status
        self.pid = pid

    def poll(self) -> int | None:
        return self.status

    def send_signal(self, sig: int) -> None:
        pass


@dataclass
class Recording(Supervisor):
    """A supervisor that records the workers it would start."""

    spawned: list[tuple[int, float, bool]] = field(default_factory=list)

    def spawn(self, index: int, backoff: float = 0.0, replacement: bool = False) -> Any:
        self.spawned.append((index, backoff, replacement))


@pytest.fixture
def sup(tmp_path: Path) -> Iterator[Recording]:
    settings = Settings(prefill=("http://p",), decode=("http://d",), workers=2)
    with socket.socket() as sock:
        yield Recording(settings, [], sock, str(tmp_path))


def add(sup: Recording, index: int, status: int | None, lived: float = 1.0, **kw: Any) -> None:
    started = time.monotonic() - lived
    sup.workers[index] = Worker(index, Exited(status), -1, started, **kw)  # type: ignore[arg-type]


def test_a_first_worker_failing_at_start_stops_everything(sup: Recording) -> None:
    add(sup, 0, 1)
    add(sup, 1, None, ready=True)
    sup.reap()
    assert sup.exit_status == 1 and sup.signals == 1
    assert set(sup.workers) == {1} and not sup.due
    sup.replace()
    assert sup.spawned == []


def test_a_dead_worker_is_replaced_and_a_failing_replacement_retried(sup: Recording) -> None:
    add(sup, 0, -9, ready=True)
    sup.reap()
    assert sup.exit_status == 0 and sup.signals == 0
    when, backoff = sup.due[0]
    assert backoff == 1.0  # it died within CRASH_WINDOW of its start: a pause first
    sup.replace()
    assert sup.spawned == []
    sup.due[0] = (when - 1.0, backoff)  # the pause is over
    sup.replace()
    assert sup.spawned == [(0, 1.0, True)]
    add(sup, 0, 1, replacement=True, backoff=1.0)  # the replacement fails at start
    sup.reap()
    assert sup.exit_status == 0 and sup.due[0][1] == 2.0


def test_a_worker_that_ran_long_is_replaced_at_once(sup: Recording) -> None:
    add(sup, 1, 3, lived=CRASH_WINDOW + 1, ready=True, backoff=8.0)
    sup.reap()
    sup.replace()
    assert sup.spawned == [(1, 0.0, True)]


def test_nothing_is_replaced_while_stopping(sup: Recording) -> None:
    add(sup, 0, 0, ready=True)
    sup.signals = 1
    sup.reap()
    sup.replace()
    assert not sup.workers and not sup.due
    assert sup.spawned == []


def test_a_signal_during_the_start_spawns_no_more_workers(sup: Recording) -> None:
    sup.signals = 1  # Ctrl-C arrived while the first workers were being started
    assert sup.run() == 0
    assert sup.spawned == []
