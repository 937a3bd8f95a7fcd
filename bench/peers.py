"""8. Side by side with the routers users would pick instead (ARMS), each configured at its
best on the same simulators (2 P + 2 D, the H100/8B cost model, the engines' own 480 s pin TTL),
through the same seeded workloads (SCENARIOS). The arms cannot take turns on one set of engines
(what the engines hold is what is measured): each runs on fresh engines, round after round, the
order reversed every other round. A peer that cannot be fetched (PyPI, a vLLM tree) is skipped
with one line.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import pins, vllm_multiturn
from bench.peer_venv import PEERS_VENV, VLLM_TREE_ENV, vllm_copy, vllm_router
from bench.plan import Plan
from bench.screen import Screen, Table
from bench.stack import LoadGen, Tick, alternate, prompt_tokens, start_stack, tree_cpu_seconds
from bench.stats import fmt, summary_ms, turns_summary
from harness.procs import free_port, logged, redis_server, stop, wait_http
from harness.stack import Stack

EXAMPLES = "examples/disaggregated/disaggregated_serving"
MULTITURN_PROXY = f"{EXAMPLES}/disagg_proxy_multiturn.py"
PROXY_DEPS = ("fastapi", "httpx", "uvicorn")
DEMO_PROXY = f"{EXAMPLES}/disagg_proxy_demo.py"
DEMO_DEPS = ("aiohttp", "fastapi", "requests", "uvicorn", "uvloop")
TTFT_SLO_MS = 200.0  # goodput: turns whose first token came within this, per second
# D's KV: 8,192 blocks of 16 tokens each. An 8B model on one H100 holds ~30k such blocks; at
# the 3 conversations/s here, 8,192 blocks per D is what ~30k blocks are at ~11 per second.
D_ARGS = ["--num-blocks", "8192", "--stream-kv-params"]
# P at vLLM's defaults (issue 49): with bidirectional_kv_xfer it skips a D->P read of fewer
# than 64 tokens (kv_recompute_threshold), as users run it.
BIDIR = ["--bidirectional"]
# The store connector (MooncakeStoreConnector's model): P writes its prompt's blocks, every
# instance looks blocks up before computing; D also writes its output (LMCache's
# save_decode_cache), so the next turn's P finds the whole history in the store.
STORE = ["--kv-connector", "store"]
STORE_D = ["--kv-store-save-decode"]


@dataclass(frozen=True)
class Arm:
    name: str
    how: str  # how it is configured, for the report
    flags: tuple[str, ...]  # kvbaton's, or vllm-router's
    peer: str = ""  # "": kvbaton; else a kind of PEER_ARGV
    keeps_kv: bool = False  # the engines keep D's KV for P (bidirectional_kv_xfer)
    events: bool = False  # the engines publish KV events, the router subscribes
    store: bool = False  # the engines move KV through a shared store (a redis-server)


VLLM_ROUTER_PEER, VLLM_PROXY_PEER, VLLM_DEMO_PEER = "vllm-router", "vllm-proxy", "vllm-demo"
KVBATON = "kvbaton"
# vllm-router reads none of D's KV back, so its D keeps nothing for P (a D that did would fill
# with pins nobody releases: section 7's second arm).
ARMS = (
    Arm(
        "kvbaton",
        "reuse, affinity, pin releases (the defaults), and `--stream-kv-params` (a 0.33 D "
        "streams its handle anyway)",
        ("--stream-kv-params",),
        "",
        True,
    ),
    Arm("kvbaton, reuse off", "`--no-reuse`: affinity only", ("--no-reuse",)),
    Arm(
        "vllm-router cache_aware",
        "its default policy",
        ("--policy", "cache_aware"),
        VLLM_ROUTER_PEER,
    ),
    Arm(
        "vllm-router kv_aware + KV events",
        "`--policy kv_aware`, every P's KV events (`--pd-kv-events`)",
        ("--policy", "kv_aware"),
        VLLM_ROUTER_PEER,
        events=True,
    ),
    Arm(
        "vLLM's disagg_proxy_multiturn.py",
        "vLLM's example proxy (from a fetched vLLM tree): round robin, D's handle kept per "
        "`conversation_id` (body) and sent to P, nothing released",
        (),
        VLLM_PROXY_PEER,
        keeps_kv=True,
    ),
    Arm(
        "vllm-router consistent_hash",
        "`--policy consistent_hash` on `X-Session-ID`",
        ("--policy", "consistent_hash"),
        VLLM_ROUTER_PEER,
    ),
    Arm(
        "vLLM's disagg_proxy_demo.py",
        "vLLM's XpYd demo proxy (from a fetched vLLM tree): round robin over P and over D, P "
        "with `max_tokens` 1, then D, neither given `kv_transfer_params` (it has no handoff of "
        "its own: it is written for connectors that need none). At its best its engines share "
        "a KV store (`--kv-connector store`, the simulators' MooncakeStoreConnector model, D "
        "with `--kv-store-save-decode` as LMCache's `save_decode_cache`), so any P and D find "
        "the history there. The simulators charge a store read no modelled transfer time (a "
        "NIXL pull costs 0.05 ms a block), which flatters this arm's TTFT by up to ~13 ms on a "
        "4k-token prompt; its *P read from D* is what P read from the store",
        (),
        VLLM_DEMO_PEER,
        store=True,
    ),
)


def vllm_proxy(path: str, deps: tuple[str, ...]) -> str | None:
    """One of vLLM's example proxies, copied out of a fetched vLLM tree (vllm_copy)."""
    scratch = vllm_copy((path,), deps, f"the arm running vLLM's {Path(path).name}")
    return None if scratch is None else str(scratch / Path(path).name)


