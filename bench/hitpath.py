"""1b. The hit path: conversations with real history through kvbaton and through the floor.

Section 1's cells are first turns (the miss path). Here every conversation runs several
turns, so each turn after the first claims its session, asks P's `/tokenize`, verifies the
prefix, sends the token-ids P leg with D's handle (P reads from D) and commits. The same
seeded conversations also go through the stack's floor (bench/passthrough.py: two legs,
nothing else), which gives the same answers and so the same histories; *kvbaton minus
floor* per turn is the router's own work on hits (and, for turn 1, on misses).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import peers
from bench.peer_venv import VLLM_TREE_ENV
from bench.plan import FULL, Plan
from bench.stack import LoadGen, passthrough, reset_caches, start_stack, tree_cpu_seconds
from bench.stats import fmt, summary_ms, table
from bench.workload import NONSTREAM_TOKENS, STREAM_TOKENS, SYSTEM_WORDS, USER_WORDS
from harness.stack import Stack, argv_of

Tick = Callable[[str], None]
NAN = float("nan")

# Zero-cost, bidirectional; D streams its handle (PR #40186) so streamed turns hit too, and
# keeps its pins long enough for a conversation's next turn.
P_ARGS = ["--bidirectional", "--kv-recompute-threshold", "0", "--num-blocks", "65536"]
D_ARGS = ["--bidirectional", "--stream-kv-params", "--num-blocks", "65536"]
# The floor never reads or releases D's pins (kvbaton releases the last turn's): let them go
# within a cell, not after 480 s.
D_ARGS += ["--decoder-kv-blocks-ttl", "60"]
# Pull only: with 16 clients P's queue can reach the decode plan's limit, and a turn then runs
# on D alone (`hit;via=decode`), a leg fewer than the floor's; every turn here takes P's leg.
ROUTER_ARGS = ["--stream-kv-params", "--decode-local-max-tokens", "0"]
# The same router on the standard library's event loop (kvbaton's default is uvloop): at 1
# client, a third arm measures what the loop alone changes.
ASYNCIO_ARGS = [*ROUTER_ARGS, "--event-loop", "asyncio"]


def hit_stack(name: str) -> contextlib.AbstractContextManager[Stack]:
    """The hit path's engines and one kvbaton with its flags (section 1, 2's hit turns, 5)."""
    return start_stack(
        prefill_args=[P_ARGS], decode_args=[D_ARGS], router_args=[ROUTER_ARGS], name=name
    )


def job(plan: Plan, url: str, *, stream: bool, clients: int, rnd: int, ids: bool) -> dict[str, Any]:
    tokens = STREAM_TOKENS if stream else NONSTREAM_TOKENS
    return {
        "kind": "conversations",
        "target": {"mode": "router", "urls": [url]},
        "conversation_ids": ids,
        "n": max(plan.hit_min_convs, 2 * clients),
        "turns": plan.hit_turns,
        "concurrency": clients,
        "stream": stream,
        "system_words": (SYSTEM_WORDS, SYSTEM_WORDS),
        "user_words": (USER_WORDS, USER_WORDS),
        "output_tokens": (tokens, tokens),
        "jitter_s": 0.0,
        "seed": 500 + rnd,
        "deadline_s": 180.0,
        "request_timeout_s": 60.0,
    }


# The concurrency at which vLLM's reference multi-turn proxy runs beside kvbaton (the issue's
# "added p50 at 16 clients").
REFERENCE_CLIENTS = 16


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    out: dict[str, Any] = {"cells": []}
    # vLLM's disagg_proxy_multiturn.py, copied at run time out of a fetched vLLM tree (never
    # into the project); without a tree its arm is left out and the report says so.
    script = None
    if REFERENCE_CLIENTS in plan.hit_clients:
        script = peers.vllm_proxy(peers.MULTITURN_PROXY, peers.PROXY_DEPS)
    out["reference"] = script is not None
    with (
        start_stack(
            prefill_args=[P_ARGS],
            decode_args=[D_ARGS],
            router_args=[ROUTER_ARGS, ASYNCIO_ARGS],
            name="hitpath",
        ) as st,
        contextlib.ExitStack() as exits,
    ):
        assert st.redis_url is not None
        floor_app = exits.enter_context(passthrough(st.ps[0].url, st.ds[0].url, "hitpath-floor"))
        work_app = exits.enter_context(
            passthrough(st.ps[0].url, st.ds[0].url, "hitpath-work", st.redis_url)
        )
        st.commands["floor"] = argv_of(floor_app.proc)
        st.commands["work floor"] = argv_of(work_app.proc)
        arms = {"floor": (floor_app.url, floor_app.proc.pid)}
        arms["work"] = (work_app.url, work_app.proc.pid)
        if script is not None:
            url, proc = exits.enter_context(peers.peer_proxy(script, st))
            arms["reference"] = (url, proc.pid)
        for stream in (False, True):
            for clients in plan.hit_clients:
                tick(f"hit path {'stream' if stream else 'json'} c={clients}")
                out["cells"].append(_cell(plan, st, lg, arms, stream, clients))
        out["commands"] = st.commands
    return out


def steps(plan: Plan) -> int:
    return 2 * len(plan.hit_clients)


def _cell(
    plan: Plan,
    st: Stack,
    lg: LoadGen,
    others: dict[str, tuple[str, int]],
    stream: bool,
    clients: int,
) -> dict[str, Any]:
    """kvbaton, the floor and the work floor (at 1 client also kvbaton on asyncio, at
    REFERENCE_CLIENTS vLLM's reference proxy where there is one) in alternating rounds, each
    round new conversations. `others`: each other arm's URL and process id."""
    pids = {"kvbaton": st.routers[0].proc.pid}
    arms = [("kvbaton", st.routers[0].url)]
    for arm in ("floor", "work", "reference"):
        if arm in others and (arm != "reference" or clients == REFERENCE_CLIENTS):
            arms.append((arm, others[arm][0]))
            pids[arm] = others[arm][1]
    if clients == 1:
        pids["asyncio"] = st.routers[1].proc.pid
        arms.insert(1, ("asyncio", st.routers[1].url))
    turns: dict[str, list[dict[str, Any]]] = {arm: [] for arm, _ in arms}
    cpu = dict.fromkeys(turns, 0.0)
    rounds = plan.hit_reference_rounds if "reference" in pids else plan.hit_rounds
    by_round: list[dict[str, Any]] = []  # each round's latencies, where the reference runs
    for rnd in range(rounds):
        this: dict[str, list[dict[str, Any]]] = {}
        for arm, url in arms if rnd % 2 == 0 else arms[::-1]:
            reset_caches(st)
            before = tree_cpu_seconds(pids[arm])
            spec = job(plan, url, stream=stream, clients=clients, rnd=rnd, ids=arm != "floor")
            this[arm] = lg.run(spec, timeout=240.0)["turns"]
            turns[arm] += this[arm]
            cpu[arm] += tree_cpu_seconds(pids[arm]) - before
        if "reference" in pids:
            by_round.append({arm: _latency(rows) for arm, rows in this.items()})
    cell: dict[str, Any] = {"stream": stream, "concurrency": clients, "rounds": rounds}
    if by_round:
        cell["by_round"] = by_round
    for arm, rows in turns.items():
        good = [t for t in rows if t["ok"]]
        later = [t for t in good if t["turn"] > 1]
        cell[arm] = {
            **_latency(rows),
            "later_ttft": summary_ms([t["ttft"] for t in later]),
            "reuse": {k: sum(1 for t in later if t["reuse"] == k) for k in _kinds(later)},
            "turns": len(rows),
            "failed": len(rows) - len(good),
            "cpu_ms_per_turn": cpu[arm] / max(1, len(rows)) * 1000.0,
        }
    return cell


def _latency(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Latency of the answered first turns ("first") and later turns ("later"), as `own`
    reads them: a cell's over all its rounds, or one round's."""
    good = [t for t in rows if t["ok"]]
    return {
        "first": summary_ms([t["latency"] for t in good if t["turn"] == 1]),
        "later": summary_ms([t["latency"] for t in good if t["turn"] > 1]),
    }


def spread(values: list[float]) -> str:
    """'lowest / median / highest' of the values ('n/a' without any)."""
    if not values:
        return "n/a"
    ordered = sorted(values)
    return " / ".join(fmt(v) for v in (ordered[0], statistics.median(ordered), ordered[-1]))


def round_ratios(cell: dict[str, Any], key: str) -> list[float]:
    """`added_ratio` of each round alone (its own p50s) where the reference ran, leaving out
    a round that has none (the reference no slower than the floor)."""
    ratios = (added_ratio(r, key) for r in cell.get("by_round", []))
    return [x for x in ratios if x == x]


def _kinds(rows: list[dict[str, Any]]) -> list[str]:
    return sorted({str(t["reuse"]) for t in rows if t["reuse"]})


def own(cell: dict[str, Any], key: str, floor: str = "floor", arm: str = "kvbaton") -> float:
    """An arm (kvbaton, or "reference") minus a floor ("floor" or "work"), p50 ms, of first
    turns ("first") or later turns ("later"); NaN for a cell without either."""
    if floor not in cell or arm not in cell:
        return float("nan")
    return float(cell[arm][key]["p50"] - cell[floor][key]["p50"])


def section(res: dict[str, Any] | None) -> list[str]:
    if not res or not res.get("cells"):
        return []
    lines = [
        "### The hit path: conversations with history, latency in ms",
        "",
        "Multi-turn conversations (system prompt and user messages as above, the answers sent",
        "back as history), through kvbaton (every turn after the first claims, asks P's",
        "`/tokenize`, verifies, sends P the token ids and D's handle, and commits) and through",
        "the floor (the same conversations, two legs, nothing else) and through the *work",
        "floor* (`bench/passthrough.py` with a Redis URL: the floor plus the I/O a hit makes",
        "kvbaton do, bare: kvbaton's claim and commit scripts, one round trip each, with a",
        "state of the same size, and P's `/tokenize` of the chat on every later turn; no",
        "digests, no verification, no parsing of D's answer), in alternating rounds. The work",
        "floor runs the scripts as any redis-py user would (`Script`); kvbaton sends each as",
        "one EVALSHA on a pooled connection (sessions/evaluate.py), which costs less.",
        "D streams its handle (`--stream-kv-params`), so streamed turns hit too. kvbaton runs",
        "pull only (`--decode-local-max-tokens 0`), so every later turn takes P's leg as the",
        "floor's do (at 16 clients the decode plan would otherwise run some on D alone).",
        "*own* is kvbaton minus floor at p50: the router's own work per turn, plus the engine",
        "work only kvbaton asks for (P's `/tokenize` of the whole chat, in the simulator's",
        "pure-Python tokenizer, and the token-ids P leg); *over work* is kvbaton minus the",
        "work floor on later turns, which leaves the `/tokenize` and Redis I/O out.",
        "",
    ]
    rows = []
    for c in res["cells"]:
        k, f = c["kvbaton"], c["floor"]
        w = c.get("work", {"later": {"p50": NAN, "p99": NAN}, "cpu_ms_per_turn": NAN})
        outcomes = ", ".join(f"{n} {v}" for n, v in k["reuse"].items()) or "n/a"
        later = [k["later"]["p50"], f["later"]["p50"], w["later"]["p50"], own(c, "later", "work")]
        rows.append(
            [
                "stream" if c["stream"] else "json",
                str(c["concurrency"]),
                f"{k['turns']} (+{k['failed']} failed)",
                f"{fmt(k['first']['p50'])} / {fmt(f['first']['p50'])} / {fmt(own(c, 'first'))}",
                " / ".join(fmt(v) for v in later),
                " / ".join(fmt(a["later"]["p99"]) for a in (k, f, w)),
                " / ".join(fmt(a["cpu_ms_per_turn"], 3) for a in (k, f, w)),
                outcomes,
            ]
        )
    header = [
        "turns",
        "clients",
        "kvbaton turns",
        "turn 1 p50: kvbaton / floor / own",
        "turns 2.. p50: kvbaton / floor / work floor / over work",
        "turns 2.. p99: kvbaton / floor / work floor",
        "CPU ms/turn: kvbaton / floor / work floor",
        "kvbaton turns 2..",
    ]
    return [*lines, *table(header, rows), *loop_table(res), *reference_table(res)]


def added_ratio(cell: dict[str, Any], key: str) -> float:
    """kvbaton's added p50 over the floor against the reference proxy's (NaN without one)."""
    theirs = own(cell, key, arm="reference")
    return own(cell, key) / theirs if theirs > 0 else NAN


def reference_table(res: dict[str, Any]) -> list[str]:
    """vLLM's reference multi-turn proxy beside kvbaton and the floor, REFERENCE_CLIENTS clients."""
    if "reference" in res and not res["reference"]:
        return [
            f"vLLM's reference proxy (`disagg_proxy_multiturn.py`, {REFERENCE_CLIENTS} clients): "
            f"skipped, no vLLM tree (set `{VLLM_TREE_ENV}`).",
            "",
        ]
    rows = []
    rounds = 0
    for c in res["cells"]:
        if "reference" not in c:
            continue
        r = c["reference"]
        added = [own(c, key, arm="reference") for key in ("first", "later")]
        rows.append(
            [
                "stream" if c["stream"] else "json",
                f"{r['turns']} (+{r['failed']} failed)",
                f"{fmt(r['first']['p50'])} / {fmt(added[0])} / {fmt(own(c, 'first'))}",
                f"{fmt(r['later']['p50'])} / {fmt(added[1])} / {fmt(own(c, 'later'))}",
                f"{fmt(added_ratio(c, 'first'))} / {fmt(added_ratio(c, 'later'))}",
                spread(round_ratios(c, "later")),
                fmt(r["cpu_ms_per_turn"], 3),
            ]
        )
        rounds = c.get("rounds", rounds)
    if not rows:
        return []
    header = [
        "turns",
        "reference turns",
        "turn 1 p50: reference / its added / kvbaton's added",
        "turns 2.. p50: reference / its added / kvbaton's added",
        "kvbaton's added / the reference's: turn 1 / turns 2..",
        "the same, turns 2.., each round alone: lowest / median / highest",
        "reference CPU ms/turn",
    ]
    return [
        f"vLLM's reference multi-turn proxy (`disagg_proxy_multiturn.py`, copied out of a "
        "fetched vLLM tree at run time: round robin, D's handle kept per body "
        "`conversation_id` and sent to the next P, nothing verified) ran the same "
        f"conversations at {REFERENCE_CLIENTS} clients in the same alternating rounds "
        f"({rounds} of them, each with new conversations). *Added* is an arm's p50 minus the "
        "floor's, over all rounds' turns; a round alone shows how much one such figure moves:",
        "",
        *table(header, rows),
    ]


def loop_table(res: dict[str, Any]) -> list[str]:
    """kvbaton on uvloop (its default) against the same router on asyncio, 1 client."""
    rows = []
    for c in res["cells"]:
        if "asyncio" not in c:
            continue
        for loop, arm in (("uvloop (default)", c["kvbaton"]), ("asyncio", c["asyncio"])):
            rows.append(
                [
                    "stream" if c["stream"] else "json",
                    loop,
                    fmt(arm["first"]["p50"]),
                    fmt(arm["later"]["p50"]),
                    fmt(arm["cpu_ms_per_turn"], 3),
                    f"{arm['turns']} (+{arm['failed']} failed)",
                ]
            )
    if not rows:
        return []
    header = ["turns", "event loop", "turn 1 p50 ms", "turns 2.. p50 ms", "CPU ms/turn", "turns"]
    return [
        "The same conversations through the same router on each event loop (`--event-loop`),",
        "1 client, in the same alternating rounds:",
        "",
        *table(header, rows),
    ]


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.hitpath [--clients N ...] [--out FILE]`: section 1's hit path alone (full
    plan), at the given client counts (default: the full plan's), printing its tables."""
    p = argparse.ArgumentParser(prog="python -m bench.hitpath", description=main.__doc__)
    p.add_argument("--clients", type=int, nargs="+", default=list(FULL.hit_clients))
    p.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = p.parse_args(argv)
    plan = dataclasses.replace(FULL, hit_clients=tuple(args.clients))
    lg = LoadGen()
    try:
        res = run(plan, lg, lambda step: print(step, flush=True))
    finally:
        lg.close()
    print("\n".join(section(res)))
    if args.out:
        args.out.write_text(json.dumps(res, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
