"""Data-parallel ranks: an engine started with internal data parallelism
(`vllm serve --data-parallel-size N`) has N prefix caches behind one URL, and
`X-data-parallel-rank: <r>` pins a request to one of them. The router keeps a conversation on
one rank of its D and of its P (their prefix caches hold its earlier turns) and spreads new
conversations over the ranks. The size comes from `--data-parallel-size URL=N`, else from the
engine's /metrics (one `engine="<index>"` series per rank), read when the instance is checked."""

from __future__ import annotations

import functools
import re

from router.engines.metrics_text import matches
from router.engines.pool import Instance

HEADER = "X-data-parallel-rank"
# vLLM appends `_dp<rank>` to each rank's KV engine id (reference section 2).
_SUFFIX = re.compile(r"_dp(\d+)$")
SPEC_HELP = "URL=N"


def parse_spec(spec: str) -> tuple[str, int]:
    """`URL=N` -> (URL, N); ValueError if not."""
    url, eq, size = spec.rpartition("=")
    if not url or not eq or not size.isdigit() or int(size) < 1:
        raise ValueError(f"{spec!r}: expected {SPEC_HELP} with N >= 1")
    return url.rstrip("/"), int(size)


@functools.cache
def sizes(specs: tuple[str, ...]) -> dict[str, int]:
    return dict(parse_spec(spec) for spec in specs)


# vLLM labels its per-engine series with the engine index, one per data-parallel rank of the
# process (v1/metrics/loggers.py: labelnames ["model_name", "engine"], read in 0.32's code).
_RUNNING = (
    b"vllm:num_requests_running{",
    re.compile(rb'vllm:num_requests_running\{[^}]*\bengine="(\d+)"'),
)


def learned_size(metrics: bytes) -> int:
    """The number of engines (data-parallel ranks) an engine's /metrics text shows (0: none)."""
    return len({m.group(1) for m in matches(_RUNNING, metrics, whole=False)})


def size_of(configured: tuple[str, ...], inst: Instance) -> int:
    """`--data-parallel-size` for this instance, else what its /metrics showed, else 1."""
    return sizes(configured).get(inst.url) or inst.dp_size or 1


def rank_of(engine_id: str) -> int:
    """The rank in a data-parallel engine id (`<id>_dp<rank>`); -1 if it names none."""
    match = _SUFFIX.search(engine_id)
    return int(match.group(1)) if match else -1


def choose(inst: Instance, size: int, previous: int) -> int:
    """The rank for this leg: the conversation's previous one, else the next in turn
    (-1: the engine runs one rank, no header)."""
    if size <= 1:
        return -1
    if 0 <= previous < size:
        return previous
    rank = inst.next_rank % size
    inst.next_rank += 1
    return rank
