"""Processes for the benchmark: simulators, redis-server, routers and the load generator.

Everything binds 127.0.0.1 on free ports (tests/procs.py) and is stopped by the ExitStack
that started it, also on Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import select
import subprocess
import sys
import urllib.request
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import redis

from tests import procs
from tests.e2e.harness import RouterProc
from tests.procs import ROOT, SimProc, free_port, log_file, redis_server, spawn, stop, wait_http

CLK_TCK = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")


# Seconds a process may take to answer /health: on a loaded 2-core machine (other test
# suites running) Python start-up alone can take many seconds.
READY_TIMEOUT = 90.0


@contextlib.contextmanager
def sim(role: str, *args: str, name: str) -> Iterator[SimProc]:
    """tests/procs.py's simulator (new ports for a start that lost a port race), with the
    benchmark's longer wait."""
    with procs.sim(role, *args, name=name, ready_timeout=READY_TIMEOUT) as sp:
        yield sp


@contextlib.contextmanager
def router(
    prefill: Sequence[str], decode: Sequence[str], *args: str, redis_url: str | None, name: str
) -> Iterator[RouterProc]:
    """`python -m router serve` on a free port (as tests/e2e/harness.py, a longer wait)."""
    port = free_port()
    argv = ["router", "serve", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prefill", *prefill, "--decode", *decode]
    argv += ["--session-store", "memory"] if redis_url is None else ["--redis-url", redis_url]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        proc = spawn([*argv, *args], name)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=READY_TIMEOUT, proc=proc)
        yield RouterProc(f"http://127.0.0.1:{port}", port, proc, log_file(name))
    finally:
        stop(proc)


@contextlib.contextmanager
def passthrough(p_url: str, d_url: str, name: str) -> Iterator[RouterProc]:
    """tests/bench/passthrough.py (the stack's floor for a turn) on a free port."""
    port = free_port()
    proc = spawn(["tests.bench.passthrough", str(port), p_url, d_url], name)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=READY_TIMEOUT, proc=proc)
        yield RouterProc(f"http://127.0.0.1:{port}", port, proc, log_file(name))
    finally:
        stop(proc)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def machine_cpu() -> tuple[float, float]:
    """All CPUs' (busy, total) seconds since boot, from /proc/stat (idle and iowait not busy)."""
    with open("/proc/stat") as fh:
        ticks = [int(x) for x in fh.readline().split()[1:]]
    total = sum(ticks[:8])  # user nice system idle iowait irq softirq steal
    return (total - ticks[3] - ticks[4]) / CLK_TCK, total / CLK_TCK


def descendants(pid: int) -> list[int]:
    """The processes pid started, and theirs (e.g. `kvbaton serve --workers N`'s workers)."""
    found: list[int] = []
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as fh:
                for child in fh.read().split():
                    found += [int(child), *descendants(int(child))]
    return found


def tree_cpu_seconds(pid: int) -> float:
    """cpu_seconds of pid and its live descendants (a worker that exited is not counted)."""
    total = cpu_seconds(pid)
    for child in descendants(pid):
        with contextlib.suppress(OSError):
            total += cpu_seconds(child)
    return total


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


