"""Prometheus metrics (prefix `kvbaton_`), one registry per app; docs/metrics.md lists them.

With one worker the process exports its own registry. With `--workers N` the workers share
one port, so any of them answers a scrape: prometheus_client's multiprocess mode (the
supervisor sets PROMETHEUS_MULTIPROC_DIR) sums counters and histograms over the workers, and
each worker publishes its in-flight requests and store breaker to that directory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any, Self, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from router.engines.kv_watch import KvEvents
from router.engines.pool import Pool
from router.metrics_kv import KvEventsCollector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets from 1 ms to 2 min: TTFT of short turns up to long prefills. In ms: each
# division is correctly rounded, so these are the floats 0.001, 0.0025, ... 120.0 exactly.
_BUCKETS_MS = (1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1e3, 2.5e3, 5e3, 1e4, 3e4, 6e4, 1.2e5)
LATENCY_BUCKETS = tuple(ms / 1000 for ms in _BUCKETS_MS)


# Named once: the collector reads them from this process, `_Published` writes them for all.
INFLIGHT = ("kvbaton_backend_inflight_requests", "Requests in flight per instance")
CIRCUIT = (
    "kvbaton_store_circuit_open",
    "1 while the session store is skipped after a failure (routing without reuse)",
)
INSTANCE = ["role", "instance"]


class _Children:
    """Children found in one dict get (`labels` checks, converts, locks: ~0.9 us, ~8 a turn)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._children: dict[tuple[Any, ...], Any] = {}

    def labels(self, *values: Any, **by_name: Any) -> Self:
        if by_name:
            return cast(Self, super().labels(*values, **by_name))  # type: ignore[misc]
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = super().labels(*values)  # type: ignore[misc]
        return cast(Self, child)


class _Counter(_Children, Counter):
    pass


class _Histogram(_Children, Histogram):
    pass


class _StateCollector(Collector):
    """Gauges read at scrape time from the live pool and store breaker (nothing to update).
    With several workers, in-flight requests and the breaker come from `_Published` instead."""

    def __init__(self, pool: Pool, store_open: Callable[[], bool], *, shared: bool) -> None:
        self._pool = pool
        self._store_open = store_open
        self._shared = shared

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        instances = self._pool.instances()
        healthy = GaugeMetricFamily(
            "kvbaton_backend_healthy", "1 if the instance takes new turns, else 0", labels=INSTANCE
        )
        restarts = CounterMetricFamily(
            "kvbaton_backend_restarts",
            "Restarts seen per instance (a new process start time): its handles are not used",
            labels=INSTANCE,
        )
        usage = GaugeMetricFamily(
            "kvbaton_decode_kv_usage",
            "A D's KV-cache usage (0-1, its vllm:kv_cache_usage_perc as of the last health read)",
            labels=["instance"],
        )
        pressure = GaugeMetricFamily(
            "kvbaton_decode_pin_pressure",
            "1 while a D is over --pin-high-water, until it is under --pin-low-water: the "
            "handles on it least likely to be read are released",
            labels=["instance"],
        )
        pins = GaugeMetricFamily(
            "kvbaton_decode_pinned_handles",
            "Handles the router holds on a D (each pins its blocks there until read or released)",
            labels=["instance"],
        )
        blocks = GaugeMetricFamily(
            "kvbaton_decode_pinned_blocks",
            "Distinct blocks of a D that the handles the router holds there pin (a block shared "
            "by several handles once, as D counts it: at most D's size)",
            labels=["instance"],
        )
        handle_blocks = GaugeMetricFamily(
            "kvbaton_decode_pinned_handle_blocks",
            "Blocks of the handles the router holds on a D summed handle by handle (a block "
            "shared by several handles once per handle)",
            labels=["instance"],
        )
        tokens = GaugeMetricFamily(
            "kvbaton_decode_pinned_tokens",
            "Tokens of the handles the router holds on a D summed (their remote_num_tokens)",
            labels=["instance"],
        )
        for inst in instances:
            healthy.add_metric([inst.role, inst.url], 1.0 if inst.usable else 0.0)
            restarts.add_metric([inst.role, inst.url], float(inst.ident.restarts))
            if inst.role == "decode" and inst.kv_usage >= 0:
                usage.add_metric([inst.url], inst.kv_usage)
                pressure.add_metric([inst.url], 1.0 if inst.pressured else 0.0)
            if inst.role == "decode" and inst.pins >= 0:
                pins.add_metric([inst.url], float(inst.pins))
                blocks.add_metric([inst.url], float(inst.pinned_blocks))
                handle_blocks.add_metric([inst.url], float(inst.pinned_handle_blocks))
                tokens.add_metric([inst.url], float(inst.pinned_tokens))
        yield from (healthy, restarts, usage, pressure, pins, blocks, handle_blocks, tokens)
        if self._shared:
            return
        inflight = GaugeMetricFamily(*INFLIGHT, labels=INSTANCE)
        for inst in instances:
            inflight.add_metric([inst.role, inst.url], float(inst.outstanding))
        circuit = GaugeMetricFamily(*CIRCUIT)
        circuit.add_metric([], 1.0 if self._store_open() else 0.0)
        yield inflight
        yield circuit


