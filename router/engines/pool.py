"""Engine instances by role: health, load, and placement with conversation affinity."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Literal

from router.engines.client import Upstream, UpstreamFailure
from router.errors import Unavailable

log = logging.getLogger("kvbaton.backends")

Role = Literal["prefill", "decode"]

# A P that refused this many of one D's handles in a row gets none of that D's handles for a
# while: each refused handle costs a failed P leg (5 s where P cannot reach D's side channel),
# and some refusals last (a D restarted with a fixed engine id: P keeps its stale NIXL agent).
REFUSALS_TO_PAUSE = 3
PAUSE_FIRST_S = 30.0  # then doubled each time the handle tried after a pause is refused too
PAUSE_MAX_S = 600.0

# A conversation stays on its previous instance unless that one has this many more requests
# in flight than the least loaded one: its prefix cache is worth a little queueing.
AFFINITY_SLACK = 8


@dataclass
class Refusals:
    """One P's refusals of one D's handles since its last read from that D."""

    count: int = 0
    pause_s: float = 0.0  # the latest pause (0: none since the last read)
    until: float = 0.0  # monotonic time the pause ends


@dataclass
class Instance:
    url: str
    role: Role
    healthy: bool = True
    outstanding: int = 0
    failures: int = 0
    block_size: int = 0
    model: str = ""
    draining: bool = False
    last_error: str = ""
    # The KV engine id in this instance's latest handle, without vLLM's data-parallel suffix
    # (engine_family): a restart changes it unless the operator fixed it in kv-transfer-config.
    engine_id: str = ""
    started: float = 0.0  # its process_start_time_seconds (0: not known); a restart changes it
    # A handle showed a new engine id before the health loop read the new start time: `started`
    # is still the previous process's, so handles made meanwhile do not record it.
    started_stale: bool = False
    # The health loop's last read of its /metrics could not connect: the process may be down or
    # restarting. Restarted with an engine id fixed by config, a D is told apart only by its
    # start time, and a P that never read from it would read an old handle's block ids from
    # the new process's memory. Its handles wait for a read that connects.
    unreachable: bool = False
    restarts: int = 0  # restarts seen (a new start time)
    refused_by: dict[str, Refusals] = field(default_factory=dict)  # a D's, by P URL

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining

    def reads_paused(self, prefill: str, now: float) -> bool:
        """Whether this D's handles are kept from that P for now."""
        refusals = self.refused_by.get(prefill)
        return refusals is not None and now < refusals.until

    def note_read(self, prefill: str) -> None:
        """That P read one of this D's handles."""
        self.refused_by.pop(prefill, None)

    def note_refused(self, prefill: str, now: float) -> None:
        """That P refused one of this D's handles: pause after REFUSALS_TO_PAUSE in a row, and
        again (twice as long) when the handle tried after a pause is refused too."""
        refusals = self.refused_by.setdefault(prefill, Refusals())
        refusals.count += 1
        if refusals.count < REFUSALS_TO_PAUSE and not refusals.pause_s:
            return
        refusals.pause_s = min(PAUSE_MAX_S, refusals.pause_s * 2 or PAUSE_FIRST_S)
        refusals.until = now + refusals.pause_s
        log.warning(
            "prefill %s refused %d handles of decode %s in a row: it gets none for %.0f s "
            "(a D restarted with an engine id fixed in kv_transfer_config stays unreadable "
            "to P until P restarts)",
            prefill,
            refusals.count,
            self.url,
            refusals.pause_s,
        )

    @property
    def handle_started(self) -> float:
        """The process start time to record with a handle this D makes now (0: not known, as
        when the start time on file may be an earlier process's)."""
        return 0.0 if self.started_stale or self.unreachable else self.started


@dataclass
class Pool:
    """All instances. Placement never awaits, so it is atomic on the event loop."""

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    unhealthy_after: int = 3
    _by_role: dict[str, list[Instance]] = field(default_factory=dict)
    _next: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_role = {
            "prefill": [Instance(url, "prefill") for url in self.prefill_urls],
            "decode": [Instance(url, "decode") for url in self.decode_urls],
        }
        self._next = {"prefill": 0, "decode": 0}

    def instances(self, role: Role | None = None) -> list[Instance]:
        if role is None:
            return self._by_role["prefill"] + self._by_role["decode"]
        return list(self._by_role[role])

    def add(self, inst: Instance) -> None:
        self._by_role[inst.role].append(inst)

    def remove(self, inst: Instance) -> None:
        self._by_role[inst.role] = [i for i in self._by_role[inst.role] if i is not inst]

    def find(self, role: Role, url: str) -> Instance | None:
        return next((i for i in self._by_role[role] if i.url == url), None)

    def pick(self, role: Role, prefer: str = "", exclude: Collection[str] = ()) -> Instance:
        """The preferred instance if usable and not overloaded, else the least loaded one."""
        candidates = [i for i in self._by_role[role] if i.usable and i.url not in exclude]
        if not candidates:
            raise Unavailable(f"no healthy {role} instance is available")
        least = min(i.outstanding for i in candidates)
        if prefer:
            for inst in candidates:
                if inst.url == prefer and inst.outstanding <= least + AFFINITY_SLACK:
                    return inst
        tied = [i for i in candidates if i.outstanding == least]
        start = self._next[role]
        self._next[role] = start + 1
        return tied[start % len(tied)]

    @contextlib.contextmanager
    def busy(self, inst: Instance) -> Iterator[Instance]:
        inst.outstanding += 1
        try:
            yield inst
        finally:
            inst.outstanding -= 1

    def record_success(self, inst: Instance) -> None:
        inst.failures = 0

    def record_failure(self, inst: Instance, reason: str) -> None:
        inst.failures += 1
        inst.last_error = reason
        if inst.healthy and inst.failures >= self.unhealthy_after:
            inst.healthy = False
            log.warning(
                "ejected %s instance %s after %d failures: %s",
                inst.role,
                inst.url,
                inst.failures,
                reason,
            )


