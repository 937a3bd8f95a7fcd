"""The load generator: its own process, fed one JSON job per stdin line, one JSON result out.

Two targets send the same client requests: `router` (POST to kvbaton) and `direct` (a minimal
client doing the P and D legs itself, as vLLM's toy proxy does: round robin over P and over
D, P with max_tokens=1 and the null handoff, D with P's kv_transfer_params, no session).
Every loop is bounded by a request count and a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import math
import random
import statistics
import sys
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec

from harness.chat import NULL_HANDOFF
from vllm_sim.words import COMMON

CHAT = "/v1/chat/completions"
BODY_POOL = 4096  # distinct request bodies per job; longer jobs cycle through them
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
    """Where a client request goes; `send` fills a Sample."""

    async def send(
        self, s: aiohttp.ClientSession, body: dict[str, Any], conv: str | None, parse: bool
    ) -> Sample:
        raise NotImplementedError


class RouterTarget(Target):
    """A router; the conversation id goes in the body (`conversation_id`), or with
    session_header in an `X-Session-ID` header (what vllm-router's session policies hash)."""

    def __init__(self, urls: list[str], session_header: bool = False) -> None:
        self._urls = itertools.cycle(urls)
        self._header = session_header

    async def send(
        self, s: aiohttp.ClientSession, body: dict[str, Any], conv: str | None, parse: bool
    ) -> Sample:
        sample = Sample()
        stream = bool(body.get("stream"))
        headers = _JSON
        if conv is not None and self._header:
            headers = {**_JSON, "X-Session-ID": conv}
        elif conv is not None:
            body = {**body, "conversation_id": conv}
        t0 = time.perf_counter()
        async with s.post(next(self._urls) + CHAT, data=_encode(body), headers=headers) as resp:
            await read_reply(resp, sample, t0, stream, parse)
        sample.latency = time.perf_counter() - t0
        return sample


class DirectTarget(Target):
    """The P and D legs done by the client itself (vLLM's toy proxy logic, minus the hop)."""

    def __init__(self, prefill: list[str], decode: list[str]) -> None:
        self._p = itertools.cycle(prefill)
        self._d = itertools.cycle(decode)

    async def send(
        self, s: aiohttp.ClientSession, body: dict[str, Any], conv: str | None, parse: bool
    ) -> Sample:
        sample = Sample()
        stream = bool(body.get("stream"))
        p_body = {k: v for k, v in body.items() if k not in ("stream_options",)}
        p_body.update(
            max_tokens=1, stream=False, kv_transfer_params=NULL_HANDOFF, max_completion_tokens=1
        )
        headers = {**_JSON, "X-Request-Id": uuid.uuid4().hex}
        t0 = time.perf_counter()
        async with s.post(next(self._p) + CHAT, data=_encode(p_body), headers=headers) as resp:
            raw = await resp.read()
            if resp.status != 200:
                sample.error = f"P answered HTTP {resp.status}: {raw[:200]!r}"
                sample.latency = time.perf_counter() - t0
                return sample
        params = _decode(raw).get("kv_transfer_params")
        d_body = {**body, "kv_transfer_params": params}
        async with s.post(next(self._d) + CHAT, data=_encode(d_body), headers=headers) as resp:
            await read_reply(resp, sample, t0, stream, parse)
        sample.latency = time.perf_counter() - t0
        return sample


_JSON = {"Content-Type": "application/json"}


def make_target(spec: dict[str, Any]) -> Target:
    t = spec["target"]
    if t["mode"] == "router":
        return RouterTarget(t["urls"], bool(t.get("session_header")))
    return DirectTarget(t["prefill"], t["decode"])


def request_body(spec: dict[str, Any], index: int) -> dict[str, Any]:
    """The index-th request of a job: the same sequence for every target (seeded)."""
    rng = random.Random(spec.get("seed", 0) * 1_000_003 + index)
    return {
        "model": spec.get("model", "sim-model"),
        "messages": [
            {"role": "system", "content": words(rng, spec.get("system_words", 100))},
            {"role": "user", "content": words(rng, spec.get("user_words", 50))},
        ],
        "max_tokens": spec.get("max_tokens", 16),
        "stream": bool(spec.get("stream")),
    }


async def _guarded(
    target: Target, s: aiohttp.ClientSession, body: dict[str, Any], conv: str | None, parse: bool
) -> Sample:
    try:
        return await target.send(s, body, conv, parse)
    except (aiohttp.ClientError, TimeoutError, OSError, ValueError) as exc:
        return Sample(error=f"{type(exc).__name__}: {exc}"[:200])


def _session(spec: dict[str, Any], limit: int) -> aiohttp.ClientSession:
    timeout = aiohttp.ClientTimeout(total=spec.get("request_timeout_s", 60.0), connect=5.0)
    connector = aiohttp.TCPConnector(limit=limit, force_close=False)
    return aiohttp.ClientSession(timeout=timeout, connector=connector)


async def closed_loop(spec: dict[str, Any]) -> dict[str, Any]:
    """`concurrency` workers send `count` requests (after `warmup` unrecorded ones)."""
    target = make_target(spec)
    conc = int(spec["concurrency"])
    warmup, count = int(spec.get("warmup", 0)), int(spec["count"])
    total = warmup + count
    pool = [request_body(spec, i) for i in range(min(total, BODY_POOL))]
    samples: list[Sample | None] = [None] * total
    counter = itertools.count()
    deadline = time.monotonic() + float(spec["deadline_s"])

    async def worker(s: aiohttp.ClientSession) -> None:
        while time.monotonic() < deadline:
            i = next(counter)
            if i >= total:
                return
            conv = f"bench-{uuid.uuid4().hex}"  # every request a conversation of its own
            samples[i] = await _guarded(target, s, pool[i % len(pool)], conv, False)

    async with _session(spec, conc + 8) as s:
        t0 = time.perf_counter()
        await _bounded(asyncio.gather(*(worker(s) for _ in range(conc))), deadline)
        wall = time.perf_counter() - t0
    measured = [x for x in samples[warmup:] if x is not None]
    return summarize(measured, wall, sent=sum(x is not None for x in samples))


async def open_loop(spec: dict[str, Any]) -> dict[str, Any]:
    """Requests arrive at `rate` per second for `duration_s`, at most `max_inflight` at once."""
    target = make_target(spec)
    rate, duration = float(spec["rate"]), float(spec["duration_s"])
    cap = int(spec.get("max_inflight", 512))
    n = int(rate * duration)
    pool = [request_body(spec, i) for i in range(min(n, BODY_POOL))]
    samples: list[Sample] = []
    shed = 0
    inflight: set[asyncio.Task[None]] = set()
    deadline = time.monotonic() + duration + float(spec.get("drain_s", 10.0))

    async def one(s: aiohttp.ClientSession, body: dict[str, Any]) -> None:
        samples.append(await _guarded(target, s, body, f"bench-{uuid.uuid4().hex}", False))

    async with _session(spec, cap + 8) as s:
        t0 = time.perf_counter()
        for i in range(n):
            body = pool[i % len(pool)]
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if len(inflight) >= cap:
                shed += 1
                continue
            task = asyncio.create_task(one(s, body))
            inflight.add(task)
            task.add_done_callback(inflight.discard)
        if inflight:
            await _bounded(asyncio.gather(*inflight), deadline)
        wall = time.perf_counter() - t0
    return summarize(samples, wall, sent=n - shed)


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


async def mixed(spec: dict[str, Any]) -> dict[str, Any]:
    """Several `arrivals` jobs at once through the same targets (`groups`: name -> its spec,
    the shared fields of `spec` under each); every turn's record says its `group`."""
    shared = {k: v for k, v in spec.items() if k not in ("kind", "groups")}
    names = list(spec["groups"])
    results = await asyncio.gather(
        *(arrivals({**shared, **spec["groups"][name]}) for name in names)
    )
    turns = [
        {**t, "group": name} for name, r in zip(names, results, strict=True) for t in r["turns"]
    ]
    return {
        "turns": turns,
        "wall_s": max(r["wall_s"] for r in results),
        "conversations": {name: r["conversations"] for name, r in zip(names, results, strict=True)},
    }


# A lognormal's p95 is its median times exp(Z95 sigma).
Z95 = statistics.NormalDist().inv_cdf(0.95)


def think_time(spec: dict[str, Any], rng: random.Random) -> float:
    """The pause before a turn after the first: `think` {"dist": "uniform", "lo", "hi"} or
    {"dist": "lognormal", "median_s", "p95_s"}, else exponential of mean `think_s` (cut at 4
    means; 0: none)."""
    think = spec.get("think")
    if think is None:
        mean = float(spec.get("think_s", 0.0))
        return min(rng.expovariate(1 / mean), 4 * mean) if mean > 0 else 0.0
    if think["dist"] == "uniform":
        return rng.uniform(float(think["lo"]), float(think["hi"]))
    median = float(think["median_s"])
    sigma = math.log(float(think["p95_s"]) / median) / Z95
    return rng.lognormvariate(math.log(median), sigma)


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
    use_ids = spec["target"]["mode"] == "router" and spec.get("conversation_ids", True)
    conv = f"bench-{spec.get('seed', 0)}-{c}-{uuid.uuid4().hex[:8]}" if use_ids else None
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
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "reuse": x.reuse,
        "error": x.error,
        "answer": hashlib.blake2b("".join(x.text).encode(), digest_size=8).hexdigest(),
    }


def summarize(samples: list[Sample], wall: float, sent: int) -> dict[str, Any]:
    """Columns of the successful requests, error counts and X-KV-Reuse outcomes."""
    good = [x for x in samples if x.ok]
    errors = [x.error for x in samples if not x.ok]
    reuse = Counter(x.reuse for x in good if x.reuse)
    return {
        "reuse": dict(reuse),
        "latency": [x.latency for x in good],
        "events": [x.events for x in good],
        "ok": len(good),
        "failed": len(errors),
        "error_examples": errors[:3],
        "sent": sent,
        "wall_s": wall,
    }


KINDS: dict[str, Callable[[dict[str, Any]], Coroutine[Any, Any, dict[str, Any]]]] = {
    "closed": closed_loop,
    "open": open_loop,
    "conversations": conversations,
    "arrivals": arrivals,
    "mixed": mixed,
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
