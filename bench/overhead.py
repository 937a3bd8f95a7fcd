"""1. Router overhead: the same seeded conversations through kvbaton, the floor and the work
floor on zero-cost engines, in alternating rounds; and 4., the Redis work per turn.

A conversation's first turn is a miss; every later one claims its session, asks P's
`/tokenize`, verifies the prefix, sends the token-ids P leg with D's handle and commits. The
floor (bench/passthrough.py) does the two legs and nothing else; the work floor adds a hit's
I/O, bare (the claim and commit in Redis, P's /tokenize). kvbaton minus the floor is the
router's own work per turn.
"""

from __future__ import annotations

import contextlib
from typing import Any

from bench import redis_cost
from bench.plan import Plan
from bench.screen import Screen, Table
from bench.stack import LoadGen, Tick, alternate, passthrough, start_stack, timed
from bench.stats import fmt, turns_summary
from harness.stack import Stack, argv_of

# Zero-cost, bidirectional; D streams its handle (PR #40186) so streamed turns hit too.
P_ARGS = ["--bidirectional", "--kv-recompute-threshold", "0", "--num-blocks", "65536"]
# The floors never release D's pins (kvbaton releases the last turn's): a short TTL.
D_ARGS = ["--bidirectional", "--stream-kv-params", "--num-blocks", "131072"]
D_ARGS += ["--decoder-kv-blocks-ttl", "10"]
# Pull only: every turn takes P's leg as the floors' do (at 16 clients the decode plan would
# run some on D alone, `hit;via=decode`).
PULL_ONLY = ["--decode-local-max-tokens", "0"]
ROUTER_ARGS = ["--stream-kv-params", *PULL_ONLY]
ARMS = ("kvbaton", "floor", "work")
# Every turn's request: a system prompt and a user message of one-token words, a short answer.
SYSTEM_WORDS, USER_WORDS, NONSTREAM_TOKENS, STREAM_TOKENS = 120, 40, 16, 32


def stack(name: str, *more: list[str]) -> contextlib.AbstractContextManager[Stack]:
    """These engines and a kvbaton with ROUTER_ARGS (and more routers with `more`' flags)."""
    routers = [ROUTER_ARGS, *more]
    return start_stack(prefill=[P_ARGS], decode=[D_ARGS], routers=routers, name=name)


def job(
    plan: Plan, url: str, *, stream: bool, clients: int, rnd: int, turns: int = 0
) -> dict[str, Any]:
    """Conversations of plan.hit_turns turns (or `turns`), `clients` at a time, each turn a
    short answer; at least plan.hit_min_convs of them and 2 per client."""
    tokens = STREAM_TOKENS if stream else NONSTREAM_TOKENS
    spec: dict[str, Any] = {"kind": "conversations", "target": {"mode": "router", "urls": [url]}}
    spec.update(n=max(plan.hit_min_convs, 2 * clients), seed=500 + rnd, jitter_s=0.0)
    spec.update(turns=turns or plan.hit_turns, concurrency=clients, stream=stream)
    spec.update(system_words=(SYSTEM_WORDS,) * 2, user_words=(USER_WORDS,) * 2)
    spec.update(output_tokens=(tokens, tokens), deadline_s=180.0, request_timeout_s=60.0)
    return spec


def steps(plan: Plan) -> int:
    return 2 * len(plan.hit_clients) * plan.overhead_rounds * len(ARMS) + 1


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    out: dict[str, Any] = {"cells": [], "monitor": {}, "turns": plan.hit_turns}
    with stack("overhead", ["--no-reuse"]) as st, contextlib.ExitStack() as exits:
        assert st.redis_url is not None
        p, d = st.ps[0].url, st.ds[0].url
        floor = exits.enter_context(passthrough(p, d, "overhead-floor"))
        work = exits.enter_context(passthrough(p, d, "overhead-work", st.redis_url))
        st.commands["floor"], st.commands["work floor"] = argv_of(floor.proc), argv_of(work.proc)
        arms = {"kvbaton": (st.url, st.router.proc.pid), "floor": (floor.url, floor.proc.pid)}
        arms["work"] = (work.url, work.proc.pid)
        for stream in (False, True):
            for clients in plan.hit_clients:
                out["cells"].append(cell(plan, st, lg, tick, arms, stream, clients))
        tick("redis round trips")
        for router, mode in zip(st.routers, ("reuse", "no-reuse"), strict=True):
            spec = job(plan, router.url, stream=False, clients=4, rnd=99, turns=3)
            out["monitor"][mode] = redis_cost.monitor_sample(st, lg, {**spec, "n": 4})
        out["commands"] = st.commands
    return out


