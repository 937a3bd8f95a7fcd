"""1b. The hit path: conversations with history through kvbaton and through the floor.

Every turn after the first claims its session, asks P's `/tokenize`, verifies the prefix,
sends the token-ids P leg with D's handle and commits. The same seeded conversations also go
through the floor (two legs, nothing else) and the work floor (the floor plus a hit's
/tokenize and Redis claim and commit, bare: bench/passthrough.py); kvbaton minus floor per
turn is the router's own work on hits.
"""

from __future__ import annotations

import contextlib
from typing import Any

from bench import peers
from bench.plan import Plan
from bench.stack import LoadGen, Tick, passthrough, start_stack, timed
from bench.stats import fmt, turns_summary
from bench.workload import NONSTREAM_TOKENS, STREAM_TOKENS, SYSTEM_WORDS, USER_WORDS
from harness.stack import Stack, argv_of

# Zero-cost, bidirectional; D streams its handle (PR #40186) so streamed turns hit too.
P_ARGS = ["--bidirectional", "--kv-recompute-threshold", "0", "--num-blocks", "65536"]
D_ARGS = ["--bidirectional", "--stream-kv-params", "--num-blocks", "65536"]
# The floor never releases D's pins (kvbaton releases the last turn's): a short TTL.
D_ARGS += ["--decoder-kv-blocks-ttl", "60"]
# Pull only: every turn takes P's leg as the floor's do (at 16 clients the decode plan would
# run some on D alone, `hit;via=decode`).
ROUTER_ARGS = ["--stream-kv-params", "--decode-local-max-tokens", "0"]
ENGINES: dict[str, Any] = {"prefill_args": [P_ARGS], "decode_args": [D_ARGS]}


def hit_stack(name: str) -> contextlib.AbstractContextManager[Stack]:
    """The hit path's engines and one kvbaton with its flags (section 1, 2's hit turns, 5)."""
    return start_stack(**ENGINES, router_args=[ROUTER_ARGS], name=name)


def job(plan: Plan, url: str, *, stream: bool, clients: int, rnd: int, ids: bool) -> dict[str, Any]:
    tokens = STREAM_TOKENS if stream else NONSTREAM_TOKENS
    spec: dict[str, Any] = {"kind": "conversations", "target": {"mode": "router", "urls": [url]}}
    spec.update(conversation_ids=ids, n=max(plan.hit_min_convs, 2 * clients), seed=500 + rnd)
    spec.update(turns=plan.hit_turns, concurrency=clients, stream=stream, jitter_s=0.0)
    spec.update(system_words=(SYSTEM_WORDS,) * 2, user_words=(USER_WORDS,) * 2)
    spec.update(output_tokens=(tokens, tokens), deadline_s=180.0, request_timeout_s=60.0)
    return spec


# The concurrency at which vLLM's reference multi-turn proxy runs beside kvbaton.
REFERENCE_CLIENTS = 16


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    out: dict[str, Any] = {"cells": []}
    # vLLM's disagg_proxy_multiturn.py, copied at run time out of a fetched vLLM tree.
    script = None
    if REFERENCE_CLIENTS in plan.hit_clients:
        script = peers.vllm_proxy(peers.MULTITURN_PROXY, peers.PROXY_DEPS)
    out["reference"] = script is not None
    with hit_stack("hitpath") as st, contextlib.ExitStack() as exits:
        assert st.redis_url is not None
        p, d = st.ps[0].url, st.ds[0].url
        floor_app = exits.enter_context(passthrough(p, d, "hitpath-floor"))
        work_app = exits.enter_context(passthrough(p, d, "hitpath-work", st.redis_url))
        st.commands["floor"] = argv_of(floor_app.proc)
        st.commands["work floor"] = argv_of(work_app.proc)
        arms = {"floor": (floor_app.url, floor_app.proc.pid)}
        arms["work"] = (work_app.url, work_app.proc.pid)
        if script is not None:
            url, proc = exits.enter_context(peers.peer(peers.VLLM_PROXY_PEER, script, st))
            arms["reference"] = (url, proc.pid)
        for clients in plan.hit_clients:
            tick(f"hit path json c={clients}")
            out["cells"].append(_cell(plan, st, lg, arms, clients))
        out["commands"] = st.commands
    return out


