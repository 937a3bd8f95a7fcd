"""8. Side by side with the routers users would pick instead, on an arrival process.

The arms, each configured at its best on the same simulators (2 P + 2 D, the H100/8B cost
model, the engines' own 480 s pin TTL) and the same seeded arrivals as section 7:
- kvbaton as shipped: reuse of D's KV, affinity, pin releases; the engines keep D's KV for P
  (`bidirectional_kv_xfer`) and stream their handle;
- kvbaton with `--no-reuse`: affinity only; D keeps nothing for P;
- vLLM's own multi-turn example proxy, `disagg_proxy_multiturn.py`, copied at run time out of
  a fetched vLLM tree (never into the project; skipped with one line without one): round
  robin over P and D, D's handle kept per body `conversation_id` and sent to the next P,
  nothing released;
- vLLM's Rust router `vllm-router` from PyPI, in its own venv (`.venv-peers`), P/D over NIXL,
  with its default policy `cache_aware`, with `kv_aware` fed every P's KV events (all it
  follows in P/D mode), and with `consistent_hash`, which hashes the `X-Session-ID` header
  every arm's client sends (kvbaton reads the same header). None of them reads D's KV back,
  so their D keeps nothing for P (a D that did would fill with pins nobody releases: section
  7's second arm).
The workloads (SCENARIOS): section 7's arrivals; the same with a small prefix cache on P; with
long answers; with one D killed halfway. The arms cannot take turns on one set of engines (what
the engines hold is what is measured): each runs on fresh engines, round after round, the order
reversed every other round. Where PyPI is unreachable the vllm-router arms are skipped with
one line.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import pins
from bench.plan import Plan
from bench.stack import LoadGen, by_source, start_stack, tree_cpu_seconds
from bench.stats import fmt, summary_ms
from tests.support.procs import ROOT, free_port, log_file, stop, wait_http
from tests.support.stack import Stack

Tick = Callable[[str], None]

VLLM_ROUTER = "vllm-router==0.1.17"
PEERS_VENV = ROOT / ".venv-peers"
MULTITURN_PROXY = "examples/disaggregated/disaggregated_serving/disagg_proxy_multiturn.py"
PROXY_DEPS = ("fastapi", "httpx", "uvicorn")
VLLM_TREE_ENV = "KVBATON_VLLM_TREE"
VLLM_MIRROR = "/work/.mirror/eigen-hub+vllm/repo"
TTFT_SLO_MS = 200.0  # goodput: turns whose first token came within this, per second
# D's KV: 8,192 blocks of 16 tokens each. An 8B model on one H100 holds ~30k such blocks; at
# the 3 conversations/s here, 8,192 blocks per D is what ~30k blocks are at ~11 per second.
D_ARGS = ["--num-blocks", "8192", "--max-model-len", "4096", "--stream-kv-params"]
BIDIR_P = ["--bidirectional", "--kv-recompute-threshold", "0"]
BIDIR_D = ["--bidirectional"]


@dataclass(frozen=True)
class Arm:
    name: str
    how: str  # how it is configured, for the report
    flags: tuple[str, ...]  # kvbaton's, or vllm-router's
    peer: str = ""  # "": kvbaton; VLLM_ROUTER_PEER or VLLM_PROXY_PEER
    keeps_kv: bool = False  # the engines keep D's KV for P (bidirectional_kv_xfer)
    events: bool = False  # the engines publish KV events, the router subscribes


VLLM_ROUTER_PEER, VLLM_PROXY_PEER = "vllm-router", "vllm-proxy"
ARMS = (
    Arm("kvbaton", "defaults: reuse, affinity, pin releases", ("--stream-kv-params",), "", True),
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
)


def vllm_router() -> str | None:
    """vllm-router's executable, installed into .venv-peers on first use; None (and one line
    saying why) where it cannot be installed."""
    exe = PEERS_VENV / "bin" / "vllm-router"
    if exe.exists():
        return str(exe)
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", str(PEERS_VENV)], check=True, capture_output=True
        )
        subprocess.run(
            [str(PEERS_VENV / "bin" / "pip"), "install", "-q", VLLM_ROUTER],
            check=True,
            capture_output=True,
            timeout=600,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        detail = getattr(exc, "stderr", b"") or b""
        print(
            f"peers: vllm-router arms skipped: `pip install {VLLM_ROUTER}` failed ({exc}; "
            f"{detail.decode(errors='replace').strip()[-200:]})",
            file=sys.stderr,
        )
        return None
    return str(exe)


def vllm_proxy() -> str | None:
    """vLLM's disagg_proxy_multiturn.py, copied out of a fetched vLLM tree into a scratch
    folder (never into the project), with what it imports installed into .venv-peers; None
    (and one line saying why) without a tree. The tree: $KVBATON_VLLM_TREE (a checkout or a
    git directory), else the search tool's mirror of vLLM when it was fetched here."""
    tree = Path(os.environ.get(VLLM_TREE_ENV) or VLLM_MIRROR)
    script = Path(tempfile.gettempdir()) / "kvbaton-peers" / Path(MULTITURN_PROXY).name
    try:
        if (tree / MULTITURN_PROXY).is_file():
            text = (tree / MULTITURN_PROXY).read_bytes()
        else:
            show = ["git", "--git-dir", str(tree), "show", f"HEAD:{MULTITURN_PROXY}"]
            text = subprocess.run(show, check=True, capture_output=True, timeout=60).stdout
        script.parent.mkdir(exist_ok=True)
        script.write_bytes(text)
        if vllm_router() is None:  # the venv (its deps bring fastapi and uvicorn)
            return None
        pip = [str(PEERS_VENV / "bin" / "pip"), "install", "-q", *PROXY_DEPS]
        subprocess.run(pip, check=True, capture_output=True, timeout=600)
    except (subprocess.SubprocessError, OSError) as exc:
        print(
            f"peers: vLLM's proxy arm skipped: no {MULTITURN_PROXY} from a vLLM tree at {tree} "
            f"(set {VLLM_TREE_ENV}) or its dependencies did not install ({exc})",
            file=sys.stderr,
        )
        return None
    return str(script)


