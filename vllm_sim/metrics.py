"""Prometheus text for /metrics: vLLM 0.32 names and labels, plus `vllm_sim:` counters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")


READ_WAIT_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0)


@dataclass
class Histogram:
    """A Prometheus histogram: counts per upper bound (cumulative when rendered), sum, count."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def observe(self, value: float) -> None:
        if not self.counts:
            self.counts = [0] * len(self.bounds)
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break
        self.total += value
        self.count += 1

    def __add__(self, other: Histogram) -> Histogram:
        """Two ranks' histograms as one (the same bounds)."""
        width = len(self.bounds)
        mine, theirs = self.counts or [0] * width, other.counts or [0] * width
        counts = [a + b for a, b in zip(mine, theirs, strict=True)]
        return Histogram(self.bounds, counts, self.total + other.total, self.count + other.count)

    def lines(self, name: str, labels: str) -> list[str]:
        out, running = [], 0
        counts = self.counts or [0] * len(self.bounds)
        for bound, n in zip(self.bounds, counts, strict=True):
            running += n
            out.append(f'{name}_bucket{{{labels},le="{bound!r}"}} {_fmt(running)}')
        out.append(f'{name}_bucket{{{labels},le="+Inf"}} {_fmt(self.count)}')
        out.append(f"{name}_sum{{{labels}}} {_fmt(self.total)}")
        out.append(f"{name}_count{{{labels}}} {_fmt(self.count)}")
        return out


@dataclass
class Counters:
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_tokens_cached: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    nixl_failed_transfers: int = 0
    nixl_failed_notifications: int = 0
    nixl_kv_expired_reqs: int = 0
    nixl_transfers: int = 0
    nixl_bytes_transferred: int = 0
    request_success: dict[str, int] = field(default_factory=dict)
    # vLLM's prometheus-fastapi-instrumentator: (handler, method, "2xx") -> requests
    http_requests: dict[tuple[str, str, str], int] = field(default_factory=dict)
    by_source: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SOURCES, 0))
    # simulator-only
    sim_blocks_pinned: int = 0
    sim_blocks_freed: int = 0
    sim_blocks_expired: int = 0
    sim_reads_served: int = 0
    sim_reads_declined: int = 0
    sim_reads_refused: int = 0
    sim_notify_unknown: int = 0
    sim_requests_failed: int = 0
    sim_store_lookups: int = 0
    sim_store_blocks_read: int = 0
    sim_store_blocks_written: int = 0
    sim_store_errors: int = 0
    # vllm#51919 (vllm_sim/handover.py): seeded tokens, fallbacks by reason, seeds that
    # differ from what D's KV gives, parked requests and park timeouts
    sim_seeded_first_tokens: int = 0
    sim_seed_fallbacks: dict[str, int] = field(default_factory=dict)
    sim_seed_mismatches: int = 0
    sim_parked_requests: int = 0
    sim_park_timeouts: int = 0
    # The wall time of this P's side-channel exchanges (handshake and block read) per pull:
    # D's own event loop answers them, so they wait while D is busy. A GPU's RDMA read does
    # not wait on D's CPU: this is the simulation's cost, not vLLM's (docs/simulator.md).
    sim_read_wait: Histogram = field(default_factory=lambda: Histogram(READ_WAIT_BUCKETS))


@dataclass(frozen=True)
class Gauges:
    kv_cache_usage: float
    running: int
    waiting: int
    pinned_requests: int
    pinned_blocks: int
    sleep_level: int = 0  # 0 awake; else the level of the sleep it is in (POST /sleep)


@dataclass
class PushCounters:
    """Push mode's (vllm_sim/push.py), on /metrics only where an instance pushes."""

    registrations_sent: int = 0
    registrations_refused: int = 0  # by P (this instance as P)
    writes: int = 0  # transfers written (this instance as P)
    blocks_written: int = 0
    bytes_written: int = 0
    blocks_received: int = 0  # this instance as D
    timeouts: int = 0  # D waited push_registration_timeout for a write that never came
    lease_expired: int = 0  # P waited kv_lease_duration for a registration that never came


