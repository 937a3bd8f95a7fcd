"""3. What reuse buys: multi-turn conversations on 2 P + 2 D simulators with a GPU cost model.

Arms: (a) kvbaton with reuse and affinity, (b) kvbaton with affinity only (`--no-reuse`),
(c) round robin over P and over D with the null handoff and no session (vLLM's toy proxy,
done by the load generator itself, so it pays no proxy hop). Each with an ample prefill cache
and with one smaller than the conversations' working set.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from typing import Any

from tests.bench import overhead
from tests.bench.plan import Plan
from tests.bench.stack import LoadGen, RedisStats, Stack, by_source, start_stack
from tests.bench.stats import summary_ms

Tick = Callable[[str], None]

ARMS = {
    "a": "kvbaton, reuse + affinity",
    "b": "kvbaton, affinity only (--no-reuse)",
    "c": "round robin, no reuse (toy proxy)",
}
CACHES = ("ample", "small")


def sim_args(plan: Plan, arm: str, cache: str) -> tuple[list[list[str]], list[list[str]]]:
    base = [*plan.gpu.sim_args(), "--max-model-len", str(plan.max_model_len)]
    p_blocks = plan.ample_blocks if cache == "ample" else plan.small_prefill_blocks
    p = [*base, "--num-blocks", str(p_blocks)]
    d = [*base, "--num-blocks", str(plan.ample_blocks)]
    if arm == "a":
        # Stock vLLM streams no kv_transfer_params; TTFT needs streaming, so arm (a) runs the
        # engines with PR #40186 (--stream-kv-params) and the router told so.
        p += ["--bidirectional"]
        d += ["--bidirectional", "--stream-kv-params"]
    return [p, p], [d, d]


def router_args(arm: str) -> list[list[str]]:
    return {"a": [["--stream-kv-params"]], "b": [["--no-reuse"]], "c": []}[arm]


def conversation_job(plan: Plan, target: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "conversations",
        "target": target,
        "n": plan.conv_n,
        "turns": plan.conv_turns,
        "concurrency": plan.conv_concurrency,
        "system_words": plan.system_words,
        "user_words": plan.user_words,
        "output_tokens": plan.output_tokens,
        "jitter_s": 1.0 if not plan.quick else 0.2,
        "seed": 2024,
        "deadline_s": 60.0 if plan.quick else 300.0,
        "request_timeout_s": 120.0,
    }


def run(plan: Plan, lg: LoadGen, tick: Tick, no_reuse: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"gpu": dataclasses.asdict(plan.gpu), "runs": {}, "commands": {}}
    for cache in CACHES:
        for arm in ARMS:
            key = f"{cache}/{arm}"
            tick(f"reuse {cache} cache, arm {arm}")
            if arm == "b" and not no_reuse:
                out["runs"][key] = {"pending": "the router has no --no-reuse flag yet"}
                continue
            out["runs"][key] = one(plan, lg, arm, cache, out["commands"])
    return out


def one(plan: Plan, lg: LoadGen, arm: str, cache: str, commands: dict[str, Any]) -> dict[str, Any]:
    p_args, d_args = sim_args(plan, arm, cache)
    with start_stack(
        prefill_args=p_args,
        decode_args=d_args,
        router_args=router_args(arm),
        with_redis=arm != "c",
        name=f"reuse-{cache}-{arm}",
    ) as st:
        stats = RedisStats(st.redis_url) if st.redis_url else None
        try:
            if stats is not None:
                stats.reset()
            target = overhead.direct(st) if arm == "c" else overhead.via_router(st)
            cpu0 = st.router_cpu()
            r = lg.run(conversation_job(plan, target), timeout=360.0)
            cpu = st.router_cpu() - cpu0
            redis_delta = stats.read() if stats is not None else {}
        finally:
            if stats is not None:
                stats.close()
        commands[f"{cache}/{arm}"] = st.commands
        return summarize(plan, st, r, cpu, redis_delta)


def _tokens(st: Stack) -> dict[str, dict[str, float]]:
    totals: dict[str, dict[str, float]] = {}
    for role, sims in (("P", st.prefill), ("D", st.decode)):
        acc: Counter[str] = Counter()
        for s in sims:
            acc.update(by_source(s.url))
        totals[role] = dict(acc)
    return totals


def summarize(
    plan: Plan, st: Stack, r: dict[str, Any], cpu: float, redis_delta: dict[str, Any]
) -> dict[str, Any]:
    turns = r["turns"]
    ok = [t for t in turns if t["ok"]]
    by_turn = {
        str(t): summary_ms([x["ttft"] for x in ok if x["turn"] == t])
        for t in range(1, plan.conv_turns + 1)
    }
    latency = {
        str(t): summary_ms([x["latency"] for x in ok if x["turn"] == t])
        for t in range(1, plan.conv_turns + 1)
    }
    reuse = Counter(x["reuse"].split(";")[0] or "none" for x in ok)
    return {
        "ttft_by_turn": by_turn,
        "latency_by_turn": latency,
        "turns_ok": len(ok),
        "turns_failed": len(turns) - len(ok),
        "errors": [x["error"] for x in turns if not x["ok"]][:3],
        "wall_s": r["wall_s"],
        "tokens": _tokens(st),
        "prompt_tokens": sum(x["prompt_tokens"] for x in ok),
        "completion_tokens": sum(x["completion_tokens"] for x in ok),
        "reuse": dict(reuse),
        "router_cpu_ms_per_turn": cpu / max(1, len(turns)) * 1000.0 if st.routers else None,
        "turns": len(turns),
        "redis_delta": redis_delta,
    }
