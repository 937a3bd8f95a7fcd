"""What the router reads in an engine's /metrics text (Prometheus exposition format): its
process start time, its requests, its KV-cache usage and whether it sleeps. Pure."""

from __future__ import annotations

import re
from collections.abc import Iterator

# Each pattern is matched against the /metrics lines that start with its metric's name, found
# with bytes.find: as MULTILINE regexes over the whole text they tried a match at every line
# of it, ~70 us for each of three over a simulator's 8 KB (vLLM's is larger), read once a
# second per D by the pin sweep and ten times a second while a D is under pressure.
# prometheus_client's process collector, which vLLM's API server exports (measured on 0.32).
_STARTED = (b"process_start_time_seconds ", re.compile(rb"process_start_time_seconds (\S+)"))
# vLLM's scheduler gauges, one sample per engine (data-parallel rank) of the process.
_REQUESTS = (
    b"vllm:num_requests_",
    re.compile(rb"vllm:num_requests_(?:running|waiting)(?:\{[^}]*\})? (\S+)"),
)
# vLLM's KV-cache usage, 0-1, one gauge per engine (and data-parallel rank) (measured on 0.32).
_KV_USAGE = (
    b"vllm:kv_cache_usage_perc",
    re.compile(rb"vllm:kv_cache_usage_perc(?:\{[^}]*\})? (\S+)"),
)
# vLLM's sleep gauge: `awake` 0 while asleep, `weights_offloaded` / `discard_all` 1 at sleep
# level 1 / 2, both of which discard the KV cache (read from the 0.33.0 wheel).
_SLEEP = (
    b"vllm:engine_sleep_state{",
    re.compile(
        rb'vllm:engine_sleep_state\{[^}]*sleep_state="(weights_offloaded|discard_all)"[^}]*\} (\S+)'
    ),
)
Pattern = tuple[bytes, "re.Pattern[bytes]"]


def metric_lines(metrics: bytes, prefix: bytes) -> Iterator[bytes]:
    """The lines of a /metrics text that start with `prefix`, without their line end."""
    if metrics.startswith(prefix):
        start = 0
    else:
        start = metrics.find(b"\n" + prefix) + 1  # 0: none
        if not start:
            return
    while True:
        end = metrics.find(b"\n", start)
        if end < 0:
            yield metrics[start:]
            return
        yield metrics[start:end]
        start = metrics.find(b"\n" + prefix, end) + 1
        if not start:
            return


def matches(pattern: Pattern, metrics: bytes, *, whole: bool = True) -> Iterator[re.Match[bytes]]:
    """The matches of a (prefix, regex) pattern, one per line that starts with the prefix: of
    the whole line, or (`whole=False`) of its start."""
    prefix, regex = pattern
    match = regex.fullmatch if whole else regex.match
    for line in metric_lines(metrics, prefix):
        found = match(line)
        if found is not None:
            yield found


def process_started(metrics: bytes) -> float:
    """An engine's process start time (Unix seconds) from its /metrics text; 0 if absent."""
    match = next(matches(_STARTED, metrics), None)
    try:
        return float(match.group(1)) if match else 0.0
    except ValueError:
        return 0.0


def _samples(pattern: Pattern, metrics: bytes) -> list[float]:
    """The values of every sample the pattern matches (one per engine or rank), garbage skipped."""
    found = []
    for match in matches(pattern, metrics):
        try:
            found.append(float(match.group(1)))
        except ValueError:
            continue
    return found


def engine_requests(metrics: bytes) -> int:
    """Requests an engine runs or queues (every router's), from its /metrics text; 0 if absent."""
    return int(sum(_samples(_REQUESTS, metrics)))


def kv_usage(metrics: bytes) -> float | None:
    """The engine's KV-cache usage (0-1; the highest of its ranks), None if absent."""
    return max(_samples(_KV_USAGE, metrics), default=None)


def kv_discarded(metrics: bytes) -> bool:
    """Whether the engine is asleep at a level that discards its KV cache (level 1 or 2)."""
    for match in matches(_SLEEP, metrics):
        try:
            if float(match.group(2)) >= 1.0:
                return True
        except ValueError:
            continue
    return False
