"""What a local tokenizer would cost the router against P's `/tokenize` (issue 49).

p50/p90 ms: a Llama 3.1 chat template rendered by Jinja2 (sandboxed, as transformers does) and
encoded by HF `tokenizers`, in-process and in to_thread, against an HTTP `/tokenize` round trip.
The venv (tokenizers, jinja2) and commands: docs/architecture.md, "A local tokenizer".
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from vllm_sim.words import COMMON, GENERATED

TEMPLATE = (  # Llama 3.1's chat template, less its tool branches
    "{{- bos_token }}{%- if messages[0]['role'] == 'system' %}"
    "{%- set sys = messages[0]['content']|trim %}{%- set messages = messages[1:] %}"
    "{%- else %}{%- set sys = '' %}{%- endif %}{{- '<|start_header_id|>system<|end_header_id|>"
    "\n\nCutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n' + sys }}"
    "{{- '<|eot_id|>' }}{%- for message in messages %}{{- '<|start_header_id|>' + message['role']"
    " + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{%- endif %}"
)
SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
PROSE = Path("/usr/share/common-licenses/GPL-3")  # English prose, present on Debian
Messages = list[dict[str, str]]
Count = Callable[[str], int]


def pct(xs: list[float]) -> str:
    q = statistics.quantiles(xs, n=10)
    return f"{statistics.median(xs) * 1e3:6.2f} {q[8] * 1e3:6.2f}"


def conversation(words: list[str], answers: list[str], target: int, count: Count) -> Messages:
    """A system prompt, then 40-word user turns and 30-word answers until ~target tokens."""
    msgs = [{"role": "system", "content": " ".join(words[:120])}]
    used, i = count(msgs[0]["content"]) + 20, 120
    while used < target:
        for role, n, src in (("user", 40, words), ("assistant", 30, answers)):
            text = " ".join(src[(i + k) % len(src)] for k in range(n))
            msgs.append({"role": role, "content": text})
            used, i = used + count(text) + 5, i + n
    msgs[-1] = {"role": "user", "content": msgs[-1]["content"]}
    return msgs


def once(fn: Callable[[], object], clock: Any = time.perf_counter) -> float:
    t0 = clock()
    fn()
    return float(clock() - t0)


async def _tick(gaps: list[float]) -> None:
    last = time.perf_counter()
    while True:
        await asyncio.sleep(0)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now


async def threaded(fn: Callable[[], object]) -> list[float]:
    """Latency of to_thread(fn) seen from the loop, and the loop's longest stall meanwhile."""
    gaps: list[float] = []
    ticker = asyncio.create_task(_tick(gaps))
    await asyncio.sleep(0)  # the ticker runs before the thread can take the GIL
    t0 = time.perf_counter()
    await asyncio.to_thread(fn)
    lat = time.perf_counter() - t0
    ticker.cancel()
    return [lat, max(gaps, default=0.0)]


async def http(session: aiohttp.ClientSession, args: Any, msgs: Messages) -> list[float]:
    body = {"model": args.model, "messages": msgs, "add_generation_prompt": True}
    t0 = time.perf_counter()
    async with session.post(args.url + "/tokenize", json=body) as resp:
        assert (await resp.json())["tokens"]
    return [time.perf_counter() - t0]


async def measure(tok: Any, render: Any, session: Any, args: Any) -> list[list[float]]:
    """One sample of each in turn (all see the same load): render, encode, both (wall, CPU);
    to_thread: encode (GIL held), encode_batch (released); the new turn alone; P's /tokenize."""
    text = render()
    tail = "<|start_header_id|>user<|end_header_id|>\n\n" + text.rsplit("\n\n", 2)[1] + "\n\n"
    local = lambda: tok.encode(render(), add_special_tokens=False)  # noqa: E731
    cols: list[list[float]] = [[] for _ in range(10)]
    for _ in range(args.runs):
        row = [once(render), once(lambda: tok.encode(text, add_special_tokens=False))]
        row += [once(local), once(local, time.thread_time), *await threaded(local)]
        row += await threaded(lambda: tok.encode_batch([render()], add_special_tokens=False))
        row.append(once(lambda: tok.encode(tail, add_special_tokens=False)))
        row += await http(session, args, render.keywords["messages"]) if args.url else []
        for col, x in zip(cols, row, strict=False):
            col.append(x)
    return [c for c in cols if c]


async def main(args: argparse.Namespace, prose: list[str]) -> None:
    import jinja2.sandbox  # type: ignore[import-not-found, unused-ignore]
    from tokenizers import Tokenizer  # type: ignore[import-not-found, unused-ignore]

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(TEMPLATE)
    kinds = {"bench": (COMMON, GENERATED), "prose": (prose, prose)}
    print(f"load {os.getloadavg()[0]:.1f} | render | encode | local, its CPU | to_thread, stall")
    print("  | to_thread with encode_batch, stall | the new turn | http /tokenize (p50 p90 ms)")
    async with aiohttp.ClientSession() as session:
        for path in args.tokenizer:
            tok: Any = Tokenizer.from_file(path)
            tok.add_special_tokens(SPECIAL)
            bos = tok.id_to_token(0)

            def count(text: str, tok: Any = tok) -> int:
                return len(tok.encode(text, add_special_tokens=False).ids)

            for kind, (words, answers) in kinds.items():
                for size in args.sizes:
                    msgs = conversation(words, answers, size, count)
                    render = functools.partial(
                        template.render, messages=msgs, bos_token=bos, add_generation_prompt=True
                    )
                    cols = await measure(tok, render, session, args)
                    head = f"{Path(path).stem} {kind} {size} {count(render())}"
                    print(" | ".join([head, *map(pct, cols)]), flush=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tokenizer", action="append", required=True, help="a tokenizer.json")
    p.add_argument("--url", default="", help="a P base URL for /tokenize (vllm_sim or vLLM)")
    p.add_argument("--model", default="sim-model", help="the model name P serves")
    p.add_argument("--sizes", nargs="+", type=int, default=[1024, 2048, 4096, 8192])
    p.add_argument("--runs", type=int, default=200)
    asyncio.run(main(p.parse_args(), PROSE.read_text().split() if PROSE.exists() else COMMON))
