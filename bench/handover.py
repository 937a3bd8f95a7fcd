"""9. The handover (vllm#51919): TTFT with first-token seeding and concurrent dispatch each off
and on. One stack per arm (1 P, 1 D, both offering the features, the cost model plus D's
modelled admission and first-token forward); the arms take turns, round by round."""

from __future__ import annotations

import contextlib
from typing import Any

from bench.plan import Plan
from bench.screen import Screen, Table
from bench.stack import LoadGen, Tick, alternate, round_turns, start_stack
from bench.stats import fmt, turns_summary

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
HEADER = ["arm", "turn 1 p50 ms", "turns 2.. p50 / p90 ms", "saved vs off, turn 1 / 2..", "failed"]


def steps(plan: Plan) -> int:
    return len(ARMS) * plan.conv_rounds


def sim_args(plan: Plan) -> list[str]:
    flags = (
        f"--max-model-len {plan.max_model_len} --num-blocks {plan.ample_blocks} --bidirectional "
        f"--seed-first-token --pd-kv-ready --admission-ms {ADMISSION_MS}"
    )
    return [*plan.gpu.sim_args(), *flags.split()]


def job(plan: Plan, url: str, rnd: int) -> dict[str, Any]:
    """Round rnd's conversations: the same for every arm."""
    return {
        "kind": "conversations",
        "target": {"mode": "router", "urls": [url]},
        "n": max(4, plan.conv_n // plan.conv_rounds),
        "turns": min(plan.conv_turns, 4),
        "concurrency": max(1, plan.conv_concurrency // 4),
        "system_words": plan.system_words,
        "user_words": plan.user_words,
        "output_tokens": (16, 32),
        "jitter_s": 0.2,
        "seed": 5200 + rnd,
        "deadline_s": 120.0,
        "request_timeout_s": 60.0,
    }


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    with contextlib.ExitStack() as stack:
        stacks = {
            arm: stack.enter_context(
                start_stack(
                    prefill=[sim_args(plan)],
                    decode=[sim_args(plan)],
                    routers=[flags],
                    name=f"handover-{arm}",
                )
            )
            for arm, (_, flags) in ARMS.items()
        }
        one = lambda arm, rnd: lg.run(job(plan, stacks[arm].url, rnd), timeout=300.0)  # noqa: E731
        done = alternate(list(ARMS), plan.conv_rounds, tick, "handover", one)
    turns = {arm: round_turns(results) for arm, results in done.items()}
    return {
        # D's modelled handover the features remove: its admission and its token-1 forward
        "modelled_ms": ADMISSION_MS + plan.gpu.first_token_forward_ms,
        "admission_ms": ADMISSION_MS,
        "forward_ms": plan.gpu.first_token_forward_ms,
        "arms": {arm: turns_summary(turns[arm]) for arm in ARMS},
        "same_answers": same_answers(turns),
        "commands": {arm: st.commands for arm, st in stacks.items()},
    }


def same_answers(turns: dict[str, list[dict[str, Any]]]) -> bool:
    """Whether every arm answered every turn, each as the baseline did."""
    answers = {
        arm: {(t["round"], t["conv"], t["turn"]): t.get("answer") for t in got if t["ok"]}
        for arm, got in turns.items()
    }
    return bool(answers["off"]) and all(mine == answers["off"] for mine in answers.values())


def screens(res: dict[str, Any], plan: Plan) -> list[Screen]:
    arms, need = res["arms"], res["modelled_ms"]
    off = arms["off"]
    rows = []
    for arm, (label, _) in ARMS.items():
        c = arms[arm]
        later = f"{fmt(c['later']['p50'], 1)} / {fmt(c['later']['p90'], 1)}"
        saved = [off[k]["p50"] - c[k]["p50"] for k in ("first", "later")]
        text = f"{saved[0]:+.1f} / {saved[1]:+.1f}"
        rows.append([label, fmt(c["first"]["p50"], 1), later, text, str(c["failed"])])
    question = (
        "How much TTFT do first-token seeding and concurrent dispatch (vllm#51919) save: the "
        "same conversations through four stacks of 1 P and 1 D offering both, each router "
        f"with some off, D's modelled handover {need:.1f} ms (admission "
        f"{res['admission_ms']:.1f} ms, token-1 forward {res['forward_ms']:.1f} ms)?"
    )
    saved = [off[k]["p50"] - arms["both"][k]["p50"] for k in ("first", "later")]
    answer = (
        f"Both on saves {saved[0]:.1f} ms p50 on turn 1 and {saved[1]:.1f} ms on later turns; "
        f"both at least the modelled {need:.1f} ms: {'yes' if min(saved) >= need else 'no'}; "
        f"answers identical across arms: {'yes' if res['same_answers'] else 'NO'}."
    )
    return [Screen("The handover", question, [Table(HEADER, rows)], [answer])]
