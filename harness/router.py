"""The router as a real `kvbaton serve` process (Hypercorn) on a free port, and other HTTP
servers of this project started the same way (the benchmark's passthrough)."""

from __future__ import annotations

import contextlib
import subprocess
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.procs import free_port, log_file, spawn, stop, wait_http
from harness.waiting import timeout_scale

# The secret every test router on Redis signs its sessions with, unless its flags name one or
# say --unsigned-sessions (a router on a shared store refuses to start without either).
SESSION_SECRET = "kvbaton-tests-session-secret"
SIGNING_FLAGS = ("--session-secret", "--unsigned-sessions")
STORE_TIMEOUT = 0.25  # --store-timeout's default
PORT_RACES = 3  # starts on a fresh port after one that lost its port to another process


def store_timeout_flag() -> list[str]:
    """On a loaded machine, --store-timeout stretched as the tests' waits are (a second `make
    test` beside this one kept Redis from answering a cluster's first call, or hit-path turns,
    within 0.25 s); on an idle one nothing: the router's default. Flags a test gives win."""
    scale = timeout_scale()
    return ["--store-timeout", f"{STORE_TIMEOUT * scale:.3g}"] if scale > 1 else []


@dataclass
class RouterProc:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path  # its stdout and stderr

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


def serve_argv(
    prefill: Sequence[str],
    decode: Sequence[str],
    *args: str,
    port: int,
    redis_url: str | None = None,
) -> list[str]:
    """`python -m` arguments of `kvbaton serve` on 127.0.0.1:port (no --redis-url: memory);
    on Redis, signed with SESSION_SECRET unless `args` say otherwise; args last (they win)."""
    argv = ["router", "serve", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prefill", *prefill, "--decode", *decode]
    argv += ["--session-store", "memory"] if redis_url is None else ["--redis-url", redis_url]
    argv += store_timeout_flag()
    if redis_url is not None and not any(a in SIGNING_FLAGS for a in args):
        argv += ["--session-secret", SESSION_SECRET]
    return [*argv, *args]


@contextlib.contextmanager
def http_process(
    argv: Callable[[int], Sequence[str]],
    name: str,
    *,
    ready_timeout: float = 20.0,
    attempts: int = 1,
    stop_timeout: float = 5.0,
) -> Iterator[RouterProc]:
    """Start `python -m <argv(port)>` on a free port and wait for its /health; with
    attempts > 1 a start that is not up in time is tried again on a fresh port (a loaded
    machine). A start that lost its port to another process (a second test run beside this
    one) is always tried again, up to PORT_RACES times."""
    failed = races = 0
    while True:
        port = free_port()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)  # spawn() hands its log file over
            proc = spawn(argv(port), name)
        try:
            wait_http(f"http://127.0.0.1:{port}/health", timeout=ready_timeout, proc=proc)
        except (TimeoutError, RuntimeError):
            stop(proc, timeout=stop_timeout)
            if lost_its_port(log_file(name)) and races + 1 < PORT_RACES:
                races += 1
                continue
            failed += 1
            if failed == attempts:
                raise
            continue
        except BaseException:
            stop(proc, timeout=stop_timeout)
            raise
        try:
            yield RouterProc(f"http://127.0.0.1:{port}", port, proc, log_file(name))
        finally:
            stop(proc, timeout=stop_timeout)
        return


def lost_its_port(log: Path) -> bool:
    """Whether a child's log says its listening port was taken ("Address already in use")."""
    try:
        return "Address already in use" in log.read_text(errors="replace")
    except OSError:
        return False


@contextlib.contextmanager
def router(
    prefill: Sequence[str],
    decode: Sequence[str],
    *args: str,
    redis_url: str | None = None,
    name: str = "router",
    ready_timeout: float = 20.0,
    attempts: int = 1,
    stop_timeout: float = 5.0,
) -> Iterator[RouterProc]:
    """`kvbaton serve` for these P and D URLs (extra flags in args) on Redis, or on the
    in-memory store when redis_url is None; stopped after."""
    with http_process(
        lambda port: serve_argv(prefill, decode, *args, port=port, redis_url=redis_url),
        name,
        ready_timeout=ready_timeout,
        attempts=attempts,
        stop_timeout=stop_timeout,
    ) as r:
        yield r
