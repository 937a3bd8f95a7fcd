"""3. What reuse buys: multi-turn conversations on 2 P + 2 D simulators with a GPU cost model.

Arms: (a) kvbaton with reuse and affinity, (b) kvbaton with affinity only (`--no-reuse`),
(c) round robin over P and over D with the null handoff and no session (vLLM's toy proxy,
done by the load generator itself, so it pays no proxy hop). Each with an ample prefill cache
and with one smaller than the conversations' working set. (h) and (p), ample cache only: no
conversation id (history sessions), and stock engines whose streams carry no handle, where
reuse is the decode plan's (per-turn placement).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from bench import overhead
from bench.loadgen import words
from bench.plan import Plan
from bench.stack import LoadGen, RedisStats, by_source, machine_cpu, post, router_cpu, start_stack
from bench.stats import pct, summary_ms
from harness.stack import Stack

Tick = Callable[[str], None]

ARMS = {
    "a": "kvbaton, reuse + affinity",
    "b": "kvbaton, affinity only (--no-reuse)",
    "c": "round robin, no reuse (toy proxy)",
    "h": "kvbaton, reuse, no conversation id (history sessions)",
    "p": "kvbaton, placement, stock engines (no handle in streams)",
    "n": "kvbaton, JSON turns, all plans (pull, decode, recompute)",
    "q": "kvbaton, JSON turns, pull only (--decode-local-max-tokens 0)",
}
# The small cache measures what eviction costs reuse; how a session is found does not change
# that, so arm (h) runs with the ample cache only (and --quick stays under 4 minutes).
ONLY_AMPLE = ("h", "p", "n", "q")
# Non-streaming turns, the plans compared: a full run only (--quick stays under 4 minutes).
FULL_ONLY = ("n", "q")
JSON_ARMS = ("n", "q")
CACHES = ("ample", "small")


def arms_for(plan: Plan, cache: str, no_reuse: bool) -> list[str]:
    """The arms that run with this cache in this plan."""
    return [
        a
        for a in ARMS
        if (a != "b" or no_reuse)
        and (cache == "ample" or a not in ONLY_AMPLE)
        and not (plan.quick and a in FULL_ONLY)
    ]


def sim_args(plan: Plan, arm: str, cache: str) -> tuple[list[list[str]], list[list[str]]]:
    # vLLM 0.32's shapes: the arms below are defined by what a 0.32 stream lacks.
    base = [
        *plan.gpu.sim_args(),
        "--max-model-len",
        str(plan.max_model_len),
        "--vllm-version",
        "0.32",
    ]
    p_blocks = plan.ample_blocks if cache == "ample" else plan.small_prefill_blocks
    p = [*base, "--num-blocks", str(p_blocks)]
    d = [*base, "--num-blocks", str(plan.ample_blocks)]
    if arm in ("p", *JSON_ARMS):  # stock vLLM 0.32: streams carry no kv_transfer_params
        p += ["--bidirectional"]
        d += ["--bidirectional"]
    if arm in ("a", "h"):
        # Stock vLLM streams no kv_transfer_params; TTFT needs streaming, so arm (a) runs the
        # engines with PR #40186 (--stream-kv-params) and the router told so.
        p += ["--bidirectional"]
        d += ["--bidirectional", "--stream-kv-params"]
    return [p, p], [d, d]


def router_args(arm: str) -> list[list[str]]:
    args: dict[str, list[list[str]]] = {
        "a": [["--stream-kv-params"]],
        "b": [["--no-reuse"]],
        "c": [],
        "p": [[]],  # the defaults: placement on, nothing told about the engines
        "n": [[]],
        "q": [["--decode-local-max-tokens", "0"]],
    }
    return args.get(arm, [["--stream-kv-params"]])


def conversation_job(
    plan: Plan, target: dict[str, Any], rnd: int = 0, *, ids: bool = True, stream: bool = True
) -> dict[str, Any]:
    """Round rnd's share of the conversations: the same ones for every arm (`ids`: the
    client sends a conversation id, else only the history)."""
    return {
        "conversation_ids": ids,
        "stream": stream,
        "kind": "conversations",
        "target": target,
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


def run(plan: Plan, lg: LoadGen, tick: Tick, no_reuse: bool) -> dict[str, Any]:
    """Per cache size, the three arms' stacks run side by side and take turns, round by round
    (a, b, c, then c, b, a, ...), so that a change in the machine's load hits every arm."""
    out: dict[str, Any] = {"gpu": dataclasses.asdict(plan.gpu), "runs": {}, "commands": {}}
    if not no_reuse:
        for cache in CACHES:
            out["runs"][f"{cache}/b"] = {"pending": "the router has no --no-reuse flag yet"}
    for arm in ONLY_AMPLE:
        out["runs"][f"small/{arm}"] = {"pending": "runs with the ample cache only"}
    if plan.quick:
        for arm in FULL_ONLY:
            out["runs"][f"ample/{arm}"] = {"pending": "a full run only"}
    for cache in CACHES:
        here = arms_for(plan, cache, no_reuse)
        with contextlib.ExitStack() as stack:
            arms_up = {arm: stack.enter_context(Arm(plan, arm, cache)) for arm in here}
            for rnd in range(plan.conv_rounds):
                for arm in here if rnd % 2 == 0 else here[::-1]:
                    tick(f"reuse {cache} cache, round {rnd + 1}, arm {arm}")
                    arms_up[arm].run(lg, rnd)
            for arm, up in arms_up.items():
                out["runs"][f"{cache}/{arm}"] = up.result()
                out["commands"][f"{cache}/{arm}"] = up.st.commands
    return out


