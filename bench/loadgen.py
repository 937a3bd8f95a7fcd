"""The load generator: its own process, fed one JSON job per stdin line, one JSON result out.

Every request goes to a router (kvbaton, a peer, or the floor), round robin over its URLs.
Two kinds of job: `conversations` (n of them, a number at a time) and `arrivals` (a Poisson
process of conversations); both are bounded by a deadline, every turn timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import random
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from vllm_sim.words import COMMON

CHAT = "/v1/chat/completions"
_encode = msgspec.json.encode
_decode = msgspec.json.decode


class _Delta(msgspec.Struct):
    content: Any = None


class _Choice(msgspec.Struct):
    delta: _Delta | None = None


class _Event(msgspec.Struct):
    choices: list[_Choice] | None = None
    usage: Any = None
    error: Any = None


_decode_event = msgspec.json.Decoder(_Event).decode


@dataclass
class Sample:
    """One client request as the client saw it (times in seconds from its start)."""

    ok: bool = False
    latency: float = 0.0
    ttft: float = 0.0
    last: float = 0.0  # the last SSE event's time
    events: int = 0
    text: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    reuse: str = ""
    error: str = ""


def words(rng: random.Random, n: int) -> str:
    """n common words: one simulator token each."""
    return " ".join(rng.choice(COMMON) for _ in range(n))


async def read_stream(resp: aiohttp.ClientResponse, sample: Sample, t0: float, parse: bool) -> None:
    """Time every SSE event; with parse, keep the content deltas and the usage."""
    held = b""
    async for chunk in resp.content.iter_any():
        now = time.perf_counter() - t0
        held += chunk
        parts = held.split(b"\n\n")
        held = parts.pop()
        for part in parts:
            if not part:
                continue
            if sample.events == 0:
                sample.ttft = now
            sample.last = now
            sample.events += 1
            if parse and part.startswith(b"data: {"):
                _take(sample, part[6:])


def _take(sample: Sample, data: bytes) -> None:
    try:
        event = _decode_event(data)
    except msgspec.MsgspecError:
        return
    if event.error is not None:
        sample.error = str(event.error)[:200]
    if isinstance(event.usage, dict):
        sample.usage = event.usage
    for choice in event.choices or ():
        if choice.delta is not None and isinstance(choice.delta.content, str):
            sample.text.append(choice.delta.content)


async def read_reply(
    resp: aiohttp.ClientResponse, sample: Sample, t0: float, stream: bool, parse: bool
) -> None:
    sample.reuse = resp.headers.get("X-KV-Reuse", "")
    if resp.status != 200:
        sample.error = f"HTTP {resp.status}: {(await resp.read())[:200]!r}"
        return
    if stream:
        await read_stream(resp, sample, t0, parse)
        sample.ok = not sample.error
        return
    raw = await resp.read()
    sample.ttft = time.perf_counter() - t0
    sample.events = 1
    if parse:
        body = _decode(raw)
        sample.usage = body.get("usage")
        sample.text.append(body["choices"][0]["message"]["content"] or "")
    sample.ok = True


class Target:
    """A router; the conversation id goes in the body (`conversation_id`), or with
    session_header in an `X-Session-ID` header (what vllm-router's session policies hash)."""

    def __init__(self, urls: list[str], session_header: bool = False) -> None:
        self._urls = itertools.cycle(urls)
        self._header = session_header

    async def send(
        self, s: aiohttp.ClientSession, body: dict[str, Any], conv: str, parse: bool
    ) -> Sample:
        sample = Sample()
        stream = bool(body.get("stream"))
        headers = {**_JSON, "X-Session-ID": conv} if self._header else _JSON
        body = body if self._header else {**body, "conversation_id": conv}
        t0 = time.perf_counter()
        async with s.post(next(self._urls) + CHAT, data=_encode(body), headers=headers) as resp:
            await read_reply(resp, sample, t0, stream, parse)
        sample.latency = time.perf_counter() - t0
        return sample


_JSON = {"Content-Type": "application/json"}


def make_target(spec: dict[str, Any]) -> Target:
    t = spec["target"]
    return Target(t["urls"], bool(t.get("session_header")))


async def _guarded(
    target: Target, s: aiohttp.ClientSession, body: dict[str, Any], conv: str, parse: bool
) -> Sample:
    try:
        return await target.send(s, body, conv, parse)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        return Sample(error=f"{type(exc).__name__}: {exc}"[:200])


def _session(spec: dict[str, Any], limit: int) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=spec.get("request_timeout_s", 60.0), connect=5.0)
    connector = aiohttp.TCPConnector(limit=limit, force_close=False)
    return aiohttp.ClientSession(timeout=timeout, connector=connector)


async def _bounded(aw: Awaitable[Any], deadline: float) -> None:
    """Await until the deadline; past it, cancel what is left (counted as not finished)."""
    task = asyncio.ensure_future(aw)
    try:
        await asyncio.wait_for(task, max(0.1, deadline - time.monotonic()))
    except TimeoutError:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