@contextlib.contextmanager
def peer_proxy(script: str, st: Stack) -> Iterator[tuple[str, Any]]:
    """vLLM's multi-turn example proxy over the stack's engines; its URL and process."""
    port = free_port()
    argv = [str(PEERS_VENV / "bin" / "python"), script, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prefiller-hosts", *("127.0.0.1" for _ in st.ps)]
    argv += ["--prefiller-ports", *(str(p.port) for p in st.ps)]
    argv += ["--decoder-hosts", *("127.0.0.1" for _ in st.ds)]
    argv += ["--decoder-ports", *(str(d.port) for d in st.ds)]
    yield from _peer_process(argv, st, "vllm-proxy", port)


@contextlib.contextmanager
def peer_router(exe: str, st: Stack, flags: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    """vllm-router in P/D mode over the stack's engines; its URL and process."""
    port = free_port()
    argv = [exe, "--vllm-pd-disaggregation", "--kv-connector", "nixl"]
    for p in st.ps:
        argv += ["--prefill", p.url]
    for d in st.ds:
        argv += ["--decode", d.url]
    argv += [*flags, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--prometheus-port", str(free_port()), "--log-level", "warning"]
    yield from _peer_process(argv, st, "vllm-router", port)


def _peer_process(argv: list[str], st: Stack, name: str, port: int) -> Iterator[tuple[str, Any]]:
    path = log_file(name)
    path.parent.mkdir(exist_ok=True)
    with open(path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
    st.commands[name] = argv
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=60, proc=proc)
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


SCENARIOS = (
    Scenario("arrivals", "section 7's arrival process", 1.0, 2),
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
)


def chosen(plan: Plan) -> tuple[list[Scenario], list[Arm]]:
    """--quick: the arrivals only, kvbaton and vllm-router's default policy."""
    if plan.quick:
        return [SCENARIOS[0]], [ARMS[0], ARMS[2]]
    return list(SCENARIOS), list(ARMS)


def steps(plan: Plan) -> int:
    scenarios, arms = chosen(plan)
    return len(arms) * sum(1 if plan.quick else s.full_rounds for s in scenarios)


def run(plan: Plan, lg: LoadGen, tick: Tick) -> dict[str, Any]:
    scenarios, wanted = chosen(plan)
    exes: dict[str, str | None] = {"": None}
    if any(a.peer == VLLM_ROUTER_PEER for a in wanted):
        exes[VLLM_ROUTER_PEER] = vllm_router()
    if any(a.peer == VLLM_PROXY_PEER for a in wanted):
        exes[VLLM_PROXY_PEER] = vllm_proxy()
    arms = [a for a in wanted if not a.peer or exes[a.peer] is not None]
    out: dict[str, Any] = {
        "scenarios": {},
        "skipped": [a.name for a in wanted if a not in arms],
        "commands": {},
        "slo_ms": TTFT_SLO_MS,
    }
    for sc in scenarios:
        rounds = 1 if plan.quick else sc.full_rounds
        seconds = plan.peers_s * sc.seconds
        res: dict[str, Any] = {"what": sc.what, "seconds": seconds, "rounds": rounds, "arms": {}}
        res["arms"] = {a.name: {"how": a.how, "rounds": []} for a in arms}
        for rnd in range(rounds):
            for arm in arms if rnd % 2 == 0 else list(reversed(arms)):
                tick(f"peers: {sc.name}, {arm.name}, round {rnd + 1}")
                result, commands = one(plan, lg, sc, arm, exes[arm.peer])
                res["arms"][arm.name]["rounds"].append(result)
                out["commands"][f"{sc.name} / {arm.name}"] = commands
        for arm_res in res["arms"].values():
            arm_res["summary"] = summarize(arm_res["rounds"], seconds)
        answers_compared(res["arms"])
        out["scenarios"][sc.name] = res
    return out


def one(
    plan: Plan, lg: LoadGen, sc: Scenario, arm: Arm, exe: str | None
) -> tuple[dict[str, Any], Any]:
    p = ["--num-blocks", str(sc.p_blocks), *plan.gpu.sim_args()]
    p += BIDIR_P if arm.keeps_kv else []
    d = [*D_ARGS, *plan.gpu.sim_args(), *(BIDIR_D if arm.keeps_kv else [])]
    # In P/D mode vllm-router's kv_aware policy follows P's KV events only.
    ports = [free_port() for _ in range(2)] if arm.events else []
    events = [["--kv-events-port", str(port)] for port in ports] or [[], []]
    with start_stack(
        prefill_args=[[*p, *events[0]], [*p, *events[1]]],
        decode_args=[d, d],
        router_args=[] if arm.peer else [list(arm.flags)],
        with_redis=not arm.peer,
        name="peers",
    ) as st:
        with contextlib.ExitStack() as exits:
            if arm.peer == VLLM_PROXY_PEER:
                assert exe is not None
                url, proc = exits.enter_context(peer_proxy(exe, st))
            elif arm.peer:
                assert exe is not None
                flags = list(arm.flags)
                for sim, port in zip(st.ps, ports, strict=False):
                    flags += ["--pd-kv-events", f"{sim.url}=tcp://127.0.0.1:{port}"]
                url, proc = exits.enter_context(peer_router(exe, st, tuple(flags)))
            else:
                url, proc = st.url, st.routers[0].proc
            spec = pins.job(plan, url)
            spec.update(dict(sc.workload), duration_s=plan.peers_s * sc.seconds, seed=900)
            # vLLM's example proxy reads only a body conversation_id (kvbaton reads both).
            spec["target"]["session_header"] = arm.peer != VLLM_PROXY_PEER
            if sc.d_fails_at is not None:
                killer = threading.Timer(spec["duration_s"] * sc.d_fails_at, st.ds[1].proc.kill)
                killer.start()
                exits.callback(killer.cancel)
            cpu0 = tree_cpu_seconds(proc.pid)
            with pins.Sampler(*(x.url for x in st.ds)) as sampler:
                res = lg.run(spec, timeout=spec["duration_s"] + spec["drain_s"] + 60.0)
            cpu = tree_cpu_seconds(proc.pid) - cpu0
        tokens: dict[str, dict[str, float]] = {"P": {}, "D": {}}
        for role, sims in (("P", st.ps), ("D", st.ds)):
            for sim in sims:
                if sim.proc.poll() is not None:
                    continue  # the D this scenario killed
                for source, n in by_source(sim.url).items():
                    tokens[role][source] = tokens[role].get(source, 0.0) + n
        return {
            "turns": res["turns"],
            "cpu_s": cpu,
            "tokens": tokens,
            "pinned_max": max((s["pinned"] for s in sampler.samples), default=0.0),
        }, dict(st.commands)


def summarize(rounds: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    turns = [t for r in rounds for t in r["turns"]]
    ok = [t for t in turns if t["ok"]]
    first = [t["ttft"] for t in ok if t["turn"] == 1]
    later = [t["ttft"] for t in ok if t["turn"] > 1]
    seconds *= len(rounds)
    # P's tokens loaded from elsewhere are D's KV it read; D's are P's prefill handed over.
    pulled = sum(r["tokens"]["P"].get("external_kv_transfer", 0.0) for r in rounds)
    return {
        "turns": len(turns),
        "failed": len(turns) - len(ok),
        "ttft_first": summary_ms(first),
        "ttft_later": summary_ms(later),
        "goodput": sum(t["ttft"] * 1000 <= TTFT_SLO_MS for t in ok) / seconds,
        "p_computed": sum(r["tokens"]["P"].get("local_compute", 0.0) for r in rounds),
        "d_computed": sum(r["tokens"]["D"].get("local_compute", 0.0) for r in rounds),
        "pulled_from_d": pulled,
        "cpu_ms_per_turn": 1000 * sum(r["cpu_s"] for r in rounds) / max(1, len(turns)),
        "pinned_max": max((r["pinned_max"] for r in rounds), default=0.0),
        "reuse": _reuse(ok),
    }


def _reuse(turns: list[dict[str, Any]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in turns:
        if t["turn"] > 1 and t["reuse"]:
            word = t["reuse"].split(";")[0]
            out[word] = out.get(word, 0) + 1
    return out


def answers_compared(arms: dict[str, Any]) -> None:
    """Each arm's answers against kvbaton's, turn by turn (the same seeded conversations):
    how many turns both answered, and how many of those differ."""

    def answers(arm: dict[str, Any]) -> dict[tuple[int, int, int], str]:
        return {
            (i, t["conv"], t["turn"]): t["answer"]
            for i, r in enumerate(arm["rounds"])
            for t in r["turns"]
            if t["ok"]
        }

    base = answers(arms[ARMS[0].name])
    for arm in arms.values():
        mine = answers(arm)
        both = base.keys() & mine.keys()
        arm["summary"]["compared"] = len(both)
        arm["summary"]["differ"] = sum(base[k] != mine[k] for k in both)


def section(res: dict[str, Any], plan: Plan) -> list[str]:
    lines = [
        "## 8. Side by side with other routers",
        "",
        f"Section 7's arrival process ({plan.pins_rate:g} conversations/s) and variants of it, "
        "through 2 P and 2 D simulators (8,192 blocks each: an 8B model on one H100 holds ~30k "
        "blocks of 16 tokens, so 8,192 at 3 conversations/s stands for ~30k at ~11/s) with the "
        "H100/8B cost model and the engines' own 480 s pin TTL; each arm on fresh engines, the "
        "arms in reversed order every other round. Every client sends its conversation's id as "
        "`X-Session-ID`. Goodput: turns whose first token came within "
        f"{res['slo_ms']:g} ms, per second of arrivals. Tokens are the engines' "
        "`vllm:prompt_tokens_by_source_total` (a killed D's are lost); router CPU is the "
        "router's process tree. The arms:",
        "",
    ]
    first = next(iter(res["scenarios"].values()), None)
    for name, arm in (first or {"arms": {}})["arms"].items():
        lines.append(f"- {name}: {arm['how']}")
    for name in res["skipped"]:
        lines.append(f"- {name}: skipped, `{VLLM_ROUTER}` could not be installed")
    for sc_name, sc in res["scenarios"].items():
        lines += [
            "",
            f"### {sc_name}: {sc['what']}",
            "",
            f"{sc['seconds']:g} s of arrivals per arm and round, {sc['rounds']} round(s).",
            "",
            "| arm | turns (failed) | TTFT turn 1 p50 / p90 / p99 ms | later turns p50 / p90 / "
            "p99 ms | goodput /s | P computed | P read from D | router CPU ms/turn | answers "
            "differing from kvbaton's |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for name, arm in sc["arms"].items():
            s = arm["summary"]
            one_, later = s["ttft_first"], s["ttft_later"]
            lines.append(
                f"| {name} | {s['turns']} ({s['failed']}) | "
                f"{fmt(one_['p50'], 0)} / {fmt(one_['p90'], 0)} / {fmt(one_['p99'], 0)} | "
                f"{fmt(later['p50'], 0)} / {fmt(later['p90'], 0)} / {fmt(later['p99'], 0)} | "
                f"{s['goodput']:.2f} | {s['p_computed']:,.0f} | {s['pulled_from_d']:,.0f} | "
                f"{s['cpu_ms_per_turn']:.2f} | {s['differ']} of {s['compared']} |"
            )
        kv = sc["arms"].get(ARMS[0].name, {}).get("summary")
        if kv:
            reuse = ", ".join(f"{k} {v}" for k, v in sorted(kv["reuse"].items()))
            lines += [
                "",
                f"kvbaton's later turns by `X-KV-Reuse`: {reuse or 'none'}; the most of its "
                f"D's blocks pinned at once: {fmt(kv['pinned_max'])}.",
            ]
    lines.append("")
    return lines
