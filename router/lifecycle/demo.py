"""`kvbaton demo`: a local GPU-free stack (Redis, simulator P and D, the router) and a scripted
four-turn conversation that shows per-turn latency and KV reuse, then serves until Ctrl-C."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from router.errors import DemoError

Proc = subprocess.Popen[bytes]
HOST = "127.0.0.1"
MODEL = "sim-model"  # the simulator's default served model name
MAX_TOKENS = 48
# The demo cost model, so KV reuse shows as time; render routes served, as by deploy/'s engines.
COST_MODEL = "--prefill-ms-per-token 0.5 --transfer-ms-per-block 0.05 --decode-ms-per-token 2"
COST_MODEL += " --enable-scale-out"
LEGEND = f"""
  latency  the whole request: prefill on P, then up to {MAX_TOKENS} tokens decoded on D
           (simulated costs: 0.5 ms per computed prompt token, 0.05 ms per KV block pulled,
           2 ms per generated token)
  cached   prompt tokens P did not compute: its own prefix cache plus the KV pulled from D
  hit      the router gave P the previous turn's KV handle from D (the baton)
"""
# Bidirectional KV transfer; pull from D however few tokens it adds (vLLM's default is 64).
BIDIR = "--bidirectional --kv-recompute-threshold 0"
ROLES = ("prefill", "decode")

SYSTEM_PROMPT = (
    "You are the support assistant of a small company that rents bicycles to visitors of an old "
    "harbour town. Answer in a friendly and short way, in plain words, and never invent prices or "
    "opening hours that are not written here. The shop opens at nine in the morning and closes at "
    "seven in the evening, every day of the week except on the first day of the year. A city bike "
    "costs twelve euros for half a day and twenty euros for a whole day. An electric bike costs "
    "twenty five euros for half a day and forty euros for a whole day. Children ride free on a "
    "seat behind a parent, and a helmet and a lock come with every bike at no extra cost. A "
    "customer who brings a bike back late pays five euros for every started hour. Groups of more "
    "than six people should book a day ahead, because the shop keeps only thirty bikes. The coast "
    "road to the lighthouse is flat and takes about forty minutes each way; the forest path over "
    "the hill is steep, muddy after rain and best done on an electric bike. There is a bakery at "
    "the lighthouse and a lake with a small beach halfway along the forest path. When a customer "
    "asks for a route, name the road, the time it takes and one place to stop. Keep every answer "
    "under five sentences, and end by asking whether the customer needs anything else."
)
QUESTIONS = (
    "Hello! We are two adults and one child. What would a day of cycling cost us?",
    "Which route would you suggest for a sunny afternoon?",
    "And if it rained this morning, is the forest path still a good idea?",
    "Great. Can we bring the bikes back at eight in the evening?",
)


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


def first_words(text: str, count: int = 9) -> str:
    words = text.split()
    return " ".join(words[:count]) + (" ..." if len(words) > count else "")


async def one_turn(
    http: aiohttp.ClientSession, url: str, conv_id: str, messages: list[dict[str, str]]
) -> tuple[float, str, dict[str, Any]]:
    body = dict(model=MODEL, messages=messages, max_tokens=MAX_TOKENS, conversation_id=conv_id)
    started = time.perf_counter()
    async with http.post(url + "/v1/chat/completions", json=body) as resp:
        data: dict[str, Any] = await resp.json(content_type=None)
        if resp.status != 200:
            raise DemoError(f"the router answered {resp.status}: {data}")
        elapsed_ms = (time.perf_counter() - started) * 1000
        return elapsed_ms, resp.headers.get("X-KV-Reuse", "-"), data


PUSH_LEGEND = f"""
  latency  the whole request: P and D called together, P writes D the blocks D lacks, then up
           to {MAX_TOKENS} tokens decoded on D (simulated costs: 0.5 ms per computed prompt
           token, 0.05 ms per KV block written, 2 ms per generated token)
  cached   prompt tokens D did not compute: its own prefix cache plus the blocks P wrote
  push-affinity  no D->P reuse in push mode (vllm#46473): the same P and D keep the
           conversation in their prefix caches, so P computes and writes only the new turn
"""


async def converse(url: str, conv_id: str, connector: str = "nixl") -> None:
    """The scripted chat: each turn resends the whole history, as chat clients do."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    print(f"\nA {len(QUESTIONS)}-turn chat, conversation_id={conv_id!r}, non-streaming:\n")
    print(f"  {'turn':>4}  {'latency':>8}  {'X-KV-Reuse':<34} {'prompt':>6} {'cached':>6}  answer")
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for turn, question in enumerate(QUESTIONS, start=1):
            messages.append({"role": "user", "content": question})
            ms, reuse, data = await one_turn(http, url, conv_id, messages)
            answer = data["choices"][0]["message"]["content"] or ""
            messages.append({"role": "assistant", "content": answer})
            usage = data.get("usage") or {}
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
            print(
                f"  {turn:>4}  {ms:>5.0f} ms  {reuse:<34} {usage.get('prompt_tokens', '?'):>6} "
                f"{'-' if cached is None else cached:>6}  {first_words(answer)}"
            )
    print(LEGEND if connector == "nixl" else PUSH_LEGEND)


def print_usage(url: str, conv_id: str, store: list[str]) -> None:
    print(f"""
The router is at {url}  (OpenAI API: {url}/v1). Try it:

  curl -si {url}/v1/chat/completions -H 'Content-Type: application/json' \\
    -H 'X-Conversation-Id: my-chat' \\
    -d '{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  from openai import OpenAI
  client = OpenAI(base_url="{url}/v1", api_key="unused")
  reply = client.chat.completions.create(
      model="{MODEL}", messages=[{{"role": "user", "content": "Hello!"}}],
      extra_body={{"conversation_id": "my-chat"}})
""")
    if store[0] == "--redis-url":
        key = f"kvbaton:conv:{{default:{conv_id}}}"  # no bearer token: tenant "default"
        print(f"  The demo conversation in Redis:\n  redis-cli -u {store[1]} HGETALL '{key}'\n")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="kvbaton demo",
        description="Start Redis, a simulated prefill and decode engine and the router on "
        "127.0.0.1, run a scripted multi-turn chat showing KV reuse, then keep serving.",
    )
    parser.add_argument("--port", type=int, default=0, help="router port (default: 8000 if free)")
    parser.add_argument("--redis-url", help="use this Redis instead of a private redis-server")
    parser.add_argument("--no-serve", action="store_true", help="exit after the scripted chat")
    parser.add_argument(
        "--kv-connector",
        choices=("nixl", "nixl-push"),
        default="nixl",
        help="the engines' KV-transfer mode (docs/connectors.md); nixl-push: affinity only",
    )
    return parser.parse_args(list(argv))


