"""Private Redis topologies for tests: a 3-master Redis Cluster and a Sentinel-managed master.

Loopback only, no persistence, free ports; each yields the URL sessions.connect understands.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.ports import bindable
from harness.procs import free_port, logged, stop, wait_tcp
from harness.waiting import Deadline

SENTINEL_SERVICE = "kvbaton"


@dataclass
class Topology:
    url: str
    ports: list[int]  # data nodes (cluster masters, or the sentinel's master and replicas)
    procs: list[subprocess.Popen[bytes]]
    sentinel_port: int = 0


def _exe(name: str) -> str:
    exe = shutil.which(name)
    if exe is None:
        raise RuntimeError(f"{name} is not installed (make install installs redis-server)")
    return exe


def _server(port: int, workdir: Path, *extra: str) -> subprocess.Popen[bytes]:
    """A redis-server logging to log_file("redis-<port>") (a failed start shows its end)."""
    argv = [_exe("redis-server"), "--bind", "127.0.0.1", "--port", str(port), "--save", ""]
    argv += ["--appendonly", "no", "--dir", str(workdir), "--loglevel", "warning", *extra]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # logged() lets its file object go
        return logged(argv, f"redis-{port}")


def _cli(port: int, *args: str) -> str:
    done = subprocess.run(
        [_exe("redis-cli"), "-h", "127.0.0.1", "-p", str(port), *args],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if done.returncode:
        raise subprocess.SubprocessError(f"redis-cli {' '.join(args)}: {done.stdout}{done.stderr}")
    return done.stdout


def cluster_port(taken: Sequence[int]) -> int:
    """A free port whose cluster bus port (port + 10000) is free and valid too."""
    for _ in range(200):
        port = free_port()  # below 32768: the bus port is below 42768, a valid port
        if port not in taken and bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a cluster node")


def wait_until(predicate: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    """Poll predicate (a failing redis-cli counts as False) until it holds, at most timeout
    seconds times timeout_scale()."""
    deadline = Deadline(timeout)
    last = ""
    while not deadline.expired():
        try:
            if predicate():
                return
        except (subprocess.SubprocessError, OSError) as exc:
            last = f"; last error: {exc}"
        time.sleep(0.1)
    raise TimeoutError(deadline.report(what + last))


@contextlib.contextmanager
def redis_cluster(masters: int = 3) -> Iterator[Topology]:
    """`masters` redis-servers in cluster mode, joined with redis-cli --cluster create."""
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="kvbaton-cluster-") as tmp:
        ports = []
        try:
            for i in range(masters):
                port = cluster_port(ports)
                ports.append(port)
                workdir = Path(tmp) / str(i)
                workdir.mkdir()
                procs.append(
                    _server(
                        port,
                        workdir,
                        "--cluster-enabled",
                        "yes",
                        "--cluster-config-file",
                        str(workdir / "nodes.conf"),
                        # Long: on a loaded machine a slow node must not be voted down.
                        "--cluster-node-timeout",
                        "15000",
                    )
                )
            for port, proc in zip(ports, procs, strict=True):
                wait_tcp(port, proc=proc)
            nodes = [f"127.0.0.1:{p}" for p in ports]
            create = ("--cluster", "create", *nodes, "--cluster-replicas", "0", "--cluster-yes")
            _cli(ports[0], *create)
            wait_until(
                lambda: all("cluster_state:ok" in _cli(p, "cluster", "info") for p in ports),
                "the cluster is not ok",
            )
            seeds = ",".join(nodes)
            yield Topology(f"redis+cluster://{seeds}", ports, procs)
        finally:
            for proc in procs:
                stop(proc)


@contextlib.contextmanager
def redis_sentinel(replicas: int = 0) -> Iterator[Topology]:
    """A master (and replicas) watched by one `redis-server --sentinel` (quorum 1)."""
    procs: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="kvbaton-sentinel-") as tmp:
        try:
            master = free_port()
            procs.append(_server(master, Path(tmp)))
            ports = [master]
            for i in range(replicas):
                port = free_port()
                workdir = Path(tmp) / f"replica{i}"
                workdir.mkdir()
                procs.append(_server(port, workdir, "--replicaof", "127.0.0.1", str(master)))
                ports.append(port)
            for port, proc in zip(ports, procs, strict=True):
                wait_tcp(port, proc=proc)
            for port in ports[1:]:  # replicas in sync before anyone relies on them
                wait_until(
                    lambda port=port: "master_link_status:up" in _cli(port, "info", "replication"),
                    "a replica did not sync with the master",
                    timeout=60,
                )
            sentinel = free_port()
            conf = Path(tmp) / "sentinel.conf"
            conf.write_text(
                f"port {sentinel}\n"
                "bind 127.0.0.1\n"
                f"dir {tmp}\n"
                f"sentinel monitor {SENTINEL_SERVICE} 127.0.0.1 {master} 1\n"
                f"sentinel down-after-milliseconds {SENTINEL_SERVICE} 1000\n"
                f"sentinel failover-timeout {SENTINEL_SERVICE} 3000\n"
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", ResourceWarning)  # as in _server
                procs.append(
                    logged(
                        [_exe("redis-server"), str(conf), "--sentinel", "--loglevel", "warning"],
                        f"redis-sentinel-{sentinel}",
                    )
                )
            wait_tcp(sentinel, proc=procs[-1])
            wait_until(
                lambda: (
                    str(master)
                    in _cli(sentinel, "sentinel", "get-master-addr-by-name", SENTINEL_SERVICE)
                ),
                "the sentinel does not know the master",
            )
            url = f"redis+sentinel://127.0.0.1:{sentinel}/{SENTINEL_SERVICE}/0"
            yield Topology(url, ports, procs, sentinel)
        finally:
            for proc in reversed(procs):
                stop(proc)