_VLLM_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("prompt_tokens", "vllm:prompt_tokens_total", "Number of prefill tokens processed."),
    ("generation_tokens", "vllm:generation_tokens_total", "Number of generation tokens."),
    ("prompt_tokens_cached", "vllm:prompt_tokens_cached_total", "Cached prompt tokens."),
    ("prefix_cache_queries", "vllm:prefix_cache_queries_total", "Prefix cache queries (tokens)."),
    ("prefix_cache_hits", "vllm:prefix_cache_hits_total", "Prefix cache hits (tokens)."),
    (
        "external_prefix_cache_queries",
        "vllm:external_prefix_cache_queries_total",
        "External prefix cache queries (tokens).",
    ),
    (
        "external_prefix_cache_hits",
        "vllm:external_prefix_cache_hits_total",
        "External prefix cache hits (tokens).",
    ),
    (
        "nixl_failed_transfers",
        "vllm:nixl_num_failed_transfers_total",
        "Number of failed NIXL KV transfers.",
    ),
    (
        "nixl_failed_notifications",
        "vllm:nixl_num_failed_notifications_total",
        "Number of failed NIXL notifications.",
    ),
    (
        "nixl_kv_expired_reqs",
        "vllm:nixl_num_kv_expired_reqs_total",
        "Requests whose pinned KV blocks expired before being read.",
    ),
)

_SIM_COUNTERS: tuple[tuple[str, str, str], ...] = (
    ("sim_blocks_pinned", "vllm_sim:blocks_pinned_total", "Blocks pinned for a remote reader."),
    ("sim_blocks_freed", "vllm_sim:blocks_freed_total", "Pinned blocks freed by notification."),
    ("sim_blocks_expired", "vllm_sim:blocks_expired_total", "Pinned blocks freed by expiry."),
    ("sim_reads_served", "vllm_sim:reads_served_total", "Side-channel block reads served."),
    ("sim_reads_declined", "vllm_sim:reads_declined_total", "Remote reads declined (expiry)."),
    ("sim_reads_refused", "vllm_sim:reads_refused_total", "Side-channel reads refused (bad ids)."),
    ("sim_notify_unknown", "vllm_sim:notify_unknown_total", "Free notifications for no pin."),
    ("sim_requests_failed", "vllm_sim:requests_failed_total", "Requests failed by KV load."),
    ("sim_store_lookups", "vllm_sim:store_lookups_total", "KV-store lookups answered."),
    ("sim_store_blocks_read", "vllm_sim:store_blocks_read_total", "Blocks loaded from the store."),
    (
        "sim_store_blocks_written",
        "vllm_sim:store_blocks_written_total",
        "Blocks written to the store.",
    ),
    ("sim_store_errors", "vllm_sim:store_errors_total", "Failed KV-store lookups and writes."),
    ("sim_seeded_first_tokens", "vllm_sim:seeded_first_tokens_total", "Seeded tokens emitted."),
    ("sim_seed_mismatches", "vllm_sim:seed_mismatches_total", "Seeds unlike D's own token."),
    ("sim_parked_requests", "vllm_sim:parked_requests_total", "Requests parked for P's params."),
    ("sim_park_timeouts", "vllm_sim:park_timeouts_total", "Parked requests prefilled locally."),
)


def _fmt(value: float) -> str:
    return repr(float(value))