def cell(
    plan: Plan,
    st: Stack,
    lg: LoadGen,
    tick: Tick,
    arms: dict[str, tuple[str, int]],
    stream: bool,
    clients: int,
) -> dict[str, Any]:
    """Every arm (its URL and process id) in plan.overhead_rounds alternating rounds of new
    conversations: each arm's latencies of first and later turns, and its CPU per turn."""

    def one(arm: str, rnd: int) -> tuple[list[dict[str, Any]], float]:
        spec = job(plan, arms[arm][0], stream=stream, clients=clients, rnd=rnd)
        res, cpu = timed(st, lg, spec, arms[arm][1])
        return res["turns"], cpu

    label = f"overhead {'stream' if stream else 'json'} c={clients}"
    done = alternate(list(arms), plan.overhead_rounds, tick, label, one)
    out: dict[str, Any] = {"stream": stream, "concurrency": clients}
    for arm, rounds in done.items():
        turns = [t for rows, _ in rounds for t in rows]
        cpu_ms = sum(cpu for _, cpu in rounds) / max(1, len(turns)) * 1000.0
        out[arm] = {**turns_summary(turns, "latency"), "cpu_ms_per_turn": cpu_ms}
    return out


def own(cell: dict[str, Any], key: str, q: str = "p50") -> float:
    """kvbaton minus the floor, ms at percentile q of "first" or "later" turns."""
    return float(cell["kvbaton"][key][q] - cell["floor"][key][q])


def first_json(res: dict[str, Any]) -> dict[str, Any] | None:
    """The cell of JSON turns at the fewest clients (the targets' and the answer's)."""
    cells = [c for c in res.get("cells", []) if not c["stream"]]
    return min(cells, key=lambda c: c["concurrency"], default=None)


def _pair(a: float, b: float) -> str:
    return f"{fmt(a)} / {fmt(b)}"


def screens(res: dict[str, Any], plan: Plan) -> list[Screen]:
    """Section 1 (what kvbaton adds to a turn, its CPU) and section 4 (Redis)."""
    rows = []
    for c in res["cells"]:
        k, f = c["kvbaton"], c["floor"]
        cpu = " / ".join(fmt(c[a]["cpu_ms_per_turn"], 3) for a in ARMS)
        rows.append(
            [
                "stream" if c["stream"] else "JSON",
                str(c["concurrency"]),
                *(_pair(f[key]["p50"], k[key]["p50"]) for key in ("first", "later")),
                *(_pair(own(c, "first", q), own(c, "later", q)) for q in ("p50", "p90")),
                cpu,
            ]
        )
    head = ["turns", "clients", "turn 1 p50 ms: floor / kvbaton"]
    head += ["turns 2.. p50 ms: floor / kvbaton", "kvbaton - floor p50 ms: turn 1 / 2.."]
    head += ["kvbaton - floor p90 ms: turn 1 / 2..", "CPU ms/turn: kvbaton / floor / work floor"]
    answer = []
    if (c := first_json(res)) is not None:
        n, cpus = c["concurrency"], {a: fmt(c[a]["cpu_ms_per_turn"], 3) for a in ARMS}
        answer.append(
            f"At {n} client{'s' * (n != 1)}, JSON, kvbaton adds {fmt(own(c, 'first'))} ms p50 to "
            f"a first turn and {fmt(own(c, 'later'))} ms to a later one over the floor; its CPU "
            f"per turn is {cpus['kvbaton']} ms against the work floor's {cpus['work']} (the "
            f"floor's {cpus['floor']})."
        )
    question = (
        f"What does kvbaton add to a turn? The same seeded conversations of {res['turns']} "
        "turns on zero-cost engines through kvbaton, the floor (bench/passthrough.py: Hypercorn "
        "+ Starlette + aiohttp doing the two legs, nothing else) and the work floor (the floor "
        "plus a later turn's /tokenize and Redis claim and commit), in alternating rounds; "
        "latency of the whole answer, CPU from /proc."
    )
    table = Table(head, rows)
    overhead = Screen("Router overhead", question, [table], answer, "bench-overhead.png")
    return [overhead, redis_cost.screen(res)]
