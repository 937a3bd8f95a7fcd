"""6. KV events: what following the engines' KV events costs a turn: the same conversations
through two routers on one stack, with and without --kv-events, taking turns (the engines
publish either way)."""

from __future__ import annotations

import contextlib
from typing import Any

from bench import overhead
from bench.plan import Plan
from bench.screen import Screen, Table
from bench.stack import LoadGen, Tick, alternate, another_router, round_turns, start_stack
from bench.stats import fmt, turns_summary
from harness.procs import free_port


def job(plan: Plan, url: str, rnd: int) -> dict[str, Any]:
    """Round rnd's conversations, one at a time: section 1's turns, JSON."""
    spec = overhead.job(plan, url, stream=False, clients=1, rnd=77 + rnd, turns=plan.events_turns)
    return {**spec, "n": plan.events_convs}


def per_turn(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    """1 P and 1 D (zero cost, publishing KV events), a router without and one with
    --kv-events on one Redis, taking turns. Both pull-only: every turn takes P's leg, where
    the events place it and find P's cache (on D alone, the decode plan, they play no part)."""
    ports = [free_port(), free_port()]
    base = ["--bidirectional", "--max-model-len", str(plan.max_model_len)]
    with contextlib.ExitStack() as up:
        st = up.enter_context(
            start_stack(
                prefill=[[*base, "--kv-events-port", str(ports[0])]],
                decode=[[*base, "--kv-events-port", str(ports[1])]],
                routers=[overhead.PULL_ONLY],
                name="events",
            )
        )
        sims = [st.ps[0].url, st.ds[0].url]
        args = [f"{u}=tcp://127.0.0.1:{p}" for u, p in zip(sims, ports, strict=True)]
        events = ("--kv-events", args[0], "--kv-events", args[1])
        on = up.enter_context(another_router(st, *events, *overhead.PULL_ONLY, name="events-on"))
        urls = {"events-off": st.url, "events-on": on.url}
        one = lambda name, rnd: lg.run(job(plan, urls[name], rnd), timeout=200.0)  # noqa: E731
        done = alternate(list(urls), plan.events_rounds, tick, "kv events: per turn", one)
    return {name: turns_summary(round_turns(rs), "latency") for name, rs in done.items()}


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    return {"per_turn": per_turn(plan, lg, tick)}


def steps(plan: Plan) -> int:
    return 2 * plan.events_rounds


def screens(res: dict[str, Any], plan: Plan) -> list[Screen]:
    cells = res["per_turn"]
    rows = []
    for name, c in cells.items():
        hits = sum(n for k, n in c["reuse"].items() if k.startswith("hit"))
        later = f"{fmt(c['later']['p50'])} / {fmt(c['later']['p90'])}"
        label = f"with{'' if name == 'events-on' else 'out'} --kv-events"
        hit = f"{hits} of {c['later']['n']}"
        rows.append([label, fmt(c["first"]["p50"]), later, hit, str(c["failed"])])
    on, off = (cells[k]["later"]["p50"] for k in ("events-on", "events-off"))
    header = ["router", "turn 1 p50 ms", "turns 2.. p50 / p90 ms", "turns 2.. hit", "failed"]
    question = (
        "What does following the engines' KV events cost a turn: latency of the same "
        "conversations (1 client, JSON) through two routers on one P and one D, taking turns?"
    )
    answer = (
        f"A later turn's p50 is {fmt(on)} ms with events, {fmt(off)} ms without "
        f"({on - off:+.2f} ms)."
    )
    return [Screen("KV events", question, [Table(header, rows)], [answer])]
