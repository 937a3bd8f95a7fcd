"""The reliability load test: many concurrent multi-turn conversations through the router, with
faults injected mid-run, every answer checked against a from-scratch reference instance.

Loopback only, bounded in time and count. Counts: requests sent, succeeded, failed, hits,
misses by reason, handles used twice (a side-channel read or free notification naming a
request id that is no longer pinned: `vllm_sim:notify_unknown_total` on every engine) and wrong
answers (the simulator's oracle).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from harness.metrics import metric
from harness.procs import SimProc
from harness.stack import Stack
from harness.stack import start_stack as support_stack

BIDIR = ("--bidirectional", "--kv-recompute-threshold", "0", "--num-blocks", "32768")
CHAT = "/v1/chat/completions"
MODEL = "sim-model"
ROUTER_FLAGS = (
    "--stream-kv-params",
    "--unhealthy-after",
    "3",
    "--health-interval",
    "0.5",
    "--store-retry-after",
    "1",
    # Short enough that the stalled P costs a turn seconds, not minutes (a P leg that times
    # out carrying a handle is redone as a miss on the same P, never with the handle elsewhere).
    "--prefill-timeout",
    "3",
    "--decode-first-byte-timeout",
    "10",
    "--log-level",
    "warning",
)
# Engine counters summed over every P and D, before and after the run.
ENGINE_COUNTERS = {
    "used_twice": "vllm_sim:notify_unknown_total",
    "failed_transfers": "vllm:nixl_num_failed_transfers_total",
    "failed_notifications": "vllm:nixl_num_failed_notifications_total",
    "reads_declined": "vllm_sim:reads_declined_total",
    "kv_pulled_tokens": "vllm:external_prefix_cache_hits_total",
}


@dataclass(frozen=True)
class Plan:
    conversations: int = 200
    turns: int = 5
    concurrency: int = 200
    max_tokens: int = 12
    faults: bool = True
    time_limit: float = 300.0
    request_timeout: float = 60.0


@dataclass
class Result:
    plan: Plan
    sent: int = 0
    succeeded: int = 0
    failed: int = 0
    wrong: int = 0
    reuse: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    engine: dict[str, float] = field(default_factory=dict)
    latencies: list[float] = field(default_factory=list)
    faults: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    complete: bool = True
    disconnects: int = 0  # turns whose client hung up after the first chunk (then asked again)
    cut: int = 0  # streams cut mid-way by the killed D: no path (their 200 was sent)
    killed_at: float = 0.0
    # Failed KV transfers up to the D's kill (all of them where none was killed). After it a
    # read naming the killed D can fail: one in flight at the kill, or one the router sent
    # before its health check saw the new process (another engine id); P then recomputes.
    failed_before_kill: int = 0

    @property
    def hits(self) -> int:
        return self.reuse["hit"]

    @property
    def used_twice(self) -> int:
        return int(self.engine.get("used_twice", 0))

    def percentile(self, q: float) -> float:
        if not self.latencies:
            return 0.0
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def rows(self) -> list[tuple[str, str]]:
        p = self.plan
        rows = [
            ("conversations x turns", f"{p.conversations} x {p.turns}"),
            ("concurrent conversations", str(p.concurrency)),
            ("requests sent", str(self.sent)),
            ("succeeded", str(self.succeeded)),
            ("failed where a path existed", str(self.failed)),
            ("streams cut by the killed D (no path: 200 sent)", str(self.cut)),
            ("client disconnects (the turn asked again)", str(self.disconnects)),
            ("hits", str(self.hits)),
        ]
        for verdict, count in sorted(self.reuse.items()):
            if verdict != "hit":
                rows.append((f"  {verdict}", str(count)))
        for reason, count in sorted(self.failures.items()):
            rows.append((f"  failed: {reason}", str(count)))
        rows += [
            ("handles used twice", str(self.used_twice)),
            ("wrong answers (oracle)", str(self.wrong)),
            ("failed KV transfers", str(int(self.engine.get("failed_transfers", 0)))),
            ("  before the D was killed", str(self.failed_before_kill)),
            ("failed KV notifications", str(int(self.engine.get("failed_notifications", 0)))),
            ("tokens pulled over KV", str(int(self.engine.get("kv_pulled_tokens", 0)))),
            ("faults injected", "; ".join(self.faults) or "none"),
            ("latency p50 / p99 (s)", f"{self.percentile(0.5):.3f} / {self.percentile(0.99):.3f}"),
            ("wall time (s)", f"{self.wall_s:.1f}"),
            ("turns per second", f"{self.sent / self.wall_s:.1f}" if self.wall_s else "-"),
            ("finished within the time limit", "yes" if self.complete else "NO"),
        ]
        return rows

    def table(self) -> str:
        rows = self.rows()
        width = max(len(name) for name, _ in rows)
        lines = [f"{'kvbaton load test':<{width}}  result", f"{'-' * width}  {'-' * 6}"]
        lines += [f"{name:<{width}}  {value}" for name, value in rows]
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        return {
            "plan": self.plan.__dict__,
            "sent": self.sent,
            "succeeded": self.succeeded,
            "failed": self.failed,
            "hits": self.hits,
            "wrong": self.wrong,
            "used_twice": self.used_twice,
            "reuse": dict(self.reuse),
            "failures": dict(self.failures),
            "engine": self.engine,
            "failed_transfers_before_kill": self.failed_before_kill,
            "faults": self.faults,
            "latency_p50_s": self.percentile(0.5),
            "latency_p99_s": self.percentile(0.99),
            "wall_s": self.wall_s,
            "complete": self.complete,
        }


@contextlib.contextmanager
def start_stack(name: str = "load") -> Iterator[Stack]:
    """Redis, 2 P, 2 D (bidirectional, handles in the final SSE chunk), a reference, the router."""
    with support_stack(
        prefill=[BIDIR] * 2,
        decode=[(*BIDIR, "--stream-kv-params")] * 2,
        reference=("--num-blocks", "32768"),
        routers=[ROUTER_FLAGS],
        name=name,
        router_timeout=60,
        router_attempts=2,
    ) as stack:
        yield stack


def counters(engines: list[SimProc]) -> dict[str, float]:
    return {key: sum(metric(e.url, name) for e in engines) for key, name in ENGINE_COUNTERS.items()}


def engine_counters(stack: Stack) -> dict[str, float]:
    return counters(stack.engines)


async def arm(engine: SimProc, **faults: int) -> None:
    async with aiohttp.ClientSession() as s, s.post(engine.url + "/sim/faults", json=faults):
        pass


async def ready_again(stack: Stack, engine: SimProc) -> bool:
    """Its armed faults are used up and the router routes to it again (re-admitted)."""
    async with aiohttp.ClientSession() as s:
        async with s.get(engine.url + "/sim/faults") as resp:
            armed = await resp.json()
            if armed["fail_next"] or armed["stall_next"]:
                return False
        async with s.get(stack.router.url + "/status") as resp:
            status = await resp.json()
    listed = status["instances"]["prefill"] + status["instances"]["decode"]
    return any(i["url"] == engine.url and i["usable"] for i in listed)


async def arm_after(stack: Stack, done: SimProc, engine: SimProc, **faults: int) -> None:
    """Arm `engine` once `done` is past its own faults: with both instances of a role
    failing at once a turn has nowhere left to go (the router answers 502)."""
    for _ in range(200):
        if await ready_again(stack, done):
            break
        await asyncio.sleep(0.05)
    await arm(engine, **faults)


def _resume(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGCONT)


async def hang(proc: subprocess.Popen[bytes], seconds: float) -> None:
    """SIGSTOP: the process keeps its sockets and answers nothing; SIGCONT after `seconds`.
    The turns in flight run into the hang; those that would start wait for its end (as for
    the other faults), so on a slow machine the hang does not swallow the whole run."""
    proc.send_signal(signal.SIGSTOP)
    try:
        await asyncio.sleep(seconds)
    finally:
        _resume(proc)


async def kill_and_restart(stack: Stack, dead: dict[str, float], index: int) -> None:
    """Kill D `index` and start a new process on its ports; its counters are kept in `dead`
    (they die with it), with the time it was killed and every engine's failed transfers
    then (`transfers_failed_at_kill`)."""
    at_kill = await asyncio.to_thread(engine_counters, stack)
    dead["transfers_failed_at_kill"] = at_kill["failed_transfers"]
    lost = await asyncio.to_thread(counters, [stack.ds[index]])
    for key, value in lost.items():
        dead[key] = dead.get(key, 0.0) + value
    dead["killed_at"] = time.monotonic()
    await asyncio.to_thread(stack.restart, "decode", index)


def fault_schedule(
    stack: Stack, dead: dict[str, float]
) -> list[tuple[float, str, Callable[[], Awaitable[None]]]]:
    """(fraction of turns started, label, action): each fault leaves another path open.
    `dead` gets the killed engine's counters and the time it was killed."""
    p1, p2 = stack.ps
    d1, d2 = stack.ds
    assert stack.redis_proc is not None
    redis_proc = stack.redis_proc
    return [
        (0.10, "P1 3x HTTP 503", lambda: arm(p1, fail_next=3, status=503)),
        (
            0.15,
            "P2 2x HTTP 500 (handle rejected)",
            lambda: arm_after(stack, p1, p2, fail_next=2, status=500),
        ),
        # The last P fault: a stalled request is retried on P2 only after --prefill-timeout
        # (3 s), and P2 must not be failing then (no fault tells when a stall is over).
        (
            0.25,
            "P1 stalls its next 2 requests 4 s (past --prefill-timeout)",
            lambda: arm_after(stack, p2, p1, stall_s=4, stall_next=2),
        ),
        (0.30, "Redis hung 2 s (SIGSTOP)", lambda: hang(redis_proc, 2.0)),
        (0.45, "D2 hung 1.5 s (SIGSTOP)", lambda: hang(d2.proc, 1.5)),
        (0.50, "D1 2x HTTP 503 before the first byte", lambda: arm(d1, fail_next=2, status=503)),
        (0.60, "Redis stopped", lambda: asyncio.to_thread(stack.stop_redis)),
        (0.70, "Redis restarted (empty) on its port", lambda: asyncio.to_thread(stack.start_redis)),
        (0.78, "D1 killed and restarted on its ports", lambda: kill_and_restart(stack, dead, 0)),
        (
            0.85,
            "D2 2x HTTP 503 before the first byte",
            lambda: arm_after(stack, stack.ds[0], d2, fail_next=2, status=503),
        ),
    ]