async def run(args: argparse.Namespace, stack: Stack) -> None:
    print(f"Starting the demo stack (logs in {stack.logs}):")
    store = await start_redis(stack, args.redis_url)
    p_url, d_url = await start_sims(stack, args.kv_connector)
    port = args.port or free_ports(1, 8000)[0]
    url = await start_router(stack, port, store, p_url, d_url, args.kv_connector)
    conv_id = f"demo-{uuid.uuid4().hex[:8]}"
    await converse(url, conv_id, args.kv_connector)
    print_usage(url, conv_id, store)
    if args.no_serve:
        return
    print("Serving. Press Ctrl-C to stop.", flush=True)
    await asyncio.Event().wait()


async def main(args: argparse.Namespace) -> None:
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, task.cancel)
    stack = Stack()
    try:
        await run(args, stack)
    except asyncio.CancelledError:
        print("\nStopping the demo stack ...")
    finally:
        stack.stop()
    # Logs are kept only when something failed (a DemoError skips this line).
    shutil.rmtree(stack.logs, ignore_errors=True)


def demo_main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    if isinstance(sys.stdout, io.TextIOWrapper):
        sys.stdout.reconfigure(line_buffering=True)  # lines as they come, also through a pipe
    try:
        asyncio.run(main(args))
    except DemoError as exc:
        print(f"kvbaton demo: {exc}", file=sys.stderr)
        return 1
    return 0
