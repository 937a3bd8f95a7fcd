"""End-to-end harness: the router as a real `kvbaton serve` process (Hypercorn) on a free port."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.procs import free_port, log_file, spawn, stop, wait_http


@dataclass
class RouterProc:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path  # its stdout and stderr

    @property
    def base_url(self) -> str:
        return self.url + "/v1"


@contextlib.contextmanager
def router(
    prefill: Sequence[str],
    decode: Sequence[str],
    *args: str,
    redis_url: str | None = None,
    name: str = "router",
    ready_timeout: float = 20.0,
) -> Iterator[RouterProc]:
    port = free_port()
    argv = [
        "router",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefill",
        *prefill,
        "--decode",
        *decode,
    ]
    if redis_url is None:
        argv += ["--session-store", "memory"]
    else:
        argv += ["--redis-url", redis_url]
    proc = spawn([*argv, *args], name)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", ready_timeout, proc=proc)
        yield RouterProc(f"http://127.0.0.1:{port}", port, proc, log_file(name))
    finally:
        stop(proc)