def _answer(raw: bytes, stream: bool) -> tuple[str, bool]:
    """(text, error event seen) of a chat reply."""
    if not stream:
        body = json.loads(raw)
        return body["choices"][0]["message"]["content"] or "", False
    text, error = [], False
    for line in raw.split(b"\n"):
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        chunk = json.loads(line[6:])
        if "error" in chunk:
            error = True
        for choice in chunk.get("choices") or []:
            text.append((choice.get("delta") or {}).get("content") or "")
    return "".join(text), error


def _error_message(raw: bytes) -> str:
    """An OpenAI-format error's message (what a failure was), else the body's start."""
    try:
        return str(json.loads(raw)["error"]["message"])[:160]
    except (ValueError, KeyError, TypeError):
        return repr(raw[:160])


class Runner:
    def __init__(self, stack: Stack, plan: Plan, session: aiohttp.ClientSession) -> None:
        self.stack = stack
        self.plan = plan
        self.session = session
        self.result = Result(plan)
        self.gate = asyncio.Semaphore(plan.concurrency)
        self.total = plan.conversations * plan.turns
        self.started = 0
        self.dead: dict[str, float] = {}
        self.schedule = fault_schedule(stack, self.dead) if plan.faults else []
        self.fault_lock = asyncio.Lock()

    async def reference(self, messages: list[dict[str, str]]) -> str:
        body = {"model": MODEL, "messages": messages, "max_tokens": self.plan.max_tokens}
        async with self.session.post(self.stack.ref.url + CHAT, json=body) as resp:
            data = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"reference answered {resp.status}: {data[:200]!r}")
        return _answer(data, False)[0]

    async def turn(self, cid: str, messages: list[dict[str, str]], stream: bool) -> str | None:
        """One turn through the router; the answer, or None when the request failed."""
        r = self.result
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": self.plan.max_tokens,
            "stream": stream,
            "conversation_id": cid,
        }
        r.sent += 1
        begun = 100 * self.started // self.total  # the run's progress (the faults' scale)
        started = time.monotonic()
        try:
            async with self.session.post(self.stack.router.url + CHAT, json=body) as resp:
                raw = await resp.read()
                status, reuse = resp.status, resp.headers.get("X-KV-Reuse", "-")
        except (aiohttp.ClientError, TimeoutError) as exc:
            r.failed += 1
            r.failures[type(exc).__name__] += 1
            return None
        r.latencies.append(time.monotonic() - started)
        r.reuse[reuse] += 1
        if status != 200:
            r.failed += 1
            r.failures[f"HTTP {status}: {_error_message(raw)} (started @{begun}%)"] += 1
            return None
        text, error = _answer(raw, stream)
        if error:
            if started < self.dead.get("killed_at", float("inf")):
                r.cut += 1  # in flight on the D that was killed: its 200 was sent, no path
            else:
                r.failed += 1
                r.failures["SSE error event"] += 1
            return None
        r.succeeded += 1
        if text != await self.reference(messages):
            r.wrong += 1
        return text

    async def conversation(self, index: int) -> None:
        cid = f"load-{index}-{uuid.uuid4().hex[:8]}"
        nonce = uuid.uuid4().hex[:10]
        messages = [{"role": "system", "content": f"Conversation {index} ({nonce})."}]
        async with self.gate:
            for turn in range(1, self.plan.turns + 1):
                messages.append({"role": "user", "content": f"Turn {turn}: tea or rain?"})
                await self.before_turn()
                if self.started % 20 == 0:
                    await self.hang_up(cid, messages)
                answer = await self.turn(cid, messages, stream=turn % 2 == 0)
                if answer is None:
                    messages.pop()  # the client asks the next question instead
                else:
                    messages.append({"role": "assistant", "content": answer})

    async def hang_up(self, cid: str, messages: list[dict[str, str]]) -> None:
        """A client that leaves after the first chunk of a streamed answer; it asks again."""
        body = {
            "model": MODEL,
            "messages": messages,
            "max_tokens": self.plan.max_tokens,
            "stream": True,
            "conversation_id": cid,
        }
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self.session.post(self.stack.router.url + CHAT, json=body) as resp:
                await resp.content.readany()
                resp.close()
        self.result.disconnects += 1

    async def before_turn(self) -> None:
        """Count the turn; first apply the faults due at this point of the run (turns that
        would start meanwhile wait, those in flight run into the fault)."""
        async with self.fault_lock:
            self.started += 1
            while self.schedule and self.started > self.schedule[0][0] * self.total:
                fraction, label, action = self.schedule.pop(0)
                await action()
                self.result.faults.append(f"{label} @{int(fraction * 100)}%")

    async def run(self) -> Result:
        talks = [self.conversation(i) for i in range(self.plan.conversations)]
        try:
            await asyncio.wait_for(asyncio.gather(*talks), self.plan.time_limit)
        except TimeoutError:
            self.result.complete = False
        return self.result


