"""One request in the engine: what it asks (GenRequest), its running state (Seq), what it
yields per token (Step) and what it fills in for the HTTP layer (RunResult)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm_sim import model


@dataclass
class GenRequest:
    request_id: str  # internal id, with vLLM's random suffix (#27987)
    prompt: list[int]
    max_tokens: int
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    kv_params: dict[str, Any] | None = None
    base_id: str = ""  # the X-Request-Id it came with (push mode pairs P and D by it)
    dp_rank: int | None = None  # X-data-parallel-rank (None: any rank; vllm_sim/dp.py)
    seed_blocker: str = ""  # what in the request rules first-token seeding out (handover.py)


@dataclass(frozen=True)
class Step:
    token_ids: list[int]
    content: str
    reasoning: str
    finish_reason: str | None = None
    stop_reason: str | None = None


@dataclass
class RunResult:
    """Filled in by the engine while a request runs; read by the HTTP layer."""

    cached_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    content: str = ""
    reasoning: str = ""
    finish_reason: str | None = None
    stop_reason: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class Seq:
    tokens: list[int]
    block_ids: list[int]
    hashes: list[int]  # hashes of the full blocks whose KV is complete, in order
    hit_tokens: int = 0
    last_kv: int = model.KV_ROOT
    loaded: range = range(0)  # the blocks loaded from the shared store (store connector)
    saved: int = 0  # blocks [0, saved) are written to the store or were loaded from it
    seed: int | None = None  # P's token 1, emitted without D's forward (vllm#51919)
