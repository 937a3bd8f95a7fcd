"""Data-parallel ranks: an engine started with internal data parallelism
(`vllm serve --data-parallel-size N`) has N prefix caches behind one URL, and
`X-data-parallel-rank: <r>` pins a request to one of them. The router keeps a conversation on
one rank of its D and of its P (their prefix caches hold its earlier turns) and spreads new
conversations over the ranks. The size comes from `--data-parallel-size URL=N`."""

from __future__ import annotations

import functools
import re

from router.engines.pool import Instance

HEADER = "X-data-parallel-rank"
SPEC_HELP = "URL=N"
# vLLM appends `_dp<rank>` to each rank's KV engine id (reference section 2).
_SUFFIX = re.compile(r"_dp(\d+)$")


def parse_spec(spec: str) -> tuple[str, int]:
    """`URL=N` -> (URL, N); ValueError if not."""
    url, eq, size = spec.rpartition("=")
    if not url or not eq or not size.isdigit() or int(size) < 1:
        raise ValueError(f"{spec!r}: expected {SPEC_HELP} with N >= 1")
    return url.rstrip("/"), int(size)


@functools.cache
def sizes(specs: tuple[str, ...]) -> dict[str, int]:
    return dict(parse_spec(spec) for spec in specs)


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
