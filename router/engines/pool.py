"""Engine instances by role and placement: health flags, load, and conversation affinity.
Pure: placement never awaits, so it is atomic on the event loop."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from typing import Literal

from router.engines.identity import EngineIdentity
from router.engines.reads import Reads
from router.errors import Unavailable

log = logging.getLogger("kvbaton.backends")

Role = Literal["prefill", "decode"]

# A conversation stays on its previous instance unless that one has this many more requests
# in flight than the least loaded one: its prefix cache is worth a little queueing.
AFFINITY_SLACK = 8


@dataclass
class Instance:
    url: str
    role: Role
    healthy: bool = True
    outstanding: int = 0
    # Requests the engine itself runs or queues, every router's, from the health loop's last
    # read of a D's /metrics (every --health-interval): a hint, beside `outstanding`.
    engine_requests: int = 0
    failures: int = 0
    block_size: int = 0
    model: str = ""
    max_model_len: int = 0
    draining: bool = False
    last_error: str = ""
    ident: EngineIdentity = field(default_factory=EngineIdentity)
    reads: Reads = field(default_factory=Reads)  # a P's reads from D, learned (reads.py)
    next_rank: int = 0  # the data-parallel rank the next new conversation gets (ranks.py)
    dp_size: int = 0  # data-parallel ranks its /metrics shows (0: not read; ranks.py)
    # A D's KV-cache usage (0-1) as of the health loop's last read (-1: unknown), and whether
    # it is above the pin high-water mark (until it falls below the low-water mark).
    kv_usage: float = -1.0
    pressured: bool = False
    pins: int = -1  # handles on this D in the store's pin index, as of the last sweep
    pinned_blocks: int = -1  # D's distinct blocks they pin (a block shared by several: once)
    pinned_handle_blocks: int = -1  # their blocks summed, handle by handle
    pinned_tokens: int = -1  # their tokens summed
    high_water: float = 0.9
    low_water: float = 0.75

    def __post_init__(self) -> None:
        self.ident.label = f"{self.role} instance {self.url}"

    def note_kv_usage(self, usage: float | None) -> None:
        """A new reading of D's KV usage; the pressure flag keeps its hysteresis."""
        if usage is None:
            return
        self.kv_usage = usage
        if usage >= self.high_water:
            self.pressured = True
        elif usage < self.low_water:
            self.pressured = False

    @property
    def usable(self) -> bool:
        return self.healthy and not self.draining

    @property
    def load(self) -> int:
        """Requests in flight: this router's, or the engine's own count (every router's, as
        of the last health read) when that is higher."""
        return max(self.outstanding, self.engine_requests)


@dataclass
class Pool:
    """All instances. Placement never awaits, so it is atomic on the event loop."""

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    unhealthy_after: int = 3
    high_water: float = 0.9  # --pin-high-water and --pin-low-water, for every instance
    low_water: float = 0.75
    _by_role: dict[str, list[Instance]] = field(default_factory=dict)
    _next: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._by_role = {
            "prefill": [Instance(url, "prefill") for url in self.prefill_urls],
            "decode": [Instance(url, "decode") for url in self.decode_urls],
        }
        self._next = {"prefill": 0, "decode": 0}
        for inst in self.instances():
            inst.high_water, inst.low_water = self.high_water, self.low_water

    def instances(self, role: Role | None = None) -> list[Instance]:
        if role is None:
            return self._by_role["prefill"] + self._by_role["decode"]
        return list(self._by_role[role])

    def add(self, inst: Instance) -> None:
        inst.high_water, inst.low_water = self.high_water, self.low_water
        self._by_role[inst.role].append(inst)

    def remove(self, inst: Instance) -> None:
        self._by_role[inst.role] = [i for i in self._by_role[inst.role] if i is not inst]

    def find(self, role: Role, url: str) -> Instance | None:
        return next((i for i in self._by_role[role] if i.url == url), None)

    def pick(
        self,
        role: Role,
        prefer: str = "",
        exclude: Collection[str] = (),
        peer: Instance | None = None,
    ) -> Instance:
        """The preferred instance if usable and not overloaded, else the least loaded one;
        one that can move KV with `peer` (same connector group) if given, and a P that has a
        D it can pair with while there is one."""
        candidates = [i for i in self._by_role[role] if i.usable and i.url not in exclude]
        if not candidates:
            raise Unavailable(f"no healthy {role} instance is available")
        if peer is not None:
            candidates = [i for i in candidates if i.ident.version.pairs_with(peer.ident.version)]
            if not candidates:
                raise Unavailable(
                    f"no healthy {role} instance can move KV with {peer.role} {peer.url} "
                    f"(vLLM {peer.ident.version.version}, {peer.ident.version.group})"
                )
        elif role == "prefill":
            candidates = self._paired(candidates)
        # A D whose KV is nearly all pinned would make the turn wait for blocks: another D
        # with headroom takes it (affinity included) while there is one.
        if any(i.pressured for i in candidates):
            candidates = [i for i in candidates if not i.pressured] or candidates
        least = min(i.outstanding for i in candidates)
        if prefer:
            for inst in candidates:
                if inst.url == prefer and inst.outstanding <= least + AFFINITY_SLACK:
                    return inst
        tied = [i for i in candidates if i.outstanding == least]
        start = self._next[role]
        self._next[role] = start + 1
        return tied[start % len(tied)]

    def pick_peer(self, role: Role, holder: Instance) -> Instance:
        """The least loaded usable instance of `role` that can move KV with `holder`: the same
        connector group, and the same model and block size where both are known (a release
        through any other fails at the handshake, and the pin stays). Unavailable if none."""
        unlike = [i.url for i in self._by_role[role] if not _alike(i, holder)]
        return self.pick(role, exclude=unlike, peer=holder)

    def _paired(self, prefills: list[Instance]) -> list[Instance]:
        """The P's with a usable D of their connector group (all of them if none has one: the
        turn then fails on its D, as without versions)."""
        groups = {d.ident.version.group for d in self._by_role["decode"] if d.usable}
        if "" in groups:
            return prefills  # a D of unknown version pairs with any P
        paired = [
            p for p in prefills if not p.ident.version.group or p.ident.version.group in groups
        ]
        return paired or prefills

    def groups(self) -> dict[str, dict[str, list[str]]]:
        """The connector groups and their instances by role ("unknown": version not read)."""
        out: dict[str, dict[str, list[str]]] = {}
        for inst in self.instances():
            group = out.setdefault(
                inst.ident.version.group or "unknown", {"prefill": [], "decode": []}
            )
            group[inst.role].append(inst.url)
        return out

    @contextlib.contextmanager
    def busy(self, inst: Instance) -> Iterator[Instance]:
        inst.outstanding += 1
        try:
            yield inst
        finally:
            inst.outstanding -= 1

    def record_success(self, inst: Instance) -> None:
        inst.failures = 0

    def record_failure(self, inst: Instance, reason: str, *, stalled: bool = False) -> None:
        """One more failure; `unhealthy_after` in a row eject the instance, and so does one
        stall at once (an engine that stops sending mid-answer holds every turn on it)."""
        inst.failures += 1
        if stalled:
            inst.failures = max(inst.failures, self.unhealthy_after)
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


def _alike(a: Instance, b: Instance) -> bool:
    """The same model and KV block size, where both are known (0 or "": not read yet)."""
    same_model = not a.model or not b.model or a.model == b.model
    return same_model and (not a.block_size or not b.block_size or a.block_size == b.block_size)