async def conversations(spec: dict[str, Any]) -> dict[str, Any]:
    """`n` multi-turn chats, `concurrency` at a time; every turn is timed (streaming by default)."""
    target = make_target(spec)
    gate = asyncio.Semaphore(int(spec["concurrency"]))
    deadline = time.monotonic() + float(spec["deadline_s"])
    turns: list[dict[str, Any]] = []
    t0 = time.perf_counter()

    async def chat(s: aiohttp.ClientSession, c: int) -> None:
        rng = random.Random(spec.get("seed", 0) * 7919 + c)
        await asyncio.sleep(rng.uniform(0, float(spec.get("jitter_s", 0.5))))
        async with gate:
            await run_conversation(s, target, spec, rng, c, turns, deadline, t0)

    async with _session(spec, int(spec["concurrency"]) + 8) as s:
        await _bounded(asyncio.gather(*(chat(s, c) for c in range(int(spec["n"])))), deadline)
        wall = time.perf_counter() - t0
    return {"turns": turns, "wall_s": wall}


async def arrivals(spec: dict[str, Any]) -> dict[str, Any]:
    """Conversations arrive at `rate` per second (a Poisson process) for `duration_s`: a
    `one_turn_share` of them have one turn, the others `turns` (lo, hi); a client thinks
    `think_s` seconds (mean, exponential) between two turns of its conversation. Every turn
    is timed and stamped with its start (seconds from the job's start)."""
    target = make_target(spec)
    rng = random.Random(spec.get("seed", 0))
    rate, duration = float(spec["rate"]), float(spec["duration_s"])
    deadline = time.monotonic() + duration + float(spec.get("drain_s", 30.0))
    turns: list[dict[str, Any]] = []
    running: set[asyncio.Task[None]] = set()
    async with _session(spec, int(spec.get("max_inflight", 1024))) as s:
        t0 = time.perf_counter()
        at, c = rng.expovariate(rate), 0
        while at < duration:
            delay = t0 + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            one = rng.random() < float(spec["one_turn_share"])
            conv_spec = {**spec, "turns": 1 if one else rng.randint(*spec["turns"])}
            conv_rng = random.Random(spec.get("seed", 0) * 7919 + c)
            task = asyncio.create_task(
                run_conversation(s, target, conv_spec, conv_rng, c, turns, deadline, t0)
            )
            running.add(task)
            task.add_done_callback(running.discard)
            at, c = at + rng.expovariate(rate), c + 1
        if running:
            await _bounded(asyncio.gather(*running), deadline)
        wall = time.perf_counter() - t0
    return {"turns": turns, "wall_s": wall, "conversations": c}


def think_time(spec: dict[str, Any], rng: random.Random) -> float:
    """The pause before a turn after the first: exponential of mean `think_s`, cut at 4 means
    (0: none)."""
    mean = float(spec.get("think_s", 0.0))
    return min(rng.expovariate(1 / mean), 4 * mean) if mean > 0 else 0.0


async def run_conversation(
    s: aiohttp.ClientSession,
    target: Target,
    spec: dict[str, Any],
    rng: random.Random,
    c: int,
    turns: list[dict[str, Any]],
    deadline: float,
    t0: float,
) -> None:
    """One conversation's turns, each recorded with its start from t0 and a digest of its
    answer (to compare across arms). A pause (think_time) comes before every turn after the
    first."""
    lo, hi = spec["system_words"]
    history: list[dict[str, Any]] = [{"role": "system", "content": words(rng, rng.randint(lo, hi))}]
    conv = f"bench-{spec.get('seed', 0)}-{c}-{uuid.uuid4().hex[:8]}"
    for t in range(1, int(spec["turns"]) + 1):
        pause = think_time(spec, rng) if t > 1 else 0.0
        if pause > 0:
            await asyncio.sleep(pause)
        if time.monotonic() >= deadline:
            return
        started = time.perf_counter() - t0
        user = {"role": "user", "content": words(rng, rng.randint(*spec["user_words"]))}
        body: dict[str, Any] = {
            "model": spec.get("model", "sim-model"),
            "messages": [*history, user],
            "max_tokens": rng.randint(*spec["output_tokens"]),
            "stream": bool(spec.get("stream", True)),
        }
        if body["stream"]:
            body["stream_options"] = {"include_usage": True}
        sample = await _guarded(target, s, body, conv, True)
        turns.append({**_turn_record(c, t, sample), "start": started})
        if not sample.ok:
            return  # the history would no longer match what D holds
        history += [user, {"role": "assistant", "content": "".join(sample.text)}]


def _turn_record(c: int, t: int, x: Sample) -> dict[str, Any]:
    usage = x.usage or {}
    return {
        "conv": c,
        "turn": t,
        "ok": x.ok,
        "ttft": x.ttft,
        "latency": x.latency,
        # Inter-token latency as the stream saw it (the mean gap between its SSE events): a
        # turn run on D alone puts its prefill into the steps of the streams D is decoding.
        "itl": (x.last - x.ttft) / (x.events - 1) if x.events > 1 else 0.0,
        "events": x.events,
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "reuse": x.reuse,
        "error": x.error,
        "answer": hashlib.blake2b("".join(x.text).encode(), digest_size=8).hexdigest(),
    }


KINDS: dict[str, Callable[[dict[str, Any]], Coroutine[Any, Any, dict[str, Any]]]] = {
    "conversations": conversations,
    "arrivals": arrivals,
}


def main() -> int:
    """Serve jobs until stdin closes: one JSON spec per line in, one JSON result per line out."""
    for line in sys.stdin:
        if not line.strip():
            continue
        spec = json.loads(line)
        try:
            result = asyncio.run(KINDS[spec["kind"]](spec))
        except Exception as exc:  # reported to the orchestrator, which fails the job
            result = {"fatal": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