async def run_plan(stack: Stack, plan: Plan) -> Result:
    before = engine_counters(stack)
    timeout = aiohttp.ClientTimeout(total=plan.request_timeout)
    connector = aiohttp.TCPConnector(limit=2 * plan.concurrency + 10)
    started = time.monotonic()
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        runner = Runner(stack, plan, session)
        result = await runner.run()
    result.wall_s = time.monotonic() - started
    after = engine_counters(stack)
    dead = runner.dead
    result.engine = {key: after[key] - before[key] + dead.get(key, 0.0) for key in after}
    result.failed_before_kill = failed_before_kill(before, result.engine, dead)
    return result


def failed_before_kill(
    before: dict[str, float], run: dict[str, float], dead: dict[str, float]
) -> int:
    """Failed KV transfers up to the D's kill: every engine's then, less the run's start; with
    no kill, the run's (`run`: its counters, the killed D's included)."""
    at_kill = dead.get("transfers_failed_at_kill")
    if at_kill is None:
        return int(run["failed_transfers"])
    return int(at_kill - before["failed_transfers"])


def run(plan: Plan, name: str = "load") -> Result:
    """Start a private stack, run the plan against it, stop everything."""
    with start_stack(name) as stack:
        return asyncio.run(run_plan(stack, plan))
