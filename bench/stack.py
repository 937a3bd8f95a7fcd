"""Processes for the benchmark: simulators, redis-server, routers and the load generator.

Everything binds 127.0.0.1 on free ports (harness/stack.py) and is stopped by the
ExitStack that started it, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import select
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from harness.chat import post
from harness.metrics import samples
from harness.procs import ROOT, log_file, stop
from harness.router import RouterProc, http_process, router
from harness.stack import Stack
from harness.stack import start_stack as support_stack
from harness.waiting import cpu_seconds

Tick = Callable[[str], None]  # a part's progress: the label of the step that starts
R = TypeVar("R")


# Seconds a process may take to answer /health: on a loaded 2-core machine (other test
# suites running) Python start-up alone can take many seconds.
READY_TIMEOUT = 90.0


@contextlib.contextmanager
def passthrough(
    p_url: str, d_url: str, name: str, redis_url: str | None = None
) -> Iterator[RouterProc]:
    """bench/passthrough.py (the stack's floor for a turn) on a free port; with `redis_url`,
    the work floor (its claim and commit in that Redis, P's /tokenize on later turns)."""
    work = ["uvloop", redis_url] if redis_url else []
    argv = lambda port: ["bench.passthrough", str(port), p_url, d_url, *work]  # noqa: E731
    with http_process(argv, name, ready_timeout=READY_TIMEOUT) as app:
        yield app


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds of pid and its children, e.g. `kvbaton serve --workers N`'s workers (0.0
    once it is gone)."""
    return cpu_seconds(pid) or 0.0


def pin(pid: int, cpus: set[int] | None) -> bool:
    """taskset for a running process: every thread of pid onto cpus (None: all CPUs)."""
    target = cpus if cpus is not None else set(range(os.cpu_count() or 1))
    ok = True
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), target)
        except OSError:
            ok = False
    return ok


BY_SOURCE = re.compile(r'vllm:prompt_tokens_by_source_total\{.*source="([^"]+)"')


def prompt_tokens(st: Stack) -> dict[str, dict[str, float]]:
    """vllm:prompt_tokens_by_source_total per source, summed over P and over D (an engine that
    was killed left out)."""
    out: dict[str, dict[str, float]] = {"P": {}, "D": {}}
    for role, sims in (("P", st.ps), ("D", st.ds)):
        for sim in sims:
            if sim.proc.poll() is not None:
                continue
            for key, value in samples(sim.url).items():
                if match := BY_SOURCE.match(key):
                    out[role][match[1]] = out[role].get(match[1], 0.0) + value
    return out


def reset_caches(st: Stack) -> None:
    """Every engine's prefix cache emptied: the arms of a comparison do the same work."""
    for s in st.engines:
        reply = post(s.url + "/reset_prefix_cache", {}, timeout=10.0)
        if reply.status != 200:
            raise RuntimeError(f"{s.url}/reset_prefix_cache answered {reply.status}")


def timed(
    st: Stack, lg: LoadGen, spec: dict[str, Any], pid: int, timeout: float | None = None
) -> tuple[dict[str, Any], float]:
    """Run a job on emptied prefix caches; also the CPU seconds process `pid` and its children
    used."""
    reset_caches(st)
    cpu0 = tree_cpu_seconds(pid)
    r = lg.run(spec, timeout=timeout or spec.get("deadline_s", 120.0) + 60.0)
    return r, tree_cpu_seconds(pid) - cpu0


def alternate(
    arms: Sequence[str], rounds: int, tick: Tick, label: str, one: Callable[[str, int], R]
) -> dict[str, list[R]]:
    """`one(arm, round)` of every arm, round by round, the arms' order reversed every other
    round so that a change in the machine's load hits every arm; each arm's in round order."""
    out: dict[str, list[R]] = {arm: [] for arm in arms}
    for rnd in range(rounds):
        for arm in arms if rnd % 2 == 0 else arms[::-1]:
            tick(f"{label}, round {rnd + 1}, {arm}")
            out[arm].append(one(arm, rnd))
    return out


def round_turns(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The turns of an arm's load-generator results (one per round), each with its round."""
    return [dict(t, round=rnd) for rnd, r in enumerate(results) for t in r["turns"]]


# P and D simulators (one per flags list), a private redis-server, and routers (harness/
# stack.py), with the benchmark's longer start-up wait.
start_stack = functools.partial(
    support_stack, sim_timeout=READY_TIMEOUT, router_timeout=READY_TIMEOUT
)


@contextlib.contextmanager
def another_router(st: Stack, *args: str, name: str) -> Iterator[RouterProc]:
    """One more `kvbaton serve` for the stack's engines, on its Redis (a replica, or one that
    replaces a router that died), with the benchmark's start-up wait; stopped after."""
    ps, ds = [p.url for p in st.ps], [d.url for d in st.ds]
    with router(ps, ds, *args, redis_url=st.redis_url, name=name, ready_timeout=READY_TIMEOUT) as r:
        yield r


class LoadGen:
    """The load generator process (bench/loadgen.py): one job at a time, bounded."""

    def __init__(self) -> None:
        log = log_file("bench-loadgen")
        log.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.loadgen"],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
        )

    def run(self, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one job and wait at most timeout seconds for its result."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps(spec) + "\n").encode())
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.close()
            raise TimeoutError(f"load generator gave no result within {timeout:.0f}s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"load generator exited ({self.proc.poll()})")
        result: dict[str, Any] = json.loads(line)
        if "fatal" in result:
            raise RuntimeError(f"load generator failed: {result['fatal']}")
        return result

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        stop(self.proc)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()

    def __enter__(self) -> LoadGen:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