class _Published:
    """With several workers: each one's in-flight requests per instance (summed over the live
    workers) and store breaker (open if any worker's is), written to the shared directory."""

    def __init__(self, pool: Pool, store_open: Callable[[], bool]) -> None:
        self._pool = pool
        self._store_open = store_open
        self._seen: set[tuple[str, str]] = set()
        self.inflight = Gauge(*INFLIGHT, INSTANCE, registry=None, multiprocess_mode="livesum")
        self.circuit = Gauge(*CIRCUIT, registry=None, multiprocess_mode="livemax")

    def publish(self) -> None:
        now = set()
        for inst in self._pool.instances():
            now.add((inst.role, inst.url))
            self.inflight.labels(inst.role, inst.url).set(inst.outstanding)
        for gone in self._seen - now:  # removed through the admin API: nothing in flight
            self.inflight.labels(*gone).set(0)
        self._seen |= now
        self.circuit.set(1.0 if self._store_open() else 0.0)

    async def every(self, interval: float) -> None:
        while True:
            self.publish()
            await asyncio.sleep(interval)


class Metrics:
    """Every metric the router exports, in its own registry (or, with `shared`, in the
    workers' multiprocess directory)."""

    def __init__(self, pool: Pool, store_open: Callable[[], bool], *, shared: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = _Counter(
            "kvbaton_requests",
            "Client requests by route and HTTP status",
            ["route", "status"],
            registry=r,
        )
        self.reuse = _Counter(
            "kvbaton_kv_reuse",
            "KV reuse outcome of each turn (X-KV-Reuse)",
            ["outcome", "reason"],
            registry=r,
        )
        # One series per source (sum them for the old unlabelled total): decode_pull, P reads
        # them from D; prefill_cache, P's own prefix cache held them (KV events).
        self.reused_tokens = _Counter(
            "kvbaton_kv_reused_tokens",
            "Verified prompt tokens P did not compute, by where their KV came from",
            ["source"],
            registry=r,
        )
        self.store_prompt_tokens = _Counter(
            "kvbaton_store_prompt_tokens",
            "--kv-connector store: P legs' prompt tokens, cached (P's usage: the store or its "
            "own prefix cache) or computed",
            ["source"],
            registry=r,
        )
        self.commits = _Counter(
            "kvbaton_session_commits",
            "Session commits after a turn by result",
            ["result"],
            registry=r,
        )
        self.store_errors = _Counter(
            "kvbaton_store_errors",
            "Session-store failures (timeouts, errors, garbage)",
            registry=r,
        )
        self.ttft = _Histogram(
            "kvbaton_ttft_seconds",
            "Time from request to the first byte sent to the client",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = _Histogram(
            "kvbaton_request_duration_seconds",
            "Time from request to the last byte",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream = _Histogram(
            "kvbaton_upstream_duration_seconds",
            "Engine call time (P: whole prefill; D: until the response starts)",
            ["role", "instance", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.aborts = _Counter(
            "kvbaton_turns_aborted",
            "Turns that committed nothing, by reason",
            ["reason"],
            registry=r,
        )
        self.malformed = _Counter(
            "kvbaton_decode_malformed_answers",
            "D answers refused as not what the API promises (not JSON, a cut stream), per D",
            ["instance"],
            registry=r,
        )
        self.moved_handles = _Counter(
            "kvbaton_decode_moved_handles",
            "D handles refused for naming a side channel other than the one D showed it owns",
            ["instance"],
            registry=r,
        )
        self.releases = _Counter(
            "kvbaton_pin_releases",
            "Handles released so that D frees their pinned blocks, by reason and outcome",
            ["reason", "outcome"],
            registry=r,
        )
        self.inter_turn = _Histogram(
            "kvbaton_inter_turn_seconds",
            "Time from a conversation's last commit to its next turn (the release delay's base)",
            buckets=(1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0),
            registry=r,
        )
        self.handover = _Histogram(
            "kvbaton_handover_seconds",
            "P's answer to D's first byte, by how P's params reached D (legs/handover.py)",
            ["mode"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_ahead = _Counter(
            "kvbaton_decode_ahead",
            "D legs sent beside the claim (a turn on D alone), by whether the turn used them",
            ["outcome"],
            registry=r,
        )
        self.handover_fallbacks = _Counter(
            "kvbaton_handover_fallbacks",
            "D requests sent beside P that did not get P's params, by reason",
            ["reason"],
            registry=r,
        )
        state = _StateCollector(pool, store_open, shared=shared)
        self.published: _Published | None = None
        if shared:
            self.published = _Published(pool, store_open)
            self.registry = CollectorRegistry()
            MultiProcessCollector(self.registry)  # type: ignore[no-untyped-call]
        self.registry.register(state)
        self._kv: KvEventsCollector | None = None

    def watch_kv_events(self, kv: KvEvents) -> None:
        """Export the KV-events index and streams (per engine) of this process."""
        if self._kv is None and kv.enabled:
            self._kv = KvEventsCollector(kv)
            self.registry.register(self._kv)

    def render(self) -> bytes:
        if self.published is not None:
            self.published.publish()  # this worker's part is exact; the others' up to 1 s old
        return generate_latest(self.registry)
