"""Engine identity: which process an instance is (start time, KV engine id), whether a handle
it made may still be read, and which P instances are paused from reading its handles. Pure:
the health loop and the turn feed it what they saw."""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field

from router.engines.versions import EngineVersion

log = logging.getLogger("kvbaton.backends")

# A P that refused this many of one D's handles in a row gets none of that D's handles for a
# while: each refused handle costs a failed P leg (5 s where P cannot reach D's side channel),
# and some refusals last (a D restarted with a fixed engine id: P keeps its stale NIXL agent).
REFUSALS_TO_PAUSE = 3
PAUSE_FIRST_S = 30.0  # then doubled each time the handle tried after a pause is refused too
PAUSE_MAX_S = 600.0
MAX_RANKS = 64  # side channels pinned per D process: one per data-parallel rank

# vLLM appends `_dp<rank>` to the engine id of each data-parallel engine of one D process.
_DP_SUFFIX = re.compile(r"_dp\d+$")


@functools.lru_cache(maxsize=4096)  # a few ids per engine process: a regex sub saved per call
def engine_family(engine_id: str) -> str:
    """The part of an engine id that all data-parallel ranks of one process share: handles from
    a D with internal data parallelism carry one id per rank, all of the same process."""
    return _DP_SUFFIX.sub("", engine_id)


@dataclass
class Refusals:
    """One P's refusals of one D's handles since its last read from that D."""

    count: int = 0
    pause_s: float = 0.0  # the latest pause (0: none since the last read)
    until: float = 0.0  # monotonic time the pause ends


