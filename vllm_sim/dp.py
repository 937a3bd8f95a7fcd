"""Data parallelism inside one instance (`--data-parallel-size N`), as vLLM's internal DP runs
it: N engines behind one API server, each with its own block pool and prefix cache, its own
engine id `<id>_dp<rank>` and its own side-channel port (`--kv-port` + rank, as vLLM's
VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_index). A request goes to the rank its
`X-data-parallel-rank` header names, else round robin (vLLM's internal load balancer)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncGenerator, Sequence

import msgspec
from aiohttp import web

from vllm_sim import handover
from vllm_sim.config import SimSettings
from vllm_sim.costs import spend
from vllm_sim.engine import Engine
from vllm_sim.errors import ApiError
from vllm_sim.metrics import Counters, Gauges
from vllm_sim.pause import Pause
from vllm_sim.request import GenRequest, RunResult, Step

HEADER = "X-data-parallel-rank"


def rank_settings(settings: SimSettings, rank: int) -> SimSettings:
    """One rank's settings: the `_dp<rank>` engine id and its side-channel port."""
    if settings.data_parallel_size <= 1:
        return settings
    port = settings.kv_port + rank if settings.kv_port else 0
    return msgspec.structs.replace(
        settings, engine_id=f"{settings.engine_id}_dp{rank}", kv_port=port
    )


def header_rank(request: web.Request, size: int) -> int | None:
    """The rank the request asks for (None: any); a 400 for one this instance does not run."""
    raw = request.headers.get(HEADER)
    if raw is None:
        return None
    try:
        rank = int(raw)
    except ValueError:
        raise ApiError(f"{HEADER} must be an integer, not {raw!r}") from None
    if not 0 <= rank < size:
        raise ApiError(f"{HEADER} {rank} is out of range: data parallel size is {size}")
    return rank


class Ranks:
    """The engines of one instance; what the routes generate with."""

    def __init__(self, engines: Sequence[Engine]) -> None:
        self.engines = list(engines)
        self.settings = engines[0].settings
        self.tok = engines[0].tok
        self.pause = Pause()  # /pause and /sleep hold every rank (vllm_sim/pause.py)
        s = self.settings  # requests parked until /v1/pd_kv_ready (vllm#51919)
        self.parking = handover.Parking(s.pd_park_timeout) if s.pd_kv_ready else None
        self._next = 0

    @property
    def size(self) -> int:
        return len(self.engines)

    def pick(self, rank: int | None) -> Engine:
        if rank is None:
            rank = self._next % len(self.engines)
            self._next += 1
        return self.engines[rank]

    def generate(self, req: GenRequest, result: RunResult) -> AsyncGenerator[Step, None]:
        """The request's steps; EnginePaused on the first one while paused (abort or wait).
        Admission (`--admission-ms`) and parking (vllm#51919) come before the engine's."""
        parks = self.parking is not None and handover.is_parked_leg(req.kv_params)
        if self.pause.open and not parks and self.settings.admission_ms <= 0:
            return self.pick(req.dp_rank).generate(req, result)
        return self._held(req, result, parks)

    async def _held(
        self, req: GenRequest, result: RunResult, parks: bool = False
    ) -> AsyncGenerator[Step, None]:
        await self.pause.admit()
        engine = self.pick(req.dp_rank)
        await spend(self.settings.admission_ms / 1000.0)  # parse, tokenize, admit
        if parks and self.parking is not None:
            engine.counters.sim_parked_requests += 1
            params = await self.parking.wait(req.base_id)
            if params is None:  # the notification never came: D prefills locally
                engine.counters.sim_park_timeouts += 1
                params = handover.local_params(req.kv_params or {})
            req.kv_params = params
        steps = engine.generate(req, result)
        async with contextlib.aclosing(steps):
            async for step in steps:
                yield step

    def counters(self) -> Counters:
        """Every rank's counters summed (vLLM's /metrics has one series per engine; the
        simulator sums them and shows each rank in /sim/state)."""
        if len(self.engines) == 1:
            return self.engines[0].counters
        total = Counters()
        for engine in self.engines:
            for f in dataclasses.fields(Counters):
                mine, theirs = getattr(total, f.name), getattr(engine.counters, f.name)
                if isinstance(mine, dict):
                    for key, value in theirs.items():
                        mine[key] = mine.get(key, 0) + value
                else:
                    setattr(total, f.name, mine + theirs)
        return total

    def gauges(self) -> Gauges:
        gauges = [e.gauges() for e in self.engines]
        n = len(gauges)
        return Gauges(
            kv_cache_usage=sum(g.kv_cache_usage for g in gauges) / n,
            running=sum(g.running for g in gauges),
            waiting=sum(g.waiting for g in gauges),
            pinned_requests=sum(g.pinned_requests for g in gauges),
            pinned_blocks=sum(g.pinned_blocks for g in gauges),
            sleep_level=self.pause.sleep_level if self.pause.sleeping else 0,
        )