def render(
    c: Counters,
    g: Gauges,
    model: str,
    cache_labels: dict[str, str],
    started: float,
    running: Sequence[int] = (),
) -> str:
    """vLLM's /metrics text; `running` (one per data-parallel rank) gives
    vllm:num_requests_running one series per engine index, as vLLM labels each engine."""
    base = f'engine="0",model_name="{model}"'
    # prometheus_client's process collector comes first in vLLM's output; a restart changes it.
    lines = [
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
        "# TYPE process_start_time_seconds gauge",
        f"process_start_time_seconds {started!r}",
    ]

    def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")
        for labels, value in samples:
            lines.append(f"{name}{{{labels}}} {_fmt(value)}")

    for attr, name, help_ in _VLLM_COUNTERS:
        metric(name, "counter", help_, [(base, getattr(c, attr))])
    metric(
        "vllm:prompt_tokens_by_source_total",
        "counter",
        "Prompt tokens by source.",
        [(f'{base},source="{s}"', c.by_source[s]) for s in SOURCES],
    )
    metric(
        "vllm:request_success_total",
        "counter",
        "Finished requests by finish reason.",
        [(f'{base},finished_reason="{r}"', n) for r, n in sorted(c.request_success.items())],
    )
    metric(
        "vllm_sim:seed_fallbacks_total",
        "counter",
        "Seeded first tokens D recomputed, by reason.",
        [(f'{base},reason="{r}"', n) for r, n in sorted(c.sim_seed_fallbacks.items())],
    )
    for family, total in (
        ("vllm:nixl_xfer_time_seconds", 0.0),
        ("vllm:nixl_bytes_transferred", float(c.nixl_bytes_transferred)),
    ):
        lines.append(f"# TYPE {family} summary")
        lines.append(f"{family}_count{{{base}}} {_fmt(c.nixl_transfers)}")
        lines.append(f"{family}_sum{{{base}}} {_fmt(total)}")
    metric(
        "http_requests_total",
        "counter",
        "Total number of requests by method, status and handler.",
        [
            (f'handler="{h}",method="{m}",status="{st}"', n)
            for (h, m, st), n in sorted(c.http_requests.items())
        ],
    )
    metric(
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage (1 = 100%).",
        [(base, g.kv_cache_usage)],
    )
    per_engine = [(f'engine="{i}",model_name="{model}"', float(n)) for i, n in enumerate(running)]
    metric(
        "vllm:num_requests_running", "gauge", "Requests running.", per_engine or [(base, g.running)]
    )
    metric("vllm:num_requests_waiting", "gauge", "Requests waiting.", [(base, g.waiting)])
    # vLLM's sleep gauge, one sample per state (set at start: awake 1).
    asleep = g.sleep_level > 0
    metric(
        "vllm:engine_sleep_state",
        "gauge",
        "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine is "
        "awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means sleep level 2.",
        [
            (f'{base},sleep_state="awake"', 0 if asleep else 1),
            (f'{base},sleep_state="weights_offloaded"', 1 if g.sleep_level == 1 else 0),
            (f'{base},sleep_state="discard_all"', 1 if g.sleep_level == 2 else 0),
        ],
    )
    info = ",".join(f'{k}="{v}"' for k, v in cache_labels.items())
    metric(
        "vllm:cache_config_info",
        "gauge",
        "Information of the LLMEngine CacheConfig.",
        [(f'engine="0",{info}', 1)],
    )
    for attr, name, help_ in _SIM_COUNTERS:
        metric(name, "counter", help_, [(base, getattr(c, attr))])
    wait = "vllm_sim:kv_read_wait_seconds"
    lines.append(f"# HELP {wait} Wall time of this instance's side-channel reads per pull.")
    lines.append(f"# TYPE {wait} histogram")
    lines.extend(c.sim_read_wait.lines(wait, base))
    metric(
        "vllm_sim:pinned_requests",
        "gauge",
        "Requests holding pinned blocks.",
        [(base, g.pinned_requests)],
    )
    metric(
        "vllm_sim:pinned_blocks",
        "gauge",
        "Blocks pinned for remote readers.",
        [(base, g.pinned_blocks)],
    )
    lines.append("")
    return "\n".join(lines)


_PUSH_METRICS = (
    ("writes", "vllm_sim:push_writes_total", "Push transfers written by this instance as P."),
    ("blocks_written", "vllm_sim:push_blocks_written_total", "KV blocks written as P."),
    ("bytes_written", "vllm_sim:push_bytes_written_total", "KV bytes written as P."),
    ("blocks_received", "vllm_sim:push_blocks_received_total", "KV blocks written into D."),
    ("registrations_sent", "vllm_sim:push_registrations_total", "Registrations sent as D."),
    ("registrations_refused", "vllm_sim:push_registrations_refused_total", "Refused as P."),
    ("timeouts", "vllm_sim:push_registration_timeouts_total", "D gave up waiting for a write."),
    ("lease_expired", "vllm_sim:push_lease_expired_total", "P gave up waiting for D."),
)


def push_text(counters: PushCounters) -> str:
    lines: list[str] = []
    for attr, name, help_ in _PUSH_METRICS:
        lines += [
            f"# HELP {name} {help_}",
            f"# TYPE {name} counter",
            f"{name} {getattr(counters, attr)}",
        ]
    return "\n".join(lines) + "\n"


def push_summed(counters: list[PushCounters]) -> PushCounters:
    """Every data-parallel rank's push counters added up."""
    total = PushCounters()
    for c in counters:
        for name in PushCounters.__dataclass_fields__:
            setattr(total, name, getattr(total, name) + getattr(c, name))
    return total