def metrics(url: str) -> dict[str, float]:
    """An instance's Prometheus text as {'name{labels}': value} (label order as sent)."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def by_source(url: str) -> dict[str, float]:
    """vllm:prompt_tokens_by_source_total per source on one instance."""
    found: dict[str, float] = {}
    for key, value in metrics(url).items():
        if key.startswith("vllm:prompt_tokens_by_source_total{"):
            match = re.search(r'source="([^"]+)"', key)
            if match:
                found[match.group(1)] = found.get(match.group(1), 0.0) + value
    return found


def post(url: str, body: dict[str, Any], timeout: float = 10.0) -> Any:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}, method="POST"
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


class RedisStats:
    """INFO commandstats deltas of one redis-server."""

    def __init__(self, url: str) -> None:
        self.client = redis.Redis.from_url(url, socket_timeout=5)

    def reset(self) -> None:
        self.client.config_resetstat()

    def read(self) -> dict[str, dict[str, float]]:
        stats = self.client.info("commandstats")
        out: dict[str, dict[str, float]] = {}
        for name, values in stats.items():
            cmd = name.removeprefix("cmdstat_")
            if cmd in ("info", "config|resetstat"):
                continue  # the bench's own calls
            out[cmd] = {"calls": float(values["calls"]), "usec": float(values["usec"])}
        return out

    def close(self) -> None:
        self.client.close()


@dataclass
class Stack:
    """A running set of processes; `procs` maps a label to its Popen for CPU readings."""

    prefill: list[SimProc]
    decode: list[SimProc]
    routers: list[RouterProc]
    redis_url: str | None
    commands: dict[str, list[str]]
    redis_proc: subprocess.Popen[bytes] | None = None

    @property
    def router_urls(self) -> list[str]:
        return [r.url for r in self.routers]

    def router_cpu(self) -> float:
        return sum(tree_cpu_seconds(r.proc.pid) for r in self.routers)

    def sims(self) -> list[SimProc]:
        return [*self.prefill, *self.decode]


def argv_of(proc: subprocess.Popen[bytes]) -> list[str]:
    args = proc.args
    return [str(a) for a in args] if isinstance(args, Sequence) else [str(args)]


@contextlib.contextmanager
def start_stack(
    *,
    prefill_args: Sequence[Sequence[str]],
    decode_args: Sequence[Sequence[str]],
    router_args: Sequence[Sequence[str]] = (),
    with_redis: bool = True,
    name: str = "bench",
) -> Iterator[Stack]:
    """P and D simulators (one per args list), a private redis-server, and routers."""
    with contextlib.ExitStack() as stack:
        redis_url: str | None = None
        redis_proc: subprocess.Popen[bytes] | None = None
        commands: dict[str, list[str]] = {}
        if with_redis:
            redis_url, port, redis_proc = stack.enter_context(redis_server())
            commands["redis"] = ["redis-server", "--bind", "127.0.0.1", "--port", str(port)]
        sims = enter_all(
            stack,
            [sim("prefill", *a, name=f"{name}-p{i}") for i, a in enumerate(prefill_args)]
            + [sim("decode", *a, name=f"{name}-d{i}") for i, a in enumerate(decode_args)],
        )
        ps, ds = sims[: len(prefill_args)], sims[len(prefill_args) :]
        for i, s in enumerate(ps):
            commands[f"P{i}"] = argv_of(s.proc)
        for i, s in enumerate(ds):
            commands[f"D{i}"] = argv_of(s.proc)
        urls = ([p.url for p in ps], [d.url for d in ds])
        routers = enter_all(
            stack,
            [
                router(*urls, *args, redis_url=redis_url, name=f"{name}-router{i}")
                for i, args in enumerate(router_args)
            ],
        )
        for i, r in enumerate(routers):
            commands[f"router{i}"] = argv_of(r.proc)
        yield Stack(ps, ds, routers, redis_url, commands, redis_proc)


def enter_all(
    stack: contextlib.ExitStack, cms: Sequence[contextlib.AbstractContextManager[T]]
) -> list[T]:
    """Enter context managers in parallel (processes start together); each one that
    started is exited by the stack, even when another failed or Ctrl-C came meanwhile."""
    if not cms:
        return []
    with concurrent.futures.ThreadPoolExecutor(len(cms)) as pool:
        futures = [pool.submit(cm.__enter__) for cm in cms]
        try:
            concurrent.futures.wait(futures)
        finally:
            for cm, future in zip(cms, futures, strict=True):
                with contextlib.suppress(BaseException):
                    future.result()  # waits for a start still under way
                    stack.push(cm)
    return [f.result() for f in futures]


class LoadGen:
    """The load generator process (tests/bench/loadgen.py): one job at a time, bounded."""

    def __init__(self) -> None:
        log = Path(os.environ.get("TMPDIR", "/tmp")) / "kvbaton-test-logs" / "bench-loadgen.log"
        log.parent.mkdir(exist_ok=True)
        self._log = open(log, "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.loadgen"],
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
        self._log.close()

    def __enter__(self) -> LoadGen:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