# prometheus_client's process collector, which vLLM's API server exports (measured on 0.32).
_STARTED = re.compile(rb"^process_start_time_seconds (\S+)$", re.MULTILINE)


def process_started(metrics: bytes) -> float:
    """An engine's process start time (Unix seconds) from its /metrics text; 0 if absent."""
    match = _STARTED.search(metrics)
    try:
        return float(match.group(1)) if match else 0.0
    except ValueError:
        return 0.0


def note_started(inst: Instance, started: float) -> None:
    """Record an instance's start time. A later one means the process restarted: a D lost its
    KV blocks and its engine id, so the handles that name it must not reach P. An earlier one
    is ignored: several API server processes behind one port may each answer /metrics."""
    if started <= inst.started:
        return
    if inst.started:
        inst.restarts += 1
        inst.refused_by.clear()  # a new process: P may read from it again
        if not inst.started_stale:  # else the engine id is already the new process's
            inst.engine_id = ""  # learned again from its next handle
        log.warning(
            "%s instance %s restarted (process start time %.3f, was %.3f): "
            "handles made before are not used",
            inst.role,
            inst.url,
            started,
            inst.started,
        )
    inst.started = started
    inst.started_stale = False


# vLLM appends `_dp<rank>` to the engine id of each data-parallel engine of one D process.
_DP_SUFFIX = re.compile(r"_dp\d+$")


def engine_family(engine_id: str) -> str:
    """The part of an engine id that all data-parallel ranks of one process share: handles from
    a D with internal data parallelism carry one id per rank, all of the same process."""
    return _DP_SUFFIX.sub("", engine_id)


def note_engine_id(inst: Instance, engine_id: str | None) -> None:
    """Record the engine id in a D's new handle. Another one than before (another rank of the
    same process aside) means the process restarted and the health loop has not read its new
    start time yet: until it does, the start time on file is the old process's, and a handle
    made now must not be stamped with it (it would read as made before the restart once the
    new time is read)."""
    family = engine_family(engine_id or "")
    if not family or family == inst.engine_id:
        return
    if inst.engine_id:
        inst.started_stale = True
        inst.refused_by.clear()
        log.warning(
            "%s instance %s has a new engine id (%s, was %s): it restarted; "
            "handles made before are not used",
            inst.role,
            inst.url,
            family,
            inst.engine_id,
        )
    inst.engine_id = family


async def read_started(upstream: Upstream, inst: Instance, timeout: float) -> None:
    """Sample the instance's process start time. A read that cannot connect marks it
    unreachable until one connects; other failures change nothing (live traffic and /health
    judge health)."""
    try:
        status, metrics = await upstream.get(inst.url + "/metrics", timeout=timeout)
    except UpstreamFailure as exc:
        if not exc.reached and not inst.unreachable:
            inst.unreachable = True
            log.warning(
                "%s instance %s is unreachable (%s): its handles are not used until it answers",
                inst.role,
                inst.url,
                exc,
            )
        return
    if status == 200:
        note_started(inst, process_started(metrics))
    inst.unreachable = False


async def probe(upstream: Upstream, inst: Instance, timeout: float) -> bool:
    try:
        status, _ = await upstream.get(inst.url + "/health", timeout=timeout)
    except UpstreamFailure as exc:
        inst.last_error = str(exc)
        return False
    return status == 200


async def health_loop(pool: Pool, upstream: Upstream, interval: float) -> None:
    """Every interval: re-admit ejected instances whose /health answers 200 again, and read
    each decode instance's start time so that a restart is seen within one interval."""
    while True:
        await asyncio.sleep(interval)
        await asyncio.gather(*(check(upstream, inst, interval) for inst in pool.instances()))


async def check(upstream: Upstream, inst: Instance, timeout: float) -> None:
    if not inst.healthy and await probe(upstream, inst, timeout=timeout):
        if inst.role == "decode":  # a D back from a restart: no old handle once it is usable
            await read_started(upstream, inst, timeout)
        inst.healthy = True
        inst.failures = 0
        log.info("re-admitted %s instance %s", inst.role, inst.url)
    elif inst.role == "decode" and inst.healthy:
        await read_started(upstream, inst, timeout)
