"""3. What reuse buys: multi-turn conversations on 2 P + 2 D simulators with a GPU cost model.

The arms (ARMS) take turns round by round on stacks of their own, with an ample prefill cache
and with one smaller than the conversations' working set.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from bench.plan import Plan
from bench.screen import Screen, Table
from bench.stack import LoadGen, Tick, alternate, prompt_tokens, round_turns, start_stack
from bench.stats import fmt, summary_ms
from harness.stack import Stack

ARMS = {
    "a": "kvbaton, reuse + affinity",
    "b": "kvbaton, affinity only (--no-reuse)",
}
CACHES = ("ample", "small")
ROUTER_ARGS = {"a": ["--stream-kv-params"], "b": ["--no-reuse"]}


def start_arm(plan: Plan, arm: str, cache: str) -> contextlib.AbstractContextManager[Stack]:
    """vLLM 0.32's engines (the arms are defined by what a 0.32 stream lacks): for (a)
    bidirectional, D streaming its handle (vLLM PR #40186), as TTFT needs streaming."""
    base = [*plan.gpu.sim_args(), "--max-model-len", str(plan.max_model_len)]
    base += ["--vllm-version", "0.32"] + (["--bidirectional"] if arm == "a" else [])
    p_blocks = plan.ample_blocks if cache == "ample" else plan.small_prefill_blocks
    d = [*base, "--num-blocks", str(plan.ample_blocks)]
    d += ["--stream-kv-params"] if arm == "a" else []
    return start_stack(
        prefill=[[*base, "--num-blocks", str(p_blocks)]] * 2,
        decode=[d, d],
        routers=[ROUTER_ARGS[arm]],
        name=f"reuse-{cache}-{arm}",
    )


def conversation_job(plan: Plan, st: Stack, arm: str, rnd: int) -> dict[str, Any]:
    """Round rnd's share of the conversations, the same for every arm."""
    return {
        "kind": "conversations",
        "target": {"mode": "router", "urls": [st.url]},
        "n": plan.conv_n // plan.conv_rounds,
        "turns": plan.conv_turns,
        "concurrency": plan.conv_concurrency,
        "system_words": plan.system_words,
        "user_words": plan.user_words,
        "output_tokens": plan.output_tokens,
        "jitter_s": 1.0 if not plan.quick else 0.2,
        "seed": 2024 + rnd,
        "deadline_s": 60.0 if plan.quick else 300.0,
        "request_timeout_s": 120.0,
    }


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    """Per cache size, the arms' stacks run side by side and take turns (alternate)."""
    out: dict[str, Any] = {"gpu": dataclasses.asdict(plan.gpu), "runs": {}, "commands": {}}
    for cache in CACHES:
        with contextlib.ExitStack() as stack:
            up = {arm: stack.enter_context(start_arm(plan, arm, cache)) for arm in ARMS}

            def job(arm: str, rnd: int, up: dict[str, Stack] = up) -> dict[str, Any]:
                return lg.run(conversation_job(plan, up[arm], arm, rnd), timeout=420.0)

            done = alternate(list(ARMS), plan.conv_rounds, tick, f"reuse {cache} cache", job)
            for arm, st in up.items():
                out["runs"][f"{cache}/{arm}"] = summarize(plan, st, round_turns(done[arm]))
                out["commands"][f"{cache}/{arm}"] = st.commands
    return out


def turn_limits(plan: Plan, ok: list[dict[str, Any]]) -> dict[tuple[int, int, int], float]:
    """The cost model's limit (seconds, as TTFTs are) of every turn whose previous turn in
    its conversation succeeded: D holds the previous prompt and answer (all but the last
    token, never fed back), which is what a turn can reuse."""
    seen = {(x.get("round", 0), x["conv"], x["turn"]): x for x in ok}
    out: dict[tuple[int, int, int], float] = {}
    for (rnd, conv, turn), x in seen.items():
        before = seen.get((rnd, conv, turn - 1))
        if turn > 1 and before is None:
            continue
        reused = before["prompt_tokens"] + before["completion_tokens"] - 1 if before else 0
        out[(rnd, conv, turn)] = plan.gpu.turn_limit_ms(x["prompt_tokens"], reused) / 1000.0
    return out


def summarize(plan: Plan, st: Stack, turns: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [t for t in turns if t["ok"]]
    limits = turn_limits(plan, ok)
    return {
        "ttft_by_turn": {
            str(n): summary_ms([x["ttft"] for x in ok if x["turn"] == n])
            for n in range(1, plan.conv_turns + 1)
        },
        "limit_by_turn": {
            str(n): summary_ms([v for (_, _, t), v in limits.items() if t == n])
            for n in range(1, plan.conv_turns + 1)
        },
        "turns": len(turns),
        "turns_failed": len(turns) - len(ok),
        "errors": [x["error"] for x in turns if not x["ok"]][:3],
        "tokens": prompt_tokens(st),
    }


def screens(res: dict[str, Any], plan: Plan) -> list[Screen]:
    runs = res["runs"]
    n = str(plan.conv_turns)
    rows = []
    for key, r in runs.items():
        cache, arm = key.split("/")
        p, d, ttft = r["tokens"]["P"], r["tokens"]["D"], r["ttft_by_turn"]
        rows.append(
            [
                f"({arm}) {ARMS[arm]}",
                cache,
                fmt(ttft["1"]["p50"], 0),
                f"{fmt(ttft[n]['p50'], 0)} / {fmt(ttft[n]['p90'], 0)}",
                fmt(r["limit_by_turn"][n]["p50"], 0),
                *(f"{p.get(k, 0):,.0f}" for k in ("local_compute", "local_cache_hit")),
                f"{p.get('external_kv_transfer', 0):,.0f}",
                f"{d.get('local_compute', 0):,.0f}",
                f"{r['turns']} ({r['turns_failed']})",
            ]
        )
    header = ["arm", "P cache", "turn 1 p50", f"turn {n} p50 / p90", f"turn {n} limit"]
    header += ["computed on P", "P cache hits", "pulled D->P", "computed on D", "turns (failed)"]
    answer = [_answer(runs, cache, n) for cache in CACHES if f"{cache}/a" in runs]
    g = res["gpu"]
    question = (
        f"How soon does a later turn's first token come when D's KV is reused: {plan.conv_n} "
        f"conversations x {n} turns on 2 P + 2 D simulators costing {g['prefill_ms_per_token']}"
        f" ms per prompt token and {g['decode_ms_per_token']} ms per output token, TTFT p50 in "
        "ms beside the cost model's limit for the turn, prompt tokens from the engines' metrics?"
    )
    return [Screen("What reuse buys", question, [Table(header, rows)], answer, "bench-ttft.png")]


def _answer(runs: dict[str, Any], cache: str, n: str) -> str:
    """Turn n's TTFT p50 and P's computed tokens: reuse (a) beside (b), the fastest."""
    here = {arm: runs[f"{cache}/{arm}"] for arm in ARMS if f"{cache}/{arm}" in runs}
    p50 = {arm: r["ttft_by_turn"][n]["p50"] for arm, r in here.items()}
    ttft = ", ".join(f"({arm}) {fmt(v, 0)} ms" for arm, v in p50.items())
    computed = " / ".join(f"{r['tokens']['P'].get('local_compute', 0):,.0f}" for r in here.values())
    limit = p50["a"] / here["a"]["limit_by_turn"][n]["p50"]
    fastest = min(p50, key=p50.__getitem__)
    return (
        f"{cache.capitalize()} P cache, turn {n} p50: {ttft}, fastest ({fastest}); tokens "
        f"computed on P {computed}; (a) at {fmt(limit)}x its limit."
    )


def steps(plan: Plan) -> int:
    return len(ARMS) * len(CACHES) * plan.conv_rounds