@dataclass
class EngineIdentity:
    """What the router knows of the process behind one instance URL."""

    label: str = ""  # "<role> instance <url>", for log lines
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
    # A D seen streaming kv_transfer_params (vLLM PR #40186) in a final chunk: from then on it
    # is asked for token ids on streams and its streamed handles are kept. Not kept across a
    # restart (the new process may be another vLLM).
    streams_params: bool = False
    # Its vLLM version from GET /version, read at discovery and again after a restart (the
    # new process may be another vLLM): what it streams, its connector version, its pauses.
    version: EngineVersion = field(default_factory=EngineVersion)
    # The highest remote_registration_generation in its handles (vLLM 0.33): D registered its
    # KV again (it slept) when it rises, and handles of an older one name blocks of the old.
    registration: int = 0
    # The router's clock when it last saw this D asleep with its KV cache discarded (its
    # /metrics' vllm:engine_sleep_state, every --health-interval; 0: never): handles made
    # before name blocks of a registration that is gone, even before a newer generation
    # shows in a handle.
    slept_at: float = 0.0
    asleep: bool = False
    refused_by: dict[str, Refusals] = field(default_factory=dict)  # a D's, by P URL
    # Whether it serves /v1/responses/render (None: not asked yet). vLLM 0.32 and 0.33 answer
    # 403 unless started with --enable-scale-out, older ones 404: learned from the first
    # answer, so that its Responses turns are not asked again; a restart asks again.
    renders: bool | None = None
    # Whether it serves vllm#51919's POST /v1/pd_kv_ready (None: not asked yet): 400 or 422 to an
    # empty body where it does, 404 where the route is unknown (lifecycle/health.py asks with
    # its version). A restart asks again.
    parks: bool | None = None
    # Each rank's side channel (engine id -> host, port), pinned from the first handle that
    # named it: a stored handle may send P only there (turn/aim.py), and a later answer that
    # names another address is refused until the process is seen to restart (a new start
    # time on its /metrics), which forgets them.
    sides: dict[str, tuple[str, int]] = field(default_factory=dict)
    refused_sides: set[tuple[str, str, int]] = field(default_factory=set)  # each warned once

    def owns(self, origin: tuple[str, str, int]) -> bool:
        """Whether that side channel is the one pinned for its rank."""
        engine, host, port = origin
        return self.sides.get(engine) == (host, port)

    def admissible(self, origin: tuple[str, str, int]) -> bool:
        """Whether a handle naming that side channel may be kept: the rank's pinned one, or a
        rank not seen yet beside its siblings (the same engine family, the same host, a port
        no other rank has); the first handle of a process pins the first rank."""
        engine, host, port = origin
        pinned = self.sides.get(engine)
        return pinned == (host, port) if pinned is not None else self._joins(engine, host, port)

    def admit(self, origin: tuple[str, str, int]) -> bool:
        """Pin the side channel if admissible; else say so (once per address) and refuse."""
        if self.admissible(origin):
            self.sides.setdefault(origin[0], origin[1:])
            return True
        if origin not in self.refused_sides and len(self.refused_sides) < MAX_RANKS:
            self.refused_sides.add(origin)  # (the log names no engine id or side channel)
            log.warning(
                "%s answered with a handle naming another side channel than the one it showed "
                "it owns (%d pinned), and it has not restarted: the handle is not kept, and no "
                "P is sent there (kvbaton_decode_moved_handles_total)",
                self.label,
                len(self.sides),
            )
        return False

    def _joins(self, engine: str, host: str, port: int) -> bool:
        if not self.sides:
            return True
        if len(self.sides) >= MAX_RANKS or (host, port) in self.sides.values():
            return False
        family = engine_family(engine)
        return all(engine_family(e) == family and h == host for e, (h, _) in self.sides.items())

    @property
    def streams_handles(self) -> bool:
        """Whether a streamed answer of this D brings its handle: its version says so (0.33),
        or it was seen doing it (a 0.32 with PR #40186)."""
        return self.streams_params or self.version.streams_handles

    def note_version(self, version: str) -> None:
        """Record the version /version answered ("" : it did not answer)."""
        if version == self.version.version:
            return
        if self.version.version and version:
            log.warning("%s now runs vLLM %s (was %s)", self.label, version, self.version.version)
        elif version:
            log.info(
                "%s runs vLLM %s (connector group %s)",
                self.label,
                version,
                EngineVersion(version).group or "unknown",
            )
        self.version = EngineVersion(version)

    def note_registration(self, generation: int) -> None:
        """The registration generation in one of this D's new handles."""
        if generation > self.registration:
            if self.registration:
                log.warning(
                    "%s registered its KV cache again (generation %d, was %d): its older "
                    "handles are not read",
                    self.label,
                    generation,
                    self.registration,
                )
            self.registration = generation

    def registration_changed(self, generation: int, made_at: float = 0.0) -> bool:
        """Whether a handle of that generation (0: it names none, as 0.32's), made at that time
        (router clock), names blocks of an earlier registration: D's handles have shown a
        newer generation since, or D was seen asleep with its KV discarded after it."""
        newer = 0 < generation < self.registration
        return newer or 0 < made_at <= self.slept_at

    def note_sleep(self, kv_discarded: bool, now: float) -> None:
        """The health loop's read of D's sleep gauge (vllm:engine_sleep_state)."""
        if kv_discarded:
            if not self.asleep:
                log.warning(
                    "%s is asleep with its KV cache discarded: handles made before are not read",
                    self.label,
                )
            self.slept_at = now
        self.asleep = kv_discarded

    def _forget_process(self) -> None:
        """A new process: what was learned from the old one is learned again."""
        self.refused_by.clear()
        self.streams_params = False
        self.version = EngineVersion()  # read again by the health loop
        self.registration = 0
        self.sides.clear()  # its side channel may have moved
        self.refused_sides.clear()
        self.renders = None  # it may have been started with other flags
        self.parks = None

    @property
    def handle_started(self) -> float:
        """The process start time to record with a handle this D makes now (0: not known, as
        when the start time on file may be an earlier process's)."""
        return 0.0 if self.started_stale or self.unreachable else self.started

    def note_started(self, started: float) -> None:
        """Record the start time. A later one means the process restarted: a D lost its KV
        blocks and its engine id, so the handles that name it must not reach P. An earlier one
        is ignored: several API server processes behind one port may each answer /metrics."""
        if started <= self.started:
            return
        if self.started:
            self.restarts += 1
            self._forget_process()  # P may read from it again; its version is read again
            if not self.started_stale:  # else the engine id is already the new process's
                self.engine_id = ""  # learned again from its next handle
            log.warning(
                "%s restarted (process start time %.3f, was %.3f): handles made before are "
                "not used",
                self.label,
                started,
                self.started,
            )
        self.started = started
        self.started_stale = False

    def note_engine_id(self, engine_id: str | None) -> None:
        """Record the engine id in a D's new handle. Another one than before (another rank of
        the same process aside) means the process restarted and the health loop has not read
        its new start time yet: until it does, the start time on file is the old process's,
        and a handle made now must not be stamped with it."""
        family = engine_family(engine_id or "")
        if not family or family == self.engine_id:
            return
        if self.engine_id:
            self.started_stale = True
            self._forget_process()
            log.warning(
                "%s has a new engine id (%s, was %s): it restarted; handles made before are "
                "not used",
                self.label,
                family,
                self.engine_id,
            )
        self.engine_id = family

    def note_renders(self, renders: bool, why: str = "") -> None:
        """Its answer to a render request: served, or not (then said once, with why)."""
        if renders is False and self.renders is not False:
            log.warning(
                "%s does not serve /v1/responses/render (%s): Responses turns are verified "
                "there by item digests only (start vLLM with --enable-scale-out)",
                self.label,
                why,
            )
        self.renders = renders

    def note_parks(self, parks: bool) -> None:
        """Its answer to an empty /v1/pd_kv_ready: served (concurrent dispatch) or not."""
        if parks and not self.parks:
            log.info("%s serves /v1/pd_kv_ready: D legs are sent beside P's", self.label)
        self.parks = parks

    def note_streams_params(self) -> None:
        """A streamed answer of this D carried its kv_transfer_params."""
        if not self.streams_params:
            log.info("%s streams its handle (vLLM PR #40186): handles kept", self.label)
        self.streams_params = True

    def note_reachable(self, reachable: bool, why: str = "") -> None:
        if not reachable and not self.unreachable:
            log.warning(
                "%s is unreachable (%s): its handles are not used until it answers", self.label, why
            )
        self.unreachable = not reachable

    def restarted_since(self, made_started: float, made_engine_id: str) -> bool:
        """Whether a handle made by the process with that start time / engine id is from an
        earlier process than this one: its blocks and engine id are gone."""
        if self.started and made_started and self.started != made_started:
            return True
        made_by = engine_family(made_engine_id)
        return bool(self.engine_id and made_by and self.engine_id != made_by)

    def reads_paused(self, prefill: str, now: float) -> bool:
        """Whether this D's handles are kept from that P for now."""
        refusals = self.refused_by.get(prefill)
        return refusals is not None and now < refusals.until

    def paused_for(self, now: float) -> dict[str, float]:
        """The P instances that get none of this D's handles for now: seconds left, by URL."""
        return {
            url: round(r.until - now, 1)
            for url, r in self.refused_by.items()
            if self.reads_paused(url, now)
        }

    def note_read(self, prefill: str) -> None:
        """That P read one of this D's handles."""
        self.refused_by.pop(prefill, None)

    def note_refused(self, prefill: str, now: float) -> None:
        """That P refused one of this D's handles: pause after REFUSALS_TO_PAUSE in a row, and
        again (twice as long) when the handle tried after a pause is refused too."""
        refusals = self.refused_by.setdefault(prefill, Refusals())
        refusals.count += 1
        if refusals.pause_s and now < refusals.until:
            return  # a handle in flight when the pause began: the pause already covers it
        if refusals.count < REFUSALS_TO_PAUSE and not refusals.pause_s:
            return
        refusals.pause_s = min(PAUSE_MAX_S, refusals.pause_s * 2 or PAUSE_FIRST_S)
        refusals.until = now + refusals.pause_s
        log.warning(
            "prefill %s refused %d handles of %s in a row: it gets none for %.0f s (a D "
            "restarted with an engine id fixed in kv_transfer_config stays unreadable to P "
            "until P restarts)",
            prefill,
            refusals.count,
            self.label,
            refusals.pause_s,
        )
