"""9. The handover (vllm#51919): TTFT per turn with first-token seeding and concurrent dispatch
each off and on, on the same conversations. One stack per arm (1 P, 1 D, both offering the
features, the cost model plus D's modelled handover: its admission and its first-token
forward); the routers' flags turn the features off. The arms take turns, round by round."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any

from bench import overhead
from bench.plan import Plan
from bench.stack import LoadGen, start_stack
from bench.stats import summary_ms
from harness.stack import Stack

Tick = Callable[[str], None]

# vllm#50913 measured ~197 ms p50 of handover on a 3P1D setup (API server, scheduler, a
# forward for token 1) against ~29 ms of transfer; the simulator charges D's share of it as
# an admission (parse, tokenize, admit) and a forward's fixed cost (one decode step).
ADMISSION_MS = 15.0

ARMS = {
    "off": ("both off", ["--no-first-token-seeding", "--no-concurrent-dispatch"]),
    "seed": ("first-token seeding", ["--no-concurrent-dispatch"]),
    "concurrent": ("concurrent dispatch", ["--no-first-token-seeding"]),
    "both": ("both on", []),
}


def steps(plan: Plan) -> int:
    return len(ARMS) * plan.conv_rounds


def modelled_ms(plan: Plan) -> float:
    """D's modelled handover the features remove: its admission and its token-1 forward."""
    return ADMISSION_MS + plan.gpu.decode_ms_per_token


def sim_args(plan: Plan) -> list[str]:
    return [
        *plan.gpu.sim_args(),
        "--max-model-len",
        str(plan.max_model_len),
        "--num-blocks",
        str(plan.ample_blocks),
        "--bidirectional",
        "--seed-first-token",
        "--pd-kv-ready",
        "--admission-ms",
        str(ADMISSION_MS),
        "--first-token-forward-ms",
        str(plan.gpu.decode_ms_per_token),
    ]


def job(plan: Plan, target: dict[str, Any], rnd: int) -> dict[str, Any]:
    """Round rnd's conversations: the same for every arm; answers recorded to compare."""
    n = max(4, plan.conv_n // plan.conv_rounds)
    return {
        "kind": "conversations",
        "target": target,
        "n": n,
        "turns": min(plan.conv_turns, 4),
        "concurrency": max(1, plan.conv_concurrency // 4),
        "system_words": plan.system_words,
        "user_words": plan.user_words,
        "output_tokens": (16, 32),
        "jitter_s": 0.2,
        "seed": 5200 + rnd,
        "deadline_s": 120.0,
        "request_timeout_s": 60.0,
        "answers": True,
    }


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    turns: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    commands: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        stacks: dict[str, Stack] = {}
        for arm, (_, flags) in ARMS.items():
            stacks[arm] = stack.enter_context(
                start_stack(
                    prefill_args=[sim_args(plan)],
                    decode_args=[sim_args(plan)],
                    router_args=[flags],
                    name=f"handover-{arm}",
                )
            )
            commands[arm] = stacks[arm].commands
        for rnd in range(plan.conv_rounds):
            order = list(ARMS) if rnd % 2 == 0 else list(ARMS)[::-1]
            for arm in order:
                tick(f"handover, round {rnd + 1}, {arm}")
                r = lg.run(job(plan, overhead.via_router(stacks[arm]), rnd), timeout=300.0)
                turns[arm] += [dict(t, round=rnd) for t in r["turns"]]
    return {
        "modelled_ms": modelled_ms(plan),
        "admission_ms": ADMISSION_MS,
        "forward_ms": plan.gpu.decode_ms_per_token,
        "arms": {arm: _summary(turns[arm]) for arm in ARMS},
        "same_answers": _same_answers(turns),
        "commands": commands,
    }


def _summary(turns: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [t for t in turns if t["ok"]]
    return {
        "first": summary_ms([t["ttft"] for t in ok if t["turn"] == 1]),
        "later": summary_ms([t["ttft"] for t in ok if t["turn"] > 1]),
        "reuse": dict(Counter(t["reuse"].split(";")[0] or "none" for t in ok if t["turn"] > 1)),
        "failed": len(turns) - len(ok),
    }


def _key(t: dict[str, Any]) -> tuple[int, int, int]:
    return t["round"], t["conv"], t["turn"]


def _same_answers(turns: dict[str, list[dict[str, Any]]]) -> bool:
    """Whether every arm answered every turn, each as the baseline did."""
    base = {_key(t): t.get("answer") for t in turns["off"] if t["ok"]}
    if not base:
        return False
    for got in turns.values():
        mine = {_key(t): t.get("answer") for t in got if t["ok"]}
        if mine != base:
            return False
    return True


def section(r: dict[str, Any]) -> list[str]:
    arms, need = r["arms"], r["modelled_ms"]
    off = arms["off"]
    lines = [
        "## 9. The handover: first-token seeding and concurrent dispatch (vllm#51919)",
        "",
        "The same conversations (up to 4 turns, 16-32 output tokens, streamed) through four "
        "stacks of 1 P and 1 D that offer both features, each router with some turned off. "
        f"D's modelled handover is its admission ({r['admission_ms']:.1f} ms, "
        f"`--admission-ms`) plus its token-1 forward ({r['forward_ms']:.1f} ms, "
        f"`--first-token-forward-ms`): **{need:.1f} ms**. Answers identical across arms: "
        f"**{'yes' if r['same_answers'] else 'NO'}**.",
        "",
        "| arm | turn 1 p50 ms | turns 2.. p50 ms | turns 2.. p90 ms | saved vs off, turn 1 / "
        "2.. (ms) | turns 2.. outcomes | failed |",
        "|---|---|---|---|---|---|---|",
    ]
    for arm, (label, _) in ARMS.items():
        cell = arms[arm]
        saved = (
            f"{off['first']['p50'] - cell['first']['p50']:+.1f} / "
            f"{off['later']['p50'] - cell['later']['p50']:+.1f}"
        )
        outcomes = ", ".join(f"{k} {v}" for k, v in sorted(cell["reuse"].items()))
        lines.append(
            f"| {label} | {cell['first']['p50']:.1f} | {cell['later']['p50']:.1f} |"
            f" {cell['later']['p90']:.1f} | {saved} | {outcomes} | {cell['failed']} |"
        )
    both = arms["both"]
    met = (
        off["first"]["p50"] - both["first"]["p50"] >= need
        and off["later"]["p50"] - both["later"]["p50"] >= need
    )
    lines += [
        "",
        f"Both on saves at least D's modelled handover on first and later turns: "
        f"**{'met' if met else 'not met'}**.",
        "",
    ]
    return lines