def steps(plan: Plan) -> int:
    return len(plan.hit_clients)


def _cell(
    plan: Plan, st: Stack, lg: LoadGen, others: dict[str, tuple[str, int]], clients: int
) -> dict[str, Any]:
    """kvbaton, the floor and the work floor (at REFERENCE_CLIENTS vLLM's reference proxy
    too, where there is one) in alternating rounds, each round new conversations. `others`:
    each other arm's URL and process id."""
    arms = {"kvbaton": (st.url, st.router.proc.pid)}
    arms |= {a: v for a, v in others.items() if a != "reference" or clients == REFERENCE_CLIENTS}
    order = list(arms)
    turns: dict[str, list[dict[str, Any]]] = {arm: [] for arm in order}
    cpu = dict.fromkeys(order, 0.0)
    rounds = plan.hit_reference_rounds if "reference" in arms else plan.hit_rounds
    by_round: list[dict[str, Any]] = []  # each round's latencies, where the reference runs
    for rnd in range(rounds):
        this: dict[str, list[dict[str, Any]]] = {}
        for arm in order if rnd % 2 == 0 else order[::-1]:
            url, pid = arms[arm]
            spec = job(plan, url, stream=False, clients=clients, rnd=rnd, ids=arm != "floor")
            res, used, _ = timed(st, lg, spec, pid)
            this[arm] = res["turns"]
            turns[arm] += this[arm]
            cpu[arm] += used
        if "reference" in arms:
            by_round.append({arm: turns_summary(rows, "latency") for arm, rows in this.items()})
    cell: dict[str, Any] = {"stream": False, "concurrency": clients, "rounds": rounds}
    if by_round:
        cell["by_round"] = by_round
    for arm, rows in turns.items():
        cpu_ms = cpu[arm] / max(1, len(rows)) * 1000.0
        cell[arm] = {**turns_summary(rows, "latency"), "cpu_ms_per_turn": cpu_ms}
    return cell


def round_ratios(cell: dict[str, Any], key: str) -> list[float]:
    """`added_ratio` of each round alone where the reference ran (NaN ones left out)."""
    ratios = (added_ratio(r, key) for r in cell.get("by_round", []))
    return [x for x in ratios if x == x]


def own(cell: dict[str, Any], key: str, floor: str = "floor", arm: str = "kvbaton") -> float:
    """An arm minus a floor ("floor" or "work"), p50 ms of "first" or "later" turns (NaN
    without either)."""
    if floor not in cell or arm not in cell:
        return float("nan")
    return float(cell[arm][key]["p50"] - cell[floor][key]["p50"])


def added_ratio(cell: dict[str, Any], key: str) -> float:
    """kvbaton's added p50 over the floor against the reference proxy's (NaN without one)."""
    theirs = own(cell, key, arm="reference")
    return own(cell, key) / theirs if theirs > 0 else float("nan")


def rows(res: dict[str, Any] | None) -> list[list[str]]:
    """Section 1's table rows of hit turns (turns 2..): p50, kvbaton minus floor, CPU."""
    out = []
    for c in (res or {}).get("cells", []):
        k, f = c["kvbaton"]["later"], c["floor"]["later"]
        cpu = (c[a]["cpu_ms_per_turn"] for a in ("kvbaton", "floor"))
        out.append(
            [
                "hits (turns 2..), JSON",
                str(c["concurrency"]),
                f"- / {fmt(f['p50'])} / {fmt(k['p50'])}",
                f"{fmt(k['p50'] - f['p50'])} / {fmt(k['p99'] - f['p99'])}",
                " / ".join(fmt(x, 3) for x in cpu),
            ]
        )
    return out


def answer(res: dict[str, Any] | None) -> str:
    """The hit path's part of section 1's answer: the first cell's own p50 and CPU."""
    cells = (res or {}).get("cells", [])
    if not cells:
        return ""
    c, n = cells[0], cells[0]["concurrency"]
    k, f = c["kvbaton"]["cpu_ms_per_turn"], c["floor"]["cpu_ms_per_turn"]
    more = f"{fmt(own(c, 'later'))} ms ({fmt(k, 3)} vs {fmt(f, 3)} ms CPU)"
    return f"; on hits at {n} client{'s' * (n != 1)} {more}"
