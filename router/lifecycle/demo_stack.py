"""The demo's local stack: a private redis-server, simulator P and D and the router on free
127.0.0.1 ports, each started as a child process and ready when it answers; stopped in
reverse order (`kvbaton demo`, router/lifecycle/demo.py)."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from router.errors import DemoError

Proc = subprocess.Popen[bytes]
HOST = "127.0.0.1"
# The demo cost model, so KV reuse shows as time; render routes served, as by deploy/'s engines.
COST_MODEL = "--prefill-ms-per-token 0.5 --transfer-ms-per-block 0.05 --decode-ms-per-token 2"
COST_MODEL += " --enable-scale-out"
# Bidirectional KV transfer; pull from D however few tokens it adds (vLLM's default is 64).
BIDIR = "--bidirectional --kv-recompute-threshold 0"
ROLES = ("prefill", "decode")


@dataclass
class Stack:
    """The child processes, started in order and stopped in reverse; logs under one folder."""

    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="kvbaton-demo-")))
    children: list[tuple[str, Proc]] = field(default_factory=list)

    def start(self, name: str, argv: Sequence[str]) -> Proc:
        with open(self.logs / f"{name}.log", "wb") as log:
            # A session of its own: Ctrl-C reaches the demo, which stops children in order.
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.children.append((name, proc))
        return proc

    def check(self, name: str, proc: Proc) -> None:
        if proc.poll() is not None:
            tail = (self.logs / f"{name}.log").read_text(errors="replace")[-2000:]
            raise DemoError(f"{name} exited with status {proc.returncode}:\n{tail}")

    def stop(self) -> None:
        for _name, proc in reversed(self.children):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for _name, proc in reversed(self.children):
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.children.clear()


def free_ports(count: int, preferred: int = 0) -> list[int]:
    """Distinct free loopback ports (held together while chosen); `preferred` first if free."""
    with contextlib.ExitStack() as held:
        ports: list[int] = []
        for _ in range(count):
            sock = held.enter_context(socket.socket())
            try:
                sock.bind((HOST, 0 if ports else preferred))
            except OSError:
                sock.bind((HOST, 0))
            ports.append(int(sock.getsockname()[1]))
        return ports


async def wait_ready(stack: Stack, name: str, proc: Proc, url: str) -> None:
    deadline = time.monotonic() + 60
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as http:
        while time.monotonic() < deadline:
            stack.check(name, proc)
            with contextlib.suppress(aiohttp.ClientError, asyncio.TimeoutError):
                async with http.get(url) as resp:
                    if resp.status == 200:
                        return
            await asyncio.sleep(0.1)
    raise DemoError(f"{name} was not ready at {url} after 60 s (log: {stack.logs}/{name}.log)")


async def wait_redis(stack: Stack, proc: Proc, port: int) -> None:
    for _ in range(200):
        stack.check("redis", proc)
        with contextlib.suppress(OSError):
            (await asyncio.open_connection(HOST, port))[1].close()
            return
        await asyncio.sleep(0.05)
    raise DemoError(f"redis-server did not listen on {HOST}:{port}")


async def start_redis(stack: Stack, redis_url: str | None) -> list[str]:
    """The router's session-store flags: the given Redis, a private one, or memory."""
    if redis_url:
        return ["--redis-url", redis_url]
    exe = shutil.which("redis-server")
    if exe is None:
        print("  redis-server is not on PATH: sessions live in the router (--session-store memory)")
        return ["--session-store", "memory"]
    [port] = free_ports(1)
    no_persistence = ["--save", "", "--appendonly", "no", "--dir", str(stack.logs)]
    argv = [exe, "--bind", HOST, "--port", str(port), *no_persistence]
    await wait_redis(stack, stack.start("redis", argv), port)
    url = f"redis://{HOST}:{port}/0"
    print(f"  redis      {url}  (private redis-server, no persistence)")
    return ["--redis-url", url]


def launch_sim(
    stack: Stack, role: str, port: int, kv_port: int, connector: str
) -> tuple[str, Proc]:
    flags = f"--role {role} --host {HOST} --port {port} --kv-port {kv_port} --engine-id demo-{role}"
    mode = BIDIR if connector == "nixl" else f"--kv-connector {connector}"
    argv = [sys.executable, "-m", "vllm_sim", *f"{flags} {mode} {COST_MODEL}".split()]
    return f"http://{HOST}:{port}", stack.start(role, argv)


async def start_sims(stack: Stack, connector: str) -> tuple[str, str]:
    """P and D start together; each is ready when its /health answers."""
    ports = iter(free_ports(4))  # HTTP and side channel of P, then of D
    launched = {
        role: launch_sim(stack, role, next(ports), next(ports), connector) for role in ROLES
    }
    what = "bidirectional KV transfer" if connector == "nixl" else "push mode: P writes D's blocks"
    for role, (url, proc) in launched.items():
        await wait_ready(stack, role, proc, url + "/health")
        print(f"  {role:<10} {url}  (vllm_sim, {what})")
    return launched["prefill"][0], launched["decode"][0]


async def start_router(
    stack: Stack, port: int, store: list[str], p: str, d: str, connector: str
) -> str:
    flags = f"--host {HOST} --port {port} --prefill {p} --decode {d}".split()
    # Sessions signed with a secret made for this run, on no command line (mkdtemp: 0700).
    config = stack.logs / "router.toml"
    config.write_text(f'session_secret = "{secrets.token_urlsafe(32)}"\n')
    flags += ["--kv-connector", connector, "--config", str(config)]
    argv = [sys.executable, "-m", "router", "serve", *flags, *store]
    url = f"http://{HOST}:{port}"
    await wait_ready(stack, "router", stack.start("router", argv), url + "/health")
    print(f"  router     {url}")
    async with aiohttp.ClientSession() as http, http.get(url + "/ready") as resp:
        text = await resp.text()
        if resp.status != 200:
            print(f"  router is not ready ({resp.status}): {text}")
        elif '"degraded":true' in text:  # e.g. Redis unreachable: it serves, without reuse
            print(f"  router is ready, degraded: {text}")
        async with http.get(url + "/status") as resp:
            signed = (await resp.json(content_type=None)).get("signed")
    print(f"  sessions   {'signed (a secret made for this run)' if signed else 'UNSIGNED'}")
    return url
