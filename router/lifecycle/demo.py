"""`kvbaton demo`: a local GPU-free stack (Redis, simulator P and D, the router) and a scripted
four-turn chat, streamed, that shows per-turn time to first token and the prompt tokens
computed, with reuse and without; then it serves until Ctrl-C (or, with --no-serve, says what
it showed and stops). The stack: demo_stack.py; the chat and its table: demo_chat.py."""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import shutil
import signal
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path

from router.errors import DemoError
from router.lifecycle.demo_chat import API_KEY, MODEL, converse, summary
from router.lifecycle.demo_stack import Stack, free_ports, start_redis, start_router, start_sims


def kvbaton_command() -> str:
    """How to run `kvbaton` from here: the venv's script, relative when below the cwd."""
    script = Path(sys.executable).parent / "kvbaton"
    if not script.exists():
        return "kvbaton"
    with_dir = os.path.relpath(script)
    return with_dir if not with_dir.startswith("..") else str(script)


def print_usage(url: str, conv_id: str, store: list[str]) -> None:
    redis_url = store[1] if store[0] == "--redis-url" else ""
    exports = f"OPENAI_BASE_URL={url}/v1 OPENAI_API_KEY={API_KEY}"
    exports += f" REDIS_URL={redis_url}" if redis_url else ""
    print(f"""The router is at {url}  (OpenAI API: {url}/v1). In another shell:

  export {exports}

and the README's examples run as written (README.md, "Using it"). One conversation, my-chat,
from curl and then from the OpenAI SDK (the same API key: the same tenant, one session):

  curl -si "$OPENAI_BASE_URL/chat/completions" -H "Authorization: Bearer $OPENAI_API_KEY" \\
    -H 'Content-Type: application/json' -H 'X-Conversation-Id: my-chat' \\
    -d '{{"model": "{MODEL}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'

  from openai import OpenAI
  client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY from the environment
  reply = client.chat.completions.create(
      model="{MODEL}", messages=[{{"role": "user", "content": "Hello again!"}}],
      extra_body={{"conversation_id": "my-chat"}})
""")
    if redis_url:
        show = f"{kvbaton_command()} session show {conv_id} --api-key {API_KEY}"
        print(f"  The demo conversation in Redis:\n  {show} --redis-url {redis_url}\n")


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
    conv_id = f"demo-{uuid.uuid4().int % 10**8:08d}"  # digits: see demo_chat.twin
    rows = await converse(url, conv_id, args.kv_connector)
    if args.no_serve:
        print(summary(rows))
        return
    print(summary(rows), end="\n\n")
    print_usage(url, conv_id, store)
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
