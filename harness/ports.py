"""Free TCP ports for the servers tests start, taken where no client socket can take them.

A port the kernel picks for bind(0) comes from its ephemeral range, the range it also picks
from for every outgoing connection; between the probe and the server's own bind, any of the
suite's client sockets (to Redis, to a simulator) can take it, and the server fails with
"Address already in use". The ports here lie below that range, and each pytest-xdist worker
draws from its own slice, so only something outside the suite can hold one.
"""

from __future__ import annotations

import os
import random
import socket
from pathlib import Path

SLICE = 1500  # ports per worker: 8 workers fit below 32768 above 20000
LOWEST = 1024


def _ephemeral_low(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def worker_slice(worker: str | None, ephemeral_low: int) -> range:
    """The ports a worker draws from: gwN's slice counts down from the ephemeral range."""
    index = int(worker[2:]) if worker and worker.startswith("gw") and worker[2:].isdigit() else 0
    top = ephemeral_low - index * SLICE
    return range(max(LOWEST, top - SLICE), max(LOWEST + 1, top))


class _Cursor:
    """Where this process's next port comes from: its worker's slice, walked in order from a
    random start (a child process of the same worker starts elsewhere), so a port comes back
    only after the whole slice was handed out. The port after each one handed out is left
    free: vLLM and the router put a second socket at PORT + 1 by default (the KV events
    replay), and it must not be another server's."""

    def __init__(self) -> None:
        self.ports = worker_slice(os.environ.get("PYTEST_XDIST_WORKER"), _ephemeral_low())
        self.at = random.randrange(len(self.ports))

    def take(self, span: int) -> int | None:
        for _ in range(len(self.ports)):
            if self.at + span + 1 > len(self.ports):
                self.at = 0
            first = self.ports[self.at]
            self.at += 1
            if all(bindable(first + k) for k in range(span)):
                self.at += span  # the next call starts past the span and the port after it
                return first
        return None


def bindable(port: int) -> bool:
    """Whether a server could bind 127.0.0.1:port now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False  # something outside the suite, or a server of this worker, holds it
    return True


_CURSOR = _Cursor()


def free_port(span: int = 1) -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, from this worker's slice; with span,
    the first of that many consecutive free ports (a server that also listens on port + 1)."""
    port = _CURSOR.take(span)
    if port is not None:
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the slice is full
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
