"""Releasing D's pinned blocks: a handle nobody will read goes to a P in a request that reads
nothing, so P notifies D and D frees the blocks (vLLM's read-nothing path) long before
`decoder_kv_blocks_ttl`; and P's params no D will read go to a D the same way, so P frees
its leased blocks at once. Only through an engine that can talk to the holder (its connector
group, model and block size). Queued, rate limited, never in a turn's way."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from router.engines.client import EngineClient
from router.engines.pool import Pool, Role
from router.engines.spent import Spent
from router.errors import Unavailable, UpstreamFailure

log = logging.getLogger("kvbaton.pins")

# What the connector makes of a handle to release: P's body and path (None: nothing to do).
ReleaseRequest = Callable[[Mapping[str, Any], str], tuple[dict[str, Any], str] | None]
# Counts one release: (reason, outcome) with outcome "released", "failed" or "dropped".
# ("waiting", a job's outcome while no engine that can talk to its holder is usable, is not
# counted: the job is tried again every RETRY_S until it is sent or gives up, then dropped.)
Counted = Callable[[str, str], None]

MIN_SAMPLES = 20  # gaps between turns measured before their p95 is used

# Releases in flight at once, and queued before the oldest are dropped (D's TTL frees them).
MAX_INFLIGHT = 4
MAX_QUEUED = 4096
RETRY_S = 1.0  # how often jobs that wait for an engine of their holder's group are tried
# How long such a job waits at most (--handle-ttl: D frees the blocks at its own TTL soon after).
DEFAULT_KEEP_FOR_S = 450.0


@dataclass
class Gaps:
    """The time between a conversation's turns, as this process measured it (the last 1,024):
    their p95 is the cadence a pressured D's release order assumes for a conversation of one
    turn (lifecycle/release_order.py)."""

    samples: deque[float] = field(default_factory=lambda: deque(maxlen=1024))

    def note(self, seconds: float) -> None:
        if seconds >= 0:
            self.samples.append(seconds)

    def p95(self) -> float | None:
        if len(self.samples) < MIN_SAMPLES:
            return None
        ordered = sorted(self.samples)
        return ordered[int(0.95 * (len(ordered) - 1))]


@dataclass(frozen=True)
class Job:
    handle: Mapping[str, Any]
    decode: str  # the D that pins it (its base URL); for P's params, the P that leases them
    reason: str  # why nobody will read it: superseded, ended, idle, pressure, unread
    via: Role = "prefill"  # who reads nothing of it: a P for D's handles, a D for P's params
    until: float = 0.0  # the clock time a job that waits for a reader gives up (0: not waiting)

    @property
    def holder_role(self) -> Role:
        """The role of the engine whose blocks it frees (`decode`, the field, is its URL)."""
        return "decode" if self.via == "prefill" else "prefill"


@dataclass
class Releaser:
    """Sends P the read-nothing requests, at most MAX_INFLIGHT at a time; a job with no usable
    reader that can talk to its holder waits (`waiting`, tried every RETRY_S) for one, up to
    `keep_for` seconds."""

    pool: Pool
    engines: EngineClient
    request: ReleaseRequest
    model: Callable[[], str]
    counted: Counted
    timeout: float = 10.0
    # The D request that frees P's leased blocks (None: the connector leases nothing for D).
    prefilled_request: ReleaseRequest | None = None
    clock: Callable[[], float] = time.monotonic
    keep_for: float = DEFAULT_KEEP_FOR_S
    # Where each released handle is remembered as spent (None: nowhere; a state naming it
    # again is then caught by the store's spent keys alone).
    spent: Spent | None = None
    queue: asyncio.Queue[Job] = field(default_factory=lambda: asyncio.Queue(MAX_QUEUED))
    waiting: deque[Job] = field(default_factory=deque)
    released: int = 0
    failed: int = 0
    dropped: int = 0
    _workers: list[asyncio.Task[None]] = field(default_factory=list)

    def submit(self, handle: Mapping[str, Any] | None, decode: str, reason: str) -> None:
        """Queue a release; never waits (a full queue drops the oldest: D's TTL frees it).
        The handle is spent from now on, whether or not its release goes out."""
        if handle is None:
            return
        if self.spent is not None:
            self.spent.add(handle)
        if self.queue.full():
            with contextlib.suppress(asyncio.QueueEmpty):
                old = self.queue.get_nowait()
                self.queue.task_done()
                self._count(old.reason, "dropped")
        self.queue.put_nowait(Job(handle, decode, reason))

    def submit_prefilled(self, params: Mapping[str, Any] | None, prefill: str) -> None:
        """Queue the release of P's params that no D will read (D refused the turn)."""
        if params is None or self.prefilled_request is None:
            return
        if self.queue.full():
            return  # P's lease (kv_lease_duration) frees them
        self.queue.put_nowait(Job(params, prefill, "unread", via="decode"))

    def start(self) -> None:
        self._workers = [asyncio.create_task(self._work()) for _ in range(MAX_INFLIGHT)]
        self._workers.append(asyncio.create_task(self._retry_loop()))

    async def stop(self) -> None:
        for task in self._workers:
            task.cancel()
        for task in self._workers:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._workers = []

    async def drain(self) -> None:
        """Wait until every queued release is done or waiting (tests, shutdown)."""
        await self.queue.join()

    def retry(self) -> None:
        """The jobs that wait for a reader go back to the queue, as far as it has room."""
        while self.waiting and not self.queue.full():
            self.queue.put_nowait(self.waiting.popleft())

    async def _retry_loop(self) -> None:
        while True:
            await asyncio.sleep(RETRY_S)
            self.retry()

    async def _work(self) -> None:
        while True:
            job = await self.queue.get()
            try:
                outcome = await self.release(job)
            except Exception as exc:  # a release must never take the worker down
                log.warning("releasing a handle on %s failed: %s", job.decode, exc)
                outcome = "failed"
            finally:
                self.queue.task_done()
            if outcome != "waiting":
                self._count(job.reason, outcome)

    async def release(self, job: Job) -> str:
        """One read-nothing request to the least loaded usable P (a D for P's params) that can
        talk to the holder (Pool.pick_peer): "released" or "failed"; "dropped" when there is
        nothing to release or the holder left the pool; "waiting" when no such reader is
        usable now (the job waits in `waiting`, never sent elsewhere: a P of another connector
        group cannot notify D, vLLM logs "KV free notification failed" and the pin stays)."""
        holder = self.pool.find(job.holder_role, job.decode)
        if holder is None:  # removed: its blocks went with it, or its own TTL frees them
            log.info("not releasing a handle on %s: no longer in the pool", job.decode)
            return "dropped"
        request = self.request if job.via == "prefill" else self.prefilled_request
        made = request(job.handle, holder.model or self.model()) if request is not None else None
        if made is None:
            return "dropped"
        body, path = made
        try:
            inst = self.pool.pick_peer(job.via, holder)
        except Unavailable as exc:
            return self._wait(job, str(exc))
        try:
            with self.pool.busy(inst):
                status, raw = await self.engines.post_json(
                    inst.url + path,
                    body,
                    request_id=f"kvbaton-release-{uuid.uuid4().hex}",
                    timeout=self.timeout,
                )
        except UpstreamFailure as exc:
            log.warning("release of a handle on %s via %s failed: %s", job.decode, inst.url, exc)
            return "failed"
        if status != 200:
            log.warning(
                "release of a handle on %s via %s: HTTP %d %.200r",
                job.decode,
                inst.url,
                status,
                raw,
            )
            return "failed"
        log.debug("released a handle on %s via %s (%s)", job.decode, inst.url, job.reason)
        if job.via == "decode":  # a bidirectional D pinned its one block of that request
            self.submit(_handle_of(raw), inst.url, "superseded")
        return "released"

    def _wait(self, job: Job, why: str) -> str:
        """Keep a job with no usable reader for a later try, until it gives up ("dropped")."""
        now = self.clock()
        if not job.until:
            log.info("release of a handle on %s waits: %s", job.decode, why)
        elif now >= job.until:
            log.warning(
                "gave up releasing a handle on %s after %.0f s: %s", job.decode, self.keep_for, why
            )
            return "dropped"
        if len(self.waiting) >= MAX_QUEUED:
            self._count(self.waiting.popleft().reason, "dropped")
        self.waiting.append(dataclasses.replace(job, until=job.until or now + self.keep_for))
        return "waiting"

    def _count(self, reason: str, outcome: str) -> None:
        if outcome == "released":
            self.released += 1
        elif outcome == "failed":
            self.failed += 1
        else:
            self.dropped += 1
        self.counted(reason, outcome)

    def view(self) -> dict[str, Any]:
        return {
            "queued": self.queue.qsize(),
            "waiting": len(self.waiting),
            "released": self.released,
            "failed": self.failed,
            "dropped": self.dropped,
        }


def _handle_of(raw: bytes) -> Mapping[str, Any] | None:
    """D's own handle in its answer, if any."""
    try:
        params = msgspec.json.decode(raw).get("kv_transfer_params")
    except (msgspec.DecodeError, AttributeError):
        return None
    return params if isinstance(params, dict) else None
