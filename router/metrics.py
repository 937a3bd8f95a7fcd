"""Prometheus metrics (prefix `kvbaton_`), one registry per app; docs/metrics.md lists them.

One Hypercorn worker per router process: each process exports its own registry (run several
processes behind a load balancer and let Prometheus sum them), so no multiprocess mode.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from router.backends import Pool

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets from 1 ms to 2 min: TTFT of short turns up to long prefills.
LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
)


class _StateCollector(Collector):
    """Gauges read at scrape time from the live pool and store breaker (nothing to update)."""

    def __init__(self, pool: Pool, store_open: Callable[[], bool]) -> None:
        self._pool = pool
        self._store_open = store_open

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        healthy = GaugeMetricFamily(
            "kvbaton_backend_healthy",
            "1 if the instance takes new turns, else 0",
            labels=["role", "instance"],
        )
        inflight = GaugeMetricFamily(
            "kvbaton_backend_inflight_requests",
            "Requests in flight per instance",
            labels=["role", "instance"],
        )
        restarts = CounterMetricFamily(
            "kvbaton_backend_restarts",
            "Restarts seen per instance (a new process start time): its handles are not used",
            labels=["role", "instance"],
        )
        for inst in self._pool.instances():
            healthy.add_metric([inst.role, inst.url], 1.0 if inst.usable else 0.0)
            inflight.add_metric([inst.role, inst.url], float(inst.outstanding))
            restarts.add_metric([inst.role, inst.url], float(inst.restarts))
        circuit = GaugeMetricFamily(
            "kvbaton_store_circuit_open",
            "1 while the session store is skipped after a failure (routing without reuse)",
        )
        circuit.add_metric([], 1.0 if self._store_open() else 0.0)
        yield healthy
        yield inflight
        yield restarts
        yield circuit


class Metrics:
    """Every metric the router exports, in its own registry."""

    def __init__(self, pool: Pool, store_open: Callable[[], bool]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvbaton_requests",
            "Client requests by route and HTTP status",
            ["route", "status"],
            registry=r,
        )
        self.reuse = Counter(
            "kvbaton_kv_reuse",
            "KV reuse outcome of each turn (X-KV-Reuse)",
            ["outcome", "reason"],
            registry=r,
        )
        self.reused_tokens = Counter(
            "kvbaton_kv_reused_tokens", "Tokens of D's KV handed to P on hits", registry=r
        )
        self.commits = Counter(
            "kvbaton_session_commits",
            "Session commits after a turn by result",
            ["result"],
            registry=r,
        )
        self.store_errors = Counter(
            "kvbaton_store_errors",
            "Session-store failures (timeouts, errors, garbage)",
            registry=r,
        )
        self.ttft = Histogram(
            "kvbaton_ttft_seconds",
            "Time from request to the first byte sent to the client",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "kvbaton_request_duration_seconds",
            "Time from request to the last byte",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.upstream = Histogram(
            "kvbaton_upstream_duration_seconds",
            "Engine call time (P: whole prefill; D: until the response starts)",
            ["role", "instance", "outcome"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.aborts = Counter(
            "kvbaton_turns_aborted",
            "Turns that committed nothing, by reason",
            ["reason"],
            registry=r,
        )
        r.register(_StateCollector(pool, store_open))

    def render(self) -> bytes:
        return generate_latest(self.registry)