def proxy_argv(script: str, st: Stack, flags: tuple[str, ...], port: int) -> list[str]:
    argv = [str(PEERS_VENV / "bin" / "python"), script, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prefiller-hosts", *("127.0.0.1" for _ in st.ps)]
    argv += ["--prefiller-ports", *(str(p.port) for p in st.ps)]
    argv += ["--decoder-hosts", *("127.0.0.1" for _ in st.ds)]
    return [*argv, "--decoder-ports", *(str(d.port) for d in st.ds)]


def demo_argv(script: str, st: Stack, flags: tuple[str, ...], port: int) -> list[str]:
    argv = [str(PEERS_VENV / "bin" / "python"), script, "--model", "sim-model"]
    argv += ["--prefill", *(f"127.0.0.1:{p.port}" for p in st.ps)]
    argv += ["--decode", *(f"127.0.0.1:{d.port}" for d in st.ds)]
    return [*argv, "--port", str(port)]


def router_argv(exe: str, st: Stack, flags: tuple[str, ...], port: int) -> list[str]:
    """vllm-router in P/D mode."""
    argv = [exe, "--vllm-pd-disaggregation", "--kv-connector", "nixl"]
    argv += [x for p in st.ps for x in ("--prefill", p.url)]
    argv += [x for d in st.ds for x in ("--decode", d.url)]
    argv += [*flags, "--host", "127.0.0.1", "--port", str(port)]
    return [*argv, "--prometheus-port", str(free_port()), "--log-level", "warning"]


PEER_ARGV = {
    VLLM_PROXY_PEER: proxy_argv,
    VLLM_DEMO_PEER: demo_argv,
    VLLM_ROUTER_PEER: router_argv,
}


@contextlib.contextmanager
def peer(kind: str, exe: str, st: Stack, flags: tuple[str, ...] = ()) -> Iterator[tuple[str, Any]]:
    """A peer of this kind over the stack's engines: its URL and process."""
    port = free_port()
    argv = PEER_ARGV[kind](exe, st, flags, port)
    proc = logged(argv, kind)
    st.commands[kind] = argv
    # vLLM's demo proxy has no /health: it is up once /status answers.
    ready = "/status" if kind == VLLM_DEMO_PEER else "/health"
    try:
        wait_http(f"http://127.0.0.1:{port}{ready}", timeout=60, proc=proc)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        stop(proc)


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str  # for the report
    seconds: float  # of arrivals per arm and round, as a share of plan.peers_s
    full_rounds: int  # rounds in a full run (--quick: 1)
    p_blocks: int = 65536  # each P's KV (its prefix cache)
    workload: tuple[tuple[str, Any], ...] = ()  # what differs from section 7's workload
    d_fails_at: float | None = None  # when the second D is killed (share of the arrivals)
    max_model_len: int = 4096  # the engines'
    multiturn: bool = False  # vLLM's multi-turn benchmark drives it, not section 7's arrivals


SCENARIOS = (
    Scenario("arrivals", "D's memory's arrival process, answers of 20-60 tokens", 1.0, 2),
    Scenario(
        "P cache pressure",
        "the same arrivals with a small prefix cache on each P: 1,024 blocks (~16k tokens)",
        0.67,
        1,
        p_blocks=1024,
    ),
    Scenario(
        "long answers",
        "the same arrivals with answers of 300-600 tokens (reasoning, tool output)",
        0.67,
        1,
        # A 600-token answer streams for 4.5 s at 7.5 ms a token: a client waits longer.
        workload=(("output_tokens", (300, 600)), ("request_timeout_s", 60.0)),
    ),
    Scenario(
        "a D fails",
        "the same arrivals; the second D is killed (SIGKILL) halfway and not restarted",
        0.67,
        1,
        d_fails_at=0.5,
    ),
    Scenario(
        "vLLM's multi-turn benchmark",
        "vLLM's `benchmarks/multi_turn/benchmark_serving_multi_turn.py`, unchanged, on its "
        "own example config of synthetic conversations (up to 9 turns, a 5,000-token prefix)",
        0.0,  # it runs until every conversation has ended
        1,
        # Its longest conversations reach ~8k tokens (a 5,000-token prefix, 9 turns).
        max_model_len=16384,
        multiturn=True,
    ),
)
MULTITURN = SCENARIOS[-1]


def chosen(plan: Plan) -> tuple[list[Scenario], list[Arm]]:
    """--quick: the arrivals and vLLM's benchmark (on a smaller config), kvbaton and
    vllm-router's default policy."""
    if plan.quick:
        return [SCENARIOS[0], MULTITURN], [ARMS[0], ARMS[2]]
    return list(SCENARIOS), list(ARMS)


def steps(plan: Plan) -> int:
    scenarios, arms = chosen(plan)
    return sum(len(arms) * (1 if plan.quick else s.full_rounds) for s in scenarios)


# Each peer kind's executable, fetched where it is not the project's own (None: not fetched).
EXES: dict[str, Callable[[], str | None]] = {
    "": str,  # kvbaton, from the stack
    VLLM_ROUTER_PEER: vllm_router,
    VLLM_PROXY_PEER: lambda: vllm_proxy(MULTITURN_PROXY, PROXY_DEPS),
    VLLM_DEMO_PEER: lambda: vllm_proxy(DEMO_PROXY, DEMO_DEPS),
}


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    scenarios, wanted = chosen(plan)
    exes = {kind: EXES[kind]() for kind in dict.fromkeys(a.peer for a in wanted)}
    bench = vllm_multiturn.prepare(plan.quick) if MULTITURN in scenarios else None
    arms = [a for a in wanted if exes[a.peer] is not None]
    out: dict[str, Any] = {
        "scenarios": {},
        "skipped": [a.name for a in wanted if a not in arms],
        "skipped_scenarios": [MULTITURN.name] if MULTITURN in scenarios and not bench else [],
        "commands": {},
        "slo_ms": TTFT_SLO_MS,
    }
    for sc in scenarios:
        if sc.multiturn and bench is None:
            continue
        rounds = 1 if plan.quick else sc.full_rounds
        res = scenario(plan, lg, sc, arms, exes, bench, rounds, tick, out["commands"])
        out["scenarios"][sc.name] = res
    return without_turns(out)


def without_turns(out: dict[str, Any]) -> dict[str, Any]:
    """The results less each round's turns: the report reads the arms' summaries, and a full
    run's turns, answers included, are 6 MB of JSON."""
    for sc in out["scenarios"].values():
        for arm in sc["arms"].values():
            for r in arm["rounds"]:
                r.pop("turns", None)
                r.pop("unmeasured_answers", None)
    return out


def scenario(
    plan: Plan,
    lg: LoadGen,
    sc: Scenario,
    arms: list[Arm],
    exes: dict[str, str | None],
    bench: vllm_multiturn.Bench | None,
    rounds: int,
    tick: Tick,
    commands: dict[str, Any],
) -> dict[str, Any]:
    """One scenario through `arms`, each on fresh engines (bench.stack.alternate): its result
    as the report keeps it. `exes`: each peer kind's executable; `bench` drives a multi-turn
    scenario; `commands` collects each arm's command lines."""
    by_name = {a.name: a for a in arms}

    def one_arm(name: str, rnd: int) -> dict[str, Any]:
        arm, driver = by_name[name], bench if sc.multiturn else None
        result, commands[f"{sc.name} / {name}"] = one(plan, lg, sc, arm, exes[arm.peer], driver)
        return result

    seconds = plan.peers_s * sc.seconds
    done = alternate(list(by_name), rounds, tick, f"peers: {sc.name}", one_arm)
    res: dict[str, Any] = {
        name: {"how": by_name[name].how, "rounds": r} for name, r in done.items()
    }
    for arm_res in res.values():
        arm_res["summary"] = summarize(arm_res["rounds"], seconds)
    answers_compared(res)
    return {"what": sc.what, "seconds": seconds, "rounds": rounds, "arms": res}


@contextlib.contextmanager
def arm_stack(
    plan: Plan, sc: Scenario, arm: Arm, exe: str | None
) -> Iterator[tuple[Stack, str, Any]]:
    """Fresh engines for one arm and scenario, and the arm's router in front of them: the
    stack, the router's URL and its process."""
    with contextlib.ExitStack() as exits:
        p = ["--num-blocks", str(sc.p_blocks), "--max-model-len", str(sc.max_model_len)]
        p += [*plan.gpu.sim_args(), *(BIDIR if arm.keeps_kv else [])]
        d = [*D_ARGS, "--max-model-len", str(sc.max_model_len), *plan.gpu.sim_args()]
        d += BIDIR if arm.keeps_kv else []
        if arm.store:
            store = exits.enter_context(redis_server())[0]
            p += [*STORE, "--kv-store", store]
            d += [*STORE, "--kv-store", store, *STORE_D]
        # In P/D mode vllm-router's kv_aware policy follows P's KV events only.
        ports = [free_port() for _ in range(2)] if arm.events else []
        events = [["--kv-events-port", str(port)] for port in ports] or [[], []]
        st = exits.enter_context(
            start_stack(
                prefill=[[*p, *events[0]], [*p, *events[1]]],
                decode=[d, d],
                routers=[] if arm.peer else [list(arm.flags)],
                redis=not arm.peer,
                name="peers",
            )
        )
        assert exe is not None
        if arm.peer:
            flags = list(arm.flags)
            for sim, port in zip(st.ps, ports, strict=False):
                flags += ["--pd-kv-events", f"{sim.url}=tcp://127.0.0.1:{port}"]
            url, proc = exits.enter_context(peer(arm.peer, exe, st, tuple(flags)))
        else:
            url, proc = st.url, st.routers[0].proc
        yield st, url, proc


def one(
    plan: Plan,
    lg: LoadGen,
    sc: Scenario,
    arm: Arm,
    exe: str | None,
    bench: vllm_multiturn.Bench | None,
) -> tuple[dict[str, Any], Any]:
    """One arm through one scenario on fresh engines: its turns, router CPU, engine tokens."""
    with arm_stack(plan, sc, arm, exe) as (st, url, proc):
        cpu0 = tree_cpu_seconds(proc.pid)
        with pins.Sampler(*(x.url for x in st.ds)) as sampler:
            if bench is not None:
                res = vllm_multiturn.run(bench, url, arm.name)
            else:
                res = arrivals(plan, lg, sc, arm, url, st)
        return {
            **res,
            "cpu_s": tree_cpu_seconds(proc.pid) - cpu0,
            "tokens": prompt_tokens(st),  # less the D this scenario killed
            "pinned_max": max((s["pinned"] for s in sampler.samples), default=0.0),
        }, dict(st.commands)


def arrivals(
    plan: Plan, lg: LoadGen, sc: Scenario, arm: Arm, url: str, st: Stack
) -> dict[str, Any]:
    """Section 7's arrival process (with the scenario's changes) through url: its turns."""
    spec = pins.job(plan, url)
    spec.update(dict(sc.workload), duration_s=plan.peers_s * sc.seconds, seed=900)
    # vLLM's example proxy reads only a body conversation_id (kvbaton reads both).
    spec["target"]["session_header"] = arm.peer != VLLM_PROXY_PEER
    with contextlib.ExitStack() as exits:
        if sc.d_fails_at is not None:
            killer = threading.Timer(spec["duration_s"] * sc.d_fails_at, st.ds[1].proc.kill)
            killer.start()
            exits.callback(killer.cancel)
        res = lg.run(spec, timeout=spec["duration_s"] + spec["drain_s"] + 60.0)
    return {"turns": res["turns"]}


def summarize(rounds: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    turns = [t for r in rounds for t in r["turns"]]
    s = turns_summary(turns)
    # vLLM's benchmark runs until its conversations end: its own time, not a set length.
    total_s = sum(r.get("seconds", seconds) for r in rounds)
    # P's tokens loaded from elsewhere are D's KV it read; D's are P's prefill handed over.
    pulled = sum(r["tokens"]["P"].get("external_kv_transfer", 0.0) for r in rounds)
    good = sum(t["ok"] and t["ttft"] * 1000 <= TTFT_SLO_MS for t in turns)
    return {
        "turns": s["turns"],
        "failed": s["failed"],
        "unmeasured": sum(r.get("unmeasured", 0) for r in rounds),
        "ttft_first": s["first"],
        "ttft_later": s["later"],
        "itl": summary_ms([t["itl"] for t in turns if t["ok"] and t.get("itl")]),
        "goodput": good / max(total_s, 1e-9),
        "p_computed": sum(r["tokens"]["P"].get("local_compute", 0.0) for r in rounds),
        "d_computed": sum(r["tokens"]["D"].get("local_compute", 0.0) for r in rounds),
        "pulled_from_d": pulled,
        "cpu_ms_per_turn": 1000 * sum(r["cpu_s"] for r in rounds) / max(1, len(turns)),
        "pinned_max": max((r["pinned_max"] for r in rounds), default=0.0),
        "reuse": s["reuse"],
    }


def router_cpu(arms: dict[str, Any]) -> tuple[float | None, float | None]:
    """Router CPU ms per turn of kvbaton and vllm-router's default policy (None for an arm
    that did not run)."""
    cpu = {name: arm["summary"]["cpu_ms_per_turn"] for name, arm in arms.items()}
    return cpu.get(ARMS[0].name), cpu.get(ARMS[2].name)


def answers_compared(arms: dict[str, Any]) -> None:
    """Each arm's answers against kvbaton's, turn by turn (the same seeded conversations):
    how many turns both answered, and how many of those differ."""

    def answers(arm: dict[str, Any]) -> dict[tuple[int, Any, int], str]:
        found = {
            (i, t["conv"], t["turn"]): t["answer"]
            for i, r in enumerate(arm["rounds"])
            for t in r["turns"]
            if t["ok"] and t.get("answer") is not None  # vLLM's benchmark: ended conversations
        }
        for i, r in enumerate(arm["rounds"]):  # vLLM's benchmark: answered, not measured
            found.update(((i, c, n), a) for c, n, a in r.get("unmeasured_answers", ()))
        return found

    base = answers(arms[ARMS[0].name])
    for arm in arms.values():
        mine = answers(arm)
        both = base.keys() & mine.keys()
        arm["summary"]["compared"] = len(both)
        arm["summary"]["differ"] = sum(base[k] != mine[k] for k in both)


def arm_names(scenarios: dict[str, Any]) -> list[str]:
    """Every scenario's arms, in the order they first appear."""
    names: list[str] = []
    for sc in scenarios.values():
        names += [a for a in sc["arms"] if a not in names]
    return names


def later_cell(s: dict[str, Any] | None) -> str:
    """Later-turn TTFT p50 / p90 (ms) and the failed turns, where any."""
    if s is None:
        return "n/a"
    later = s["ttft_later"]
    text = f"{fmt(later['p50'], 0)} / {fmt(later['p90'], 0)}"
    return text + (f" ({s['failed']} of {s['turns']} failed)" if s["failed"] else "")


def summary_table(scenarios: dict[str, Any]) -> Table:
    """Later-turn TTFT per arm and scenario: the one table that says who wins."""
    rows = [
        [arm, *(later_cell(sc["arms"].get(arm, {}).get("summary")) for sc in scenarios.values())]
        for arm in arm_names(scenarios)
    ]
    return Table(["arm", *scenarios], rows)


def winners(scenarios: dict[str, Any]) -> list[str]:
    """Per scenario, the arm lowest at later-turn p50, and kvbaton's figures where it is not."""
    out = []
    for name, sc in scenarios.items():
        later = {a: r["summary"]["ttft_later"] for a, r in sc["arms"].items()}
        best = min(later, key=lambda a: later[a]["p50"])
        b, mine = later[best], later.get(KVBATON)
        if best == KVBATON:
            out.append(f"- {name}: kvbaton is lowest, {fmt(b['p50'], 1)} / {fmt(b['p90'], 1)} ms.")
        elif mine is not None:
            out.append(
                f"- {name}: **{best}** is lowest, {fmt(b['p50'], 1)} / {fmt(b['p90'], 1)} ms "
                f"against kvbaton's {fmt(mine['p50'], 1)} / {fmt(mine['p90'], 1)}."
            )
    return out


def _itl(itl: dict[str, Any] | None) -> str:
    """Every streamed turn's mean gap between events, p50 / p99 (n/a: results without it)."""
    itl = itl or {}
    return f"{fmt(itl.get('p50'), 1)} / {fmt(itl.get('p99'), 1)}"


def detail_table(sc: dict[str, Any]) -> Table:
    header = ["arm", "turns (failed)", "TTFT turn 1 p50 / p90 ms", "ITL p50 / p99 ms"]
    header += ["goodput /s", "P computed", "P read from D", "D pinned at most"]
    header += ["router CPU ms/turn", "answers unlike kvbaton's"]
    rows = []
    for name, arm in sc["arms"].items():
        s = arm["summary"]
        first = f"{fmt(s['ttft_first']['p50'], 0)} / {fmt(s['ttft_first']['p90'], 0)}"
        row = [name, f"{s['turns']} ({s['failed']})", first, _itl(s.get("itl"))]
        row += [f"{s['goodput']:.2f}", f"{s['p_computed']:,.0f}", f"{s['pulled_from_d']:,.0f}"]
        row += [f"{s['pinned_max']:.0%}", f"{s['cpu_ms_per_turn']:.2f}"]
        rows.append([*row, f"{s['differ']} of {s['compared']}"])
    return Table(header, rows)


def screens(res: dict[str, Any], plan: Plan) -> list[Screen]:
    scenarios = res["scenarios"]
    skipped = [*res["skipped"], *res.get("skipped_scenarios", [])]
    what = "; ".join(f"*{name}*: {sc['what']}" for name, sc in scenarios.items())
    question = (
        "Which router gives the lowest time to first token after a conversation's first turn? "
        f"{plan.pins_rate:g} conversations/s through 2 P and 2 D simulators, each arm on fresh "
        f"engines, the arms' order reversed every other round. {what}. TTFT after turn 1, "
        "p50 / p90 in ms; the second table is the first scenario's."
    )
    answer = winners(scenarios)
    if skipped:
        answer.append(f"- skipped: {', '.join(skipped)} (no vLLM tree: set `{VLLM_TREE_ENV}`).")
    first = next(iter(scenarios), None)
    tables = [summary_table(scenarios)] if scenarios else []
    if first is not None:
        tables.append(detail_table(scenarios[first]))
    kv = scenarios[first]["arms"].get(KVBATON, {}).get("summary") if first else None
    if kv:
        plans = ", ".join(f"{k} {v}" for k, v in sorted(kv["reuse"].items()))
        answer.append(f"- kvbaton's later turns on {first} by `X-KV-Reuse`: {plans or 'none'}.")
    how: dict[str, str] = {}
    for sc in scenarios.values():
        how.update((n, arm["how"]) for n, arm in sc["arms"].items() if n not in how)
    answer += ["", "The arms:", *(f"- {name}: {text}" for name, text in how.items())]
    plot = "bench-peers.png" if scenarios else None
    return [Screen("Side by side with other routers", question, tables, answer, plot)]