class Arm:
    """One arm's processes for the whole cache configuration, and what its rounds measured."""

    def __init__(self, plan: Plan, arm: str, cache: str) -> None:
        self.plan, self.arm, self.cache = plan, arm, cache
        self.turns: list[dict[str, Any]] = []
        self.wall = 0.0
        self.cpu = 0.0
        self.busy = [0.0, 0.0]  # all CPUs' busy and total seconds during the runs
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> Arm:
        try:
            self._start()
        except BaseException:
            self._stack.close()
            raise
        return self

    def _start(self) -> None:
        p_args, d_args = sim_args(self.plan, self.arm, self.cache)
        self.st = self._stack.enter_context(
            start_stack(
                prefill_args=p_args,
                decode_args=d_args,
                router_args=router_args(self.arm),
                with_redis=self.arm != "c",
                name=f"reuse-{self.cache}-{self.arm}",
            )
        )
        self.stats = RedisStats(self.st.redis_url) if self.st.redis_url else None
        if self.stats is not None:
            self._stack.callback(self.stats.close)
            self.stats.reset()

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def run(self, lg: LoadGen, rnd: int) -> None:
        target = overhead.direct(self.st) if self.arm == "c" else overhead.via_router(self.st)
        cpu0 = router_cpu(self.st)
        busy0, total0 = machine_cpu()
        job = conversation_job(
            self.plan, target, rnd, ids=self.arm != "h", stream=self.arm not in JSON_ARMS
        )
        r = lg.run(job, timeout=420.0)
        self.cpu += router_cpu(self.st) - cpu0
        busy1, total1 = machine_cpu()
        self.busy[0] += busy1 - busy0
        self.busy[1] += total1 - total0
        self.wall += r["wall_s"]
        self.turns += [dict(t, round=rnd) for t in r["turns"]]

    def result(self) -> dict[str, Any]:
        delta = self.stats.read() if self.stats is not None else {}
        out = summarize(self.plan, self.st, self.turns, self.wall, self.cpu, delta)
        out["machine_busy"] = self.busy[0] / self.busy[1] if self.busy[1] else None
        if self.arm == "a":
            out["tokenize"] = tokenize_cost(self.plan, self.st.ps[0].url)
        return out


def tokenize_cost(plan: Plan, url: str, calls: int = 10) -> dict[str, float]:
    """What one /tokenize of a last-turn-sized chat costs the simulator (the router's
    token-exact check sends one per hit), median wall time of `calls` calls."""
    rng = random.Random(5)
    mid = [(lo + hi) // 2 for lo, hi in (plan.system_words, plan.user_words, plan.output_tokens)]
    messages = [{"role": "system", "content": words(rng, mid[0])}]
    for t in range(plan.conv_turns):
        messages.append({"role": "user", "content": words(rng, mid[1])})
        if t + 1 < plan.conv_turns:
            messages.append({"role": "assistant", "content": words(rng, mid[2])})
    body = {"model": "sim-model", "messages": messages, "add_generation_prompt": True}
    times = []
    count = 0
    for _ in range(calls):
        t0 = time.perf_counter()
        count = int(post(url + "/tokenize", body)["count"])
        times.append(time.perf_counter() - t0)
    return {"tokens": count, "ms_p50": pct(times, 50) * 1000.0}


def _tokens(st: Stack) -> dict[str, dict[str, float]]:
    totals: dict[str, dict[str, float]] = {}
    for role, sims in (("P", st.ps), ("D", st.ds)):
        acc: Counter[str] = Counter()
        for s in sims:
            acc.update(by_source(s.url))
        totals[role] = dict(acc)
    return totals


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


def summarize(
    plan: Plan,
    st: Stack,
    turns: list[dict[str, Any]],
    wall: float,
    cpu: float,
    redis_delta: dict[str, Any],
) -> dict[str, Any]:
    ok = [t for t in turns if t["ok"]]
    index = range(1, plan.conv_turns + 1)
    by_turn = {str(t): summary_ms([x["ttft"] for x in ok if x["turn"] == t]) for t in index}
    latency = {str(t): summary_ms([x["latency"] for x in ok if x["turn"] == t]) for t in index}
    reuse = Counter(x["reuse"].split(";")[0] or "none" for x in ok)
    limits = turn_limits(plan, ok)
    return {
        "ttft_by_turn": by_turn,
        "limit_by_turn": {
            str(t): summary_ms([v for (_, _, n), v in limits.items() if n == t]) for t in index
        },
        "latency_by_turn": latency,
        "itl": summary_ms([x["itl"] for x in ok]),
        "gap_max": summary_ms([x["gap_max"] for x in ok]),
        "turns_ok": len(ok),
        "turns_failed": len(turns) - len(ok),
        "errors": [x["error"] for x in turns if not x["ok"]][:3],
        "wall_s": wall,
        "tokens": _tokens(st),
        "prompt_tokens": sum(x["prompt_tokens"] for x in ok),
        "completion_tokens": sum(x["completion_tokens"] for x in ok),
        "reuse": dict(reuse),
        "router_cpu_ms_per_turn": cpu / max(1, len(turns)) * 1000.0 if st.routers else None,
        "turns": len(turns),
        "redis_delta": redis_delta,
    }
