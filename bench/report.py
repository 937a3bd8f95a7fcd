"""docs/benchmarks.md from one run's results: every figure side by side with its spread."""

from __future__ import annotations

import math
from typing import Any

from bench import (
    events,
    handover,
    hitpath,
    peers,
    pins,
    pins_faults,
    pins_mixed,
    redis_cost,
    reuse,
    throughput,
)
from bench import targets as bench_targets
from bench.plan import SOURCES, Plan
from bench.stats import fmt, table
from bench.workload import NONSTREAM_TOKENS, STREAM_TOKENS, SYSTEM_WORDS, USER_WORDS

SECTIONS = (
    "## Run",
    "## Targets",
    "## 1. Router overhead",
    "## 2. Throughput",
    "## 3. What reuse buys",
    "## 4. Redis cost per turn",
    "## 5. Profile",
    "## 6. KV events",
    "## 7. D's memory",
    "## 8. Side by side with other routers",
    "## 9. The handover",
    "## Configuration",
)


def pair(d: dict[str, float], a: str = "p50", b: str = "p99", digits: int = 2) -> str:
    return f"{fmt(d[a], digits)} / {fmt(d[b], digits)}"


def diff(x: dict[str, float], y: dict[str, float], q: str, digits: int = 2) -> float:
    return y[q] - x[q]


def render(results: dict[str, Any], plan: Plan, pngs: dict[str, str]) -> str:
    lines = [
        "# kvbaton benchmarks",
        "",
        "Written by `make bench` (`python -m bench`, code in `bench/`). Every number",
        "below comes from the one run described under *Run*; rerun the command to refresh it.",
        "Engines are `vllm_sim` processes (no GPU), so latencies are the router's and the",
        "simulators' own CPU work plus the cost model's sleeps. Percentiles are nearest-rank.",
        "",
    ]
    lines += run_info(results["meta"], plan)
    lines += targets(results, plan)
    if "overhead" in results:
        lines += overhead_section(results["overhead"], pngs)
    if "throughput" in results:
        lines += throughput_section(results["throughput"], pngs)
    if "reuse" in results:
        lines += reuse_section(results["reuse"], plan, pngs)
    lines += redis_section(results)
    lines += profile_section(results.get("profile"))
    if "events" in results:
        lines += events.section(results["events"])
    if "pins" in results:
        lines += pins.section(results["pins"], plan, pngs.get("pins"))
        lines += pins_mixed.section(results["pins"].get("mixed"), plan)
        lines += pins_faults.section(results["pins"].get("faults"), plan)
    if "peers" in results:
        lines += peers.section(results["peers"], plan, pngs.get("peers"))
    if "handover" in results:
        lines += handover.section(results["handover"])
    lines += config_section(results)
    return "\n".join(lines).rstrip() + "\n"


def run_info(meta: dict[str, Any], plan: Plan) -> list[str]:
    rows = [
        ["date (UTC)", meta["date"]],
        ["command", f"`{meta['command']}`"],
        ["mode", plan.name],
        ["machine", f"{meta['nproc']} CPUs (`nproc`), {meta['cpu_model']}"],
        ["load average (1/5/15 min)", f"before {meta['load_before']}, after {meta['load_after']}"],
        ["1-min load average as each step started", load_spread(meta.get("step_loads", []))],
        ["software", meta["versions"]],
        ["commit", meta["commit"]],
        ["duration", f"{meta['duration_s']:.0f} s"],
    ]
    notes = [
        "The load generator, the router, redis-server and the simulators share these CPUs;",
        "the load average shows what else was running.",
        "",
    ]
    return ["## Run", "", *table(["", ""], rows), *notes]


def load_spread(loads: list[float]) -> str:
    if not loads:
        return "n/a"
    ordered = sorted(loads)
    median = ordered[len(ordered) // 2]
    return f"min {ordered[0]:.2f}, median {median:.2f}, max {ordered[-1]:.2f} ({len(loads)} steps)"


def _met(ok: bool | None) -> str:
    return "n/a" if ok is None else ("yes" if ok else "**no**")


def targets(results: dict[str, Any], plan: Plan) -> list[str]:
    rows = [
        [t, ref, measured, "figure" if ok is None and "n/a" not in measured else _met(ok)]
        for t, ref, measured, ok in target_rows(results, plan)
    ]
    missed = any(ok is False for *_, ok in target_rows(results, plan))
    return [
        "## Targets",
        "",
        "Each target is measured against a reference taken in the same run: the stack's",
        "*floor* (`bench/passthrough.py`: Hypercorn + Starlette + aiohttp passing a turn",
        "through P and D with nothing else, on the same event loop as kvbaton) or the cost",
        "model's *limit* for a turn (section 3). *own* is kvbaton minus the floor.",
        "",
        *table(["target", "reference", "measured", "met"], rows),
        *(why_missed(results) if missed else []),
        *floor_note(results.get("overhead", {})),
        *ample_note(results.get("reuse"), plan),
    ]


def target_rows(results: dict[str, Any], plan: Plan) -> list[bench_targets.Row]:
    return bench_targets.rows(results, plan)


def why_missed(results: dict[str, Any]) -> list[str]:
    """Where a target is missed: what the router does that the floor does not, and the
    profile of the hit path that shows where its CPU goes."""
    lines = [
        "Where a target is missed, why: on a hit kvbaton does what the floor does (the",
        "client's exchange, P, D) plus one more HTTP exchange (P's `/tokenize`, the prefix",
        "check) and two Redis scripts (the claim, and the commit, which must land before the",
        "answer or the stream's last event reaches the client), and it parses D's answer to",
        "capture the next turn's state.",
    ]
    rr = (results.get("reuse") or {}).get("runs", {}).get("ample/c", {})
    if "limit_by_turn" in rr:
        ttft, limit = rr["ttft_by_turn"]["1"]["p50"], rr["limit_by_turn"]["1"]["p50"]
        lines += [
            "For TTFT against the limit: the round-robin arm, which has no router process and",
            f"nothing to reuse on turn 1, takes {fmt(ttft, 1)} ms p50 there against a limit of",
            f"{fmt(limit, 1)} ms ({fmt(ttft / limit if limit else math.nan)}x): the simulators'",
            "own CPU work (tokenizing, rendering, HTTP) on two cores that the engines, Redis,",
            "the router and the load generator share, with several conversations at a time.",
        ]
    prof = (results.get("profile") or {}).get("hits")
    if prof and prof.get("groups"):
        top = ", ".join(f"{k} {v * 100:.0f}%" for k, v in list(prof["groups"].items())[:6])
        lines.append(f"Where the router's CPU goes on hits (section 5, *hits*): {top}.")
    else:
        lines.append("The profile of the hit path (section 5) runs in a full `make bench` only.")
    return [*lines, ""]


def floor_note(ov: dict[str, Any]) -> list[str]:
    relay_floor = ov.get("chunk_floor")
    through = ov.get("chunk_passthrough")
    if not relay_floor:
        return []
    return [
        "For the per-chunk targets: a bare asyncio TCP relay (no HTTP, no parsing) costs",
        f"{fmt(relay_floor['us_per_chunk'], 1)} us of CPU per paced chunk on this machine",
        *(
            [
                "and the same chunks through Hypercorn + Starlette + aiohttp with nothing",
                f"else cost {fmt(through['us_per_chunk'], 1)} us",
            ]
            if through
            else []
        ),
        "(section 1, *Router CPU per relayed chunk*).",
        "",
    ]


def ample_note(res: dict[str, Any] | None, plan: Plan) -> list[str]:
    """Why reuse gains less over round robin when P's prefix cache holds everything."""
    runs = res.get("runs", {}) if res else {}
    a, c = runs.get("ample/a", {}), runs.get("ample/c", {})
    if "tokens" not in a or "tokens" not in c or not a.get("turns") or not c.get("turns"):
        return []
    per_turn = {
        arm: run["tokens"]["P"].get("local_compute", 0) / run["turns"]
        for arm, run in (("a", a), ("c", c))
    }
    ms = plan.gpu.prefill_ms_per_token
    return [
        "Reuse against round robin with an ample cache (section 3): with room for every",
        "conversation, each P's own prefix cache keeps every prompt it has seen, so round",
        "robin over two P finds most of each",
        "new prompt there already. Over all turns, P computed "
        f"{per_turn['c']:,.0f} tokens per turn under round robin against "
        f"{per_turn['a']:,.0f} with reuse ({per_turn['c'] * ms:.0f} vs "
        f"{per_turn['a'] * ms:.0f} ms of modelled prefill), while what every arm pays",
        f"besides does not shrink with reuse: D's first token ({plan.gpu.decode_ms_per_token} ms),",
        "the engines tokenizing the whole prompt, the HTTP legs. With more P instances round",
        "robin would find a prompt in its P's cache less often; under cache pressure (the",
        "small-cache rows) reuse keeps its lead.",
        "",
    ]


def overhead_section(res: dict[str, Any], pngs: dict[str, str]) -> list[str]:
    lines = [
        "## 1. Router overhead",
        "",
        "Zero-cost simulators (one P, one D, cost model 0). The same seeded requests (a system",
        f"prompt of {SYSTEM_WORDS} and a user message of {USER_WORDS} one-token words) go",
        "(a) straight to the engines by a minimal client that does the two legs itself (P with",
        "`max_tokens=1` and the null handoff, then D with P's `kv_transfer_params`), and",
        "(b) through kvbaton. Prefix caches are reset before every run, so both arms cost the",
        "engines the same. Every kvbaton request is the first turn of a new conversation: the",
        "router claims (a miss) and commits the session in Redis and captures D's handle (for",
        "JSON turns it also asks D for token ids and strips them from the body); it sends no",
        "`/tokenize` and P reads no KV (that happens on hits, section 3).",
        "The load generator is its own process; *added* is kvbaton minus direct at the same",
        "percentile. Router CPU per turn is `/proc/<pid>/stat` utime+stime over the run / turns.",
        "",
        "*Floor* is a third arm run in the same rounds: `bench/passthrough.py`, the stack",
        "the design names (Hypercorn, Starlette, aiohttp) doing the same two legs with nothing",
        "else (no Redis, no session, no parsing of D's answer, no metrics or logs). What it",
        "adds over direct is what any router built on this stack pays on this machine; kvbaton's",
        "own work is the difference between its *added* and the floor's.",
        "",
        f"### JSON responses (`max_tokens={NONSTREAM_TOKENS}`), latency in ms",
        "",
    ]
    rows = []
    for c in (c for c in res["cells"] if not c["stream"]):
        d, k = c["direct"]["latency"], c["kvbaton"]["latency"]
        rows.append(
            [
                str(c["concurrency"]),
                f"{c['kvbaton']['ok']} (+{c['kvbaton']['failed']} failed)",
                pair(d),
                pair(k),
                f"{fmt(diff(d, k, 'p50'))} / {fmt(diff(d, k, 'p99'))}",
                floor_added(c, "latency"),
                f"{fmt(c['direct']['per_s'], 0)} / {fmt(c['kvbaton']['per_s'], 0)}",
                cpu_pair(c),
                store_misses(c),
            ]
        )
    lines += table(
        [
            "clients",
            "turns",
            "direct p50 / p99",
            "kvbaton p50 / p99",
            "added p50 / p99",
            "floor: passthrough added p50 / p99",
            "turns/s direct / kvbaton",
            "CPU ms/turn: kvbaton (floor)",
            "turns without the store",
        ],
        rows,
    )
    lines += [
        "*Turns without the store*: the router's Redis call took longer than its",
        "`--store-timeout` (0.25 s), so it served the turn without the session store",
        "(`X-KV-Reuse: miss;reason=store-unavailable`) and skipped the store for",
        "`--store-retry-after` seconds: its event loop was too busy to read Redis' reply.",
        "",
    ]
    lines += streaming_table(res)
    lines += hitpath.section(res.get("hit_path"))
    lines += chunk_table(res)
    if "overhead" in pngs:
        lines += [f"![added latency vs concurrency]({pngs['overhead']})", ""]
    return lines


def cpu_pair(cell: dict[str, Any]) -> str:
    """kvbaton's CPU per turn, and the passthrough's in brackets where it ran."""
    text = fmt(cell["router_cpu_ms_per_turn"], 3)
    if "floor_cpu_ms_per_turn" in cell:
        text += f" ({fmt(cell['floor_cpu_ms_per_turn'], 3)})"
    return text


def floor_added(cell: dict[str, Any], key: str) -> str:
    """What the passthrough arm added over direct (p50 / p99), or n/a in older results."""
    if "floor" not in cell:
        return "n/a"
    d, f = cell["direct"][key], cell["floor"][key]
    return f"{fmt(diff(d, f, 'p50'))} / {fmt(diff(d, f, 'p99'))}"


def store_misses(cell: dict[str, Any]) -> str:
    """Share of kvbaton turns the router served without the store (Redis timed out)."""
    reuse_counts = cell["kvbaton"].get("reuse", {})
    total = sum(reuse_counts.values())
    down = sum(v for k, v in reuse_counts.items() if "store-unavailable" in k)
    return f"{down / total * 100:.0f}%" if total else "n/a"


def us_pair(d: dict[str, float]) -> str:
    return f"{fmt(d['p50'] * 1000, 0)} / {fmt(d['p99'] * 1000, 0)}"


def streaming_table(res: dict[str, Any]) -> list[str]:
    cells = [c for c in res["cells"] if c["stream"]]
    events = cells[0]["kvbaton"]["events"] if cells else 0
    lines = [
        f"### Streaming responses (`max_tokens={STREAM_TOKENS}`, {events:.0f} SSE events each)",
        "",
        "TTFT is the arrival of the first SSE event. *Per chunk* is, per request, (last event -",
        "first event) / (events - 1): with zero-cost engines D streams as fast as it can, so",
        "this is the pipeline's time per chunk; the router may coalesce chunks that arrive",
        "together into one write, which can make it look faster than the direct stream.",
        "",
    ]
    rows = []
    for c in cells:
        d, k = c["direct"], c["kvbaton"]
        rows.append(
            [
                str(c["concurrency"]),
                f"{pair(d['ttft'])} -> {pair(k['ttft'])}",
                f"{fmt(diff(d['ttft'], k['ttft'], 'p50'))} / "
                f"{fmt(diff(d['ttft'], k['ttft'], 'p99'))}",
                f"{us_pair(d['per_chunk'])} -> {us_pair(k['per_chunk'])}",
                f"{fmt(diff(d['per_chunk'], k['per_chunk'], 'p50') * 1000, 0)} / "
                f"{fmt(diff(d['per_chunk'], k['per_chunk'], 'p99') * 1000, 0)}",
                f"{fmt(diff(d['latency'], k['latency'], 'p50'))} / "
                f"{fmt(diff(d['latency'], k['latency'], 'p99'))}",
                floor_added(c, "latency"),
                cpu_pair(c),
                store_misses(c),
            ]
        )
    lines += table(
        [
            "clients",
            "TTFT ms p50 / p99, direct -> kvbaton",
            "added TTFT ms p50 / p99",
            "per chunk us p50 / p99, direct -> kvbaton",
            "added per chunk us p50 / p99",
            "added whole stream ms p50 / p99",
            "floor: passthrough added whole stream",
            "CPU ms/turn: kvbaton (floor)",
            "turns without the store",
        ],
        rows,
    )
    return lines


def slope_row(name: str, c: dict[str, Any]) -> list[str]:
    """One chunk-cost configuration: CPU per turn at 8 and 128 tokens, and the slope."""
    runs = c["runs"]
    return [
        name,
        *(
            f"{fmt(runs[n]['cpu_ms_per_turn'], 3)} ({runs[n]['events']:.0f} events)"
            for n in ("8", "128")
        ),
        fmt(c["us_per_chunk"], 1),
        fmt(c["floor"]["us_per_chunk"], 1) if "floor" in c else "-",
        fmt(c["above_floor_us"], 1) if "above_floor_us" in c else "-",
    ]


def chunk_table(res: dict[str, Any]) -> list[str]:
    lines = [
        "### Router CPU per relayed chunk",
        "",
        "Streaming turns at 32 clients with `max_tokens` 8 and 128; the slope of router CPU",
        "per turn against SSE events per turn. *stock*: engines without PR #40186; the router",
        "forwards the chunks' bytes untouched (it still parses each one to capture the answer).",
        "*stream-kv-params*: D streams its handle (#40186) and the router asks for token ids",
        "(to verify the next turn) and cuts them out of every chunk's bytes (vLLM 0.32 shapes).",
        "*vllm 0.33*: D's stock 0.33 stream (a null `kv_transfer_params` in every content",
        "chunk, the handle on the finish chunk): token ids asked for from the first turn.",
        "Zero-cost D sends its chunks back to back, so the router reads several per wake-up;",
        "*paced* D sleeps 5 ms between tokens, as a GPU paces them, so every chunk costs its",
        "own read, event-loop wake-up and write: the realistic case. Each paced configuration",
        "is measured with the floor (`bench/passthrough.py`, no parsing) on the same engines,",
        "in rounds alternating with the router's: the table gives each arm's median, and",
        "*above floor* the median of the rounds' differences (drift moves both arms alike).",
        "",
    ]
    rows = [slope_row(name, c) for name, c in res["chunk_cpu"].items()]
    through = res.get("chunk_passthrough")
    if through:
        rows.append(
            slope_row("passthrough: Hypercorn + Starlette + aiohttp, paced (no parsing)", through)
        )
    relay_floor = res.get("chunk_floor")
    if relay_floor:
        per = relay_floor["us_per_connection"]
        rows.append(
            [
                "bare relay: asyncio TCP, paced (no HTTP, no parsing)",
                f"{fmt(per['8'] / 1000, 3)} (8 chunks)",
                f"{fmt(per['128'] / 1000, 3)} (128 chunks)",
                fmt(relay_floor["us_per_chunk"], 1),
                "-",
                "-",
            ]
        )
    lines += table(
        [
            "configuration",
            "CPU ms/turn, 8 tokens",
            "CPU ms/turn, 128 tokens",
            "us per chunk",
            "floor's us per chunk",
            "above floor",
        ],
        rows,
    )
    if through:
        lines += [
            "The *passthrough* row is `bench/passthrough.py` (section 1's floor arm) on the",
            "paced engines: the stack the design names relaying the same chunks with no parsing,",
            "no capture and no metrics (the floor of the *stock, paced* rounds).",
            "",
        ]
    if relay_floor:
        lines += [
            "The *bare relay* row is `bench/floor.py`: a source sends the same paced chunks",
            "(an SSE-sized payload, 5 ms apart) and a bare asyncio relay process forwards each",
            "read with one write, measured the same way (the CPU slope between 8 and 128",
            "chunks, 32 connections at a time). No Python relay on this machine can do a paced",
            "chunk for less: it is the cost of one wake-up, one read and one write here.",
            "",
        ]
    long = res.get("chunk_long")
    if long:
        lines += long_stream_table(long)
    return lines


def long_stream_table(long: dict[str, Any]) -> list[str]:
    """Router CPU per chunk 1,000 and 16,000 tokens into a stream, side by side."""
    at = long["us_per_chunk_at"]
    runs = long["runs"]
    lengths = [n for n in runs if n in at]
    pace = long.get("ms_per_token", 1.0)
    floor = long.get("floor", {}).get("us_per_chunk_at", {})
    above = long.get("above_floor_us_at", {})
    paced = (
        f"D paced {pace:g} ms per token, so every chunk is its own read"
        if pace
        else "D sends its tokens back to back, several chunks per read: `make bench` paces them"
    )
    lines = [
        "### Router CPU per chunk, short and long streams",
        "",
        f"{long['streams']} streaming turns of each length at a time through the router (stock",
        f"engines; {paced}). Each length's router CPU per turn against that of 8-token",
        "streams: the CPU a chunk costs, the turn's fixed cost left out. The same figure at",
        "both lengths means a chunk costs the same however far into a stream it is. The",
        "floor (`bench/passthrough.py`) relays the same streams in rounds alternating with the",
        "router's; *above the floor* is the median of the rounds' differences.",
        "",
    ]
    lines += table(
        ["per stream length", *(f"{int(n):,} tokens" for n in lengths)],
        [
            ["router CPU per chunk (us)", *(fmt(at[n], 1) for n in lengths)],
            *(
                [
                    ["the floor's, same streams (us)", *(fmt(floor[n], 1) for n in lengths)],
                    ["router above the floor (us)", *(fmt(above[n], 1) for n in lengths)],
                ]
                if floor and above
                else []
            ),
            ["router CPU per turn (ms)", *(fmt(runs[n]["cpu_ms_per_turn"], 1) for n in lengths)],
            ["SSE events per turn", *(f"{runs[n]['events']:.0f}" for n in lengths)],
        ],
    )
    return lines


def throughput_section(res: dict[str, Any], pngs: dict[str, str]) -> list[str]:
    pinned = (
        f"The router is pinned to CPU {throughput.ROUTER_CPU} (`taskset -c "
        f"{throughput.ROUTER_CPU}` semantics: `sched_setaffinity` on each of its threads); the "
        f"engines, redis-server and the load generator share CPU {throughput.OTHERS_CPU}."
        if res["pinned"]
        else "**Not pinned** (fewer than 2 CPUs or no sched_setaffinity): every process shares "
        "all CPUs."
    )
    lines = [
        "## 2. Throughput",
        "",
        pinned,
        "Open loop: requests arrive at a fixed rate for a fixed time, each the first turn of a",
        "new conversation (JSON: `max_tokens=16`; streaming: "
        f"`max_tokens={throughput.STREAM_TOKENS}`). A step holds when "
        + next(iter(res["sweeps"].values()))["limit_note"]
        + "; a step that does not is run once more (*retried*), and the sweep stops at the first"
        " step that fails twice.",
        "",
    ]
    for name, sweep in res["sweeps"].items():
        lines += [f"### {'Streaming' if name == 'stream' else 'JSON'} turns", ""]
        lines += sweep_table(sweep)
        chunks = name == "stream"
        lines += [
            f"Sustained: **{fmt(sweep['sustained_turns_s'], 0)} turns/s**"
            + (f", **{fmt(sweep['sustained_chunks_s'], 0)} SSE events/s**" if chunks else "")
            + f". CPU ceiling of the router's core at {fmt(sweep['cpu_ms_per_turn'], 3)} ms of"
            f" CPU per turn: {fmt(sweep['ceiling_turns_s'], 0)} turns/s"
            + (f", {fmt(sweep['ceiling_chunks_s'], 0)} SSE events/s" if chunks else "")
            + ". Where the router's CPU stays well under 100% at the last step, the engines and"
            " the load generator on the other core were the limit, not the router.",
            "",
        ]
    if res.get("hits"):
        lines += hits_part(res["hits"])
    if res.get("workers"):
        lines += workers_part(res["workers"])
    if "throughput" in pngs:
        lines += [f"![throughput sweep]({pngs['throughput']})", ""]
    return lines


def sweep_table(sweep: dict[str, Any]) -> list[str]:
    rows = [
        [
            fmt(s["offered"], 0),
            fmt(s["achieved"], 0),
            fmt(s["chunks_s"], 0),
            f"{fmt(s['p50_ms'])} / {fmt(s['p99_ms'])}",
            f"{s['router_cpu_util'] * 100:.0f}%",
            fmt(s["router_cpu_ms_per_turn"], 3),
            ("yes" if s["holds"] else "no") + (" (retried)" if s.get("retried") else ""),
        ]
        for s in sweep["steps"]
    ]
    head = ["offered/s", "completed/s", "SSE events/s", "p50 / p99 ms", "router CPU"]
    return table([*head, "CPU ms/turn", "holds"], rows)


def hits_part(res: dict[str, Any]) -> list[str]:
    """Hit-path conversations, closed loop, against the pinned router (bench/hit_throughput.py)."""
    where = (
        f"the router pinned to CPU {throughput.ROUTER_CPU}, everything else on CPU "
        f"{throughput.OTHERS_CPU}"
        if res["pinned"]
        else "**not pinned**: every process shares all CPUs"
    )
    lines = [
        "### Hit turns (the hit path's conversations)",
        "",
        "Section 1's hit path (zero-cost engines that keep D's KV, conversations of "
        f"{res['turns']} turns with ids: every turn after the first a hit), closed loop at "
        "each concurrency, "
        f"{where}. *Ceiling*: the turns/s of a fully busy core at the CPU per turn measured.",
        "",
    ]
    rows = [
        [
            str(x["clients"]),
            f"{x['turns']} ({x['failed']})",
            f"{x['hits']} of {x['later']}",
            fmt(x["turns_s"], 0),
            f"{x['router_cpu_util'] * 100:.0f}%",
            fmt(x["cpu_ms_per_turn"], 3),
            fmt(x["ceiling_turns_s"], 0),
        ]
        for x in res["levels"]
    ]
    head = ["clients", "turns (failed)", "hits", "turns/s", "router CPU", "CPU ms/turn"]
    lines += table([*head, "ceiling turns/s"], rows)
    best = res.get("best")
    if best:
        lines += [
            f"Most: **{fmt(best['turns_s'], 0)} turns/s** at {best['clients']} clients, the "
            f"router's core {best['router_cpu_util'] * 100:.0f}% busy; at "
            f"{fmt(best['cpu_ms_per_turn'], 3)} ms of CPU per turn a fully busy core would "
            f"serve {fmt(best['ceiling_turns_s'], 0)} turns/s. Where the router's core is well "
            "under 100% busy, the engines and the load generator on the other core were the "
            "limit.",
            "",
        ]
    return lines


def workers_part(res: dict[str, Any]) -> list[str]:
    """One worker against `--workers 2`, nothing pinned."""
    lines = [
        "### One worker vs `--workers 2` (nothing pinned)",
        "",
        "`kvbaton serve --workers 2`: two router processes accept on one listening socket",
        "(router/http/workers.py). Two workers need two cores, and this machine has two in all, so",
        "here nothing is pinned: the router(s), the engines, redis-server and the load",
        "generator share both CPUs, and the two rows differ only in the worker count. *Router",
        "CPU* is the workers' and the supervisor's together (100% is one core).",
        "",
    ]
    summary = []
    for label, sweeps in res.items():
        for name, sweep in sweeps.items():
            held = [s for s in sweep["steps"] if s["holds"]]
            best = max(held, key=lambda s: s["achieved"]) if held else None
            summary.append(
                [
                    label,
                    "streaming" if name == "stream" else "JSON",
                    fmt(sweep["sustained_turns_s"], 0),
                    fmt(sweep["sustained_chunks_s"], 0) if name == "stream" else "",
                    f"{fmt(best['p50_ms'])} / {fmt(best['p99_ms'])}" if best else "",
                    f"{best['router_cpu_util'] * 100:.0f}%" if best else "",
                    fmt(sweep["cpu_ms_per_turn"], 3),
                ]
            )
    lines += table(
        [
            "router",
            "turns",
            "sustained turns/s",
            "SSE events/s",
            "p50 / p99 ms there",
            "router CPU there",
            "CPU ms/turn",
        ],
        summary,
    )
    for label, sweeps in res.items():
        for name, sweep in sweeps.items():
            kind = "streaming" if name == "stream" else "JSON"
            lines += [f"Steps, {label}, {kind} turns:", ""]
            lines += sweep_table(sweep)
    return lines


def reuse_section(res: dict[str, Any], plan: Plan, pngs: dict[str, str]) -> list[str]:
    g = res["gpu"]
    lines = [
        "## 3. What reuse buys",
        "",
        "Two P and two D simulators with a cost model for Llama-3-8B on one H100 each:",
        "",
    ]
    lines += table(
        ["cost", "value", "source"],
        [
            ["prefill", f"{g['prefill_ms_per_token']} ms per computed token", SOURCES["prefill"]],
            ["decode", f"{g['decode_ms_per_token']} ms per output token", SOURCES["decode"]],
            [
                "KV transfer",
                f"{g['transfer_ms_per_block']} ms per {g['block_size']}-token block pulled",
                SOURCES["transfer"],
            ],
        ],
    )
    lines += [
        f"Workload: {plan.conv_n} conversations x {plan.conv_turns} turns, "
        f"{plan.conv_concurrency} conversations at a time; each has its own system prompt of "
        f"{plan.system_words[0]}-{plan.system_words[1]} tokens, user turns of "
        f"{plan.user_words[0]}-{plan.user_words[1]} new tokens, answers of "
        f"{plan.output_tokens[0]}-{plan.output_tokens[1]} tokens (uniform, seeded), sent back "
        "as the next turn's history. Every turn streams (`include_usage`), so TTFT is the first",
        "SSE event at the client.",
        "",
        "- (a) **kvbaton, reuse + affinity**: engines `--bidirectional` (P's",
        "  `kv_recompute_threshold` is the default 64); D also `--stream-kv-params` and the router",
        "  `--stream-kv-params`: stock vLLM streams carry no handle (PR #40186 is unmerged), and",
        "  TTFT needs streaming. On stock engines a streaming turn gets arm (b)'s behaviour.",
        "- (b) **kvbaton, affinity only**: `kvbaton serve --no-reuse` (same P and D as the",
        "  previous turn, never a handle), engines without `--bidirectional`.",
        "- (c) **round robin, no reuse**: vLLM's toy proxy logic (round robin over P and over D,",
        "  null handoff, no session), run inside the load generator, so it pays no proxy hop.",
        "- (h) **kvbaton, no conversation id**: as (a), but the client sends only the history",
        "  (as most chat clients and vLLM's multi-turn benchmark without its id option do); the",
        "  router finds the session by it (`hit;id=history`). Ample cache only.",
        f"- Prefill cache: *ample* = {plan.ample_blocks} blocks per P; *small* = "
        f"{plan.small_prefill_blocks} blocks per P "
        f"({plan.small_prefill_blocks * g['block_size']} tokens, a few conversations, below "
        "the working set). D always has the ample pool; `--max-model-len` "
        f"{plan.max_model_len}.",
        "",
        "- (p) **kvbaton, placement, stock engines**: engines `--bidirectional` without",
        "  `--stream-kv-params` (stock vLLM 0.32: no handle in a streamed chat turn), the router",
        "  with its defaults: a turn whose new tokens D's cache lacks are few runs on that D alone",
        "  (`hit;via=decode`), others are P/D turns. Compare it with (b) and (c). Ample cache",
        "  only.",
        "- (n) and (q) **JSON turns on stock engines** (full run only, ample cache): the same",
        "  conversations not streamed, so every turn can leave a handle; (n) with every plan",
        "  allowed (pull from D, run on D, recompute), (q) pull only",
        "  (`--decode-local-max-tokens 0`). Their *TTFT* is the whole JSON turn. A JSON turn",
        "  leaves D's handle, and the plan runs a turn on D only when there is none, so the two",
        "  are expected to do the same work (a 6 x 3 trial gave identical token counts).",
        "",
        "Each simulator runs one step loop, as a GPU batches its requests: a step carries one",
        "token of every running decode plus the prompt tokens of every new prefill, so a prefill",
        "on D (the decode plan's, or a recompute) slows the other streams on D. *ITL* below is",
        "each stream's mean and worst gap between SSE events, over every conversation.",
        "",
    ]
    tok = res["runs"].get("ample/a", {}).get("tokenize")
    if tok:
        lines += [
            f"TTFT here includes the simulators' own CPU work: one `/tokenize` of a "
            f"{tok['tokens']}-token chat (what the router sends P on every hit, to verify the "
            f"prefix token by token) took {fmt(tok['ms_p50'], 1)} ms p50 in the simulator's "
            "pure-Python tokenizer, and each engine tokenizes each prompt too.",
            "",
        ]
    for cache in reuse.CACHES:
        lines += ttft_table(res, plan, cache)
    lines += limit_table(res, plan)
    lines += tokens_table(res, plan)
    if "ttft" in pngs:
        lines += [f"![TTFT per turn with and without reuse]({pngs['ttft']})", ""]
    return lines


def ttft_table(res: dict[str, Any], plan: Plan, cache: str) -> list[str]:
    header = ["turn"]
    cols = []
    for arm, label in reuse.ARMS.items():
        run = res["runs"].get(f"{cache}/{arm}", {})
        header.append(f"({arm}) {label}")
        cols.append(run)
    rows = []
    for t in range(1, plan.conv_turns + 1):
        row = [str(t)]
        for run in cols:
            if "pending" in run:
                row.append("pending flag")
            elif "ttft_by_turn" in run:
                row.append(pair(run["ttft_by_turn"][str(t)], "p50", "p90", 1))
            else:
                row.append("n/a")
        rows.append(row)
    return [
        f"### TTFT p50 / p90 (ms) per turn, {cache} prefill cache",
        "",
        *table(header, rows),
    ]


LIMIT_ARMS = ("a", "p")


def limit_table(res: dict[str, Any], plan: Plan) -> list[str]:
    """Each turn's TTFT p50 beside the cost model's limit for it, ample cache."""
    runs = {arm: res["runs"].get(f"ample/{arm}", {}) for arm in LIMIT_ARMS}
    runs = {arm: run for arm, run in runs.items() if "limit_by_turn" in run}
    if not runs:
        return []
    g = res["gpu"]
    header = ["turn"]
    for arm in runs:
        header += [f"({arm}) limit p50", f"({arm}) TTFT p50", f"({arm}) TTFT / limit"]
    rows = []
    for t in range(1, plan.conv_turns + 1):
        row = [str(t)]
        for run in runs.values():
            limit = run["limit_by_turn"][str(t)]["p50"]
            ttft = run["ttft_by_turn"][str(t)]["p50"]
            row += [fmt(limit, 1), fmt(ttft, 1), fmt(ttft / limit if limit else math.nan)]
        rows.append(row)
    return [
        "### TTFT against the limit, ample prefill cache",
        "",
        "The cost model's limit for each turn (`GpuProfile.turn_limit_ms`): P prefills only",
        f"the new tokens ({g['prefill_ms_per_token']} ms each; at least the last one, as vLLM),",
        f"D decodes the first token ({g['decode_ms_per_token']} ms), and every block moves",
        f"once ({g['transfer_ms_per_block']} ms per {g['block_size']}-token block): the",
        "previous prompt and answer from D to P, the new blocks from P to D. The new tokens are",
        "the turn's prompt less what D held of its conversation (the previous prompt and answer",
        "less the answer's last token), in whole blocks; turn 1 reuses nothing. No queueing, no",
        "HTTP, no tokenizing. It is the limit of a P that holds none of the conversation: where",
        "P's prefix cache still holds its earlier prompt (*P cache hits* below), vLLM moves only",
        "the rest, and a turn run on D alone (the decode plan) moves nothing, so those turns can",
        "cost less. Limits are per conversation turn, p50 over the conversations; TTFT / limit",
        "divides the two p50s.",
        "",
        *table(header, rows),
    ]


def tokens_table(res: dict[str, Any], plan: Plan) -> list[str]:
    rows = []
    for cache in reuse.CACHES:
        for arm, label in reuse.ARMS.items():
            run = res["runs"].get(f"{cache}/{arm}", {})
            if "pending" in run or "tokens" not in run:
                rows.append([cache, f"({arm}) {label}", *["pending"] * 10])
                continue
            busy = run.get("machine_busy")
            p, d = run["tokens"]["P"], run["tokens"]["D"]
            last = run["latency_by_turn"][str(plan.conv_turns)]
            rows.append(
                [
                    cache,
                    f"({arm}) {label}",
                    f"{run['turns_ok']} (+{run['turns_failed']} failed)",
                    f"{p.get('local_compute', 0):,.0f}",
                    f"{p.get('local_cache_hit', 0):,.0f}",
                    f"{p.get('external_kv_transfer', 0):,.0f}",
                    f"{d.get('external_kv_transfer', 0):,.0f}",
                    f"{d.get('local_compute', 0):,.0f}",
                    _itl(run),
                    f"{run['wall_s']:.1f} s; last turn {pair(last, 'p50', 'p90', 0)} ms",
                    ", ".join(f"{k} {v}" for k, v in sorted(run["reuse"].items())),
                    f"{busy * 100:.0f}%" if busy is not None else "n/a",
                ]
            )
    return [
        "### Prompt tokens and end-to-end time",
        "",
        "From the simulators' `vllm:prompt_tokens_by_source_total`, summed over the two P or",
        "the two D: *computed on P* (`local_compute`), P's prefix-cache hits, *pulled by P*",
        "from D (D->P reads, `external_kv_transfer` on P) and pulled by D from P (the usual P->D",
        "handoff), *computed on D* (D's `local_compute`: the decode plan's new tokens), each",
        "stream's inter-token latency (*ITL*). End to end: the whole workload's wall time, and",
        "the last turn's whole-response latency p50 / p90. *Machine CPU busy*: both CPUs' busy",
        "time over the arm's runs (from `/proc/stat`); near 100% the processes queue for a CPU,",
        "and TTFT measures that",
        "queueing as well as the cost model.",
        "",
        *table(
            [
                "cache",
                "arm",
                "turns",
                "computed on P",
                "P cache hits",
                "pulled by P (D->P)",
                "pulled by D (P->D)",
                "computed on D",
                "ITL p50 / p90 (ms); worst gap p90",
                "end to end",
                "X-KV-Reuse",
                "machine CPU busy",
            ],
            rows,
        ),
    ]


def _itl(run: dict[str, Any]) -> str:
    if "itl" not in run:
        return "n/a"  # a run recorded before ITL was measured
    return f"{pair(run['itl'], 'p50', 'p90', 1)}; {fmt(run['gap_max']['p90'], 1)}"


def redis_rows(results: dict[str, Any]) -> list[list[str]]:
    """Per configuration: round trips (MONITOR sample) and server time (commandstats)."""
    oh = results.get("overhead", {})
    monitor = oh.get("monitor", {})
    rows = []
    sets = {k: redis_cost.top_level(v) for k, v in monitor.items()}
    runs: list[tuple[str, str, dict[str, Any], int]] = []
    for c in oh.get("cells", []):
        label = f"first turns, {'streaming' if c['stream'] else 'JSON'}, {c['concurrency']} clients"
        runs.append((label, "reuse", c["redis_delta"], c["turns"]))
    for key, run in results.get("reuse", {}).get("runs", {}).items():
        if run.get("redis_delta"):
            mode = "no-reuse" if key.endswith("/b") else "reuse"
            runs.append((f"conversations, arm {key}", mode, run["redis_delta"], run["turns"]))
    for label, mode, delta, turns in runs:
        top = sets.get(mode, set(redis_cost.SCRIPT_COMMANDS))
        pt = redis_cost.per_turn(delta, turns, top)
        calls = ", ".join(f"{k} {v:.2f}" for k, v in sorted(pt["calls_per_turn"].items()))
        rows.append(
            [
                label,
                fmt(pt["round_trips_per_turn"]),
                fmt(pt["server_usec_per_turn"], 1),
                calls,
            ]
        )
    return rows


def redis_section(results: dict[str, Any]) -> list[str]:
    oh = results.get("overhead", {})
    lines = [
        "## 4. Redis cost per turn",
        "",
        "Round trips are counted on a short untimed sample (4 conversations x 3 JSON turns per",
        "router configuration) with `redis-cli MONITOR`, which tells commands sent by the",
        "router from commands run inside its Lua scripts. Server time is `INFO commandstats`",
        "(reset before each timed run): microseconds of the commands the router sends (a",
        "script's time includes the commands it runs) per turn.",
        "",
    ]
    rows = []
    for mode, sample in oh.get("monitor", {}).items():
        top = ", ".join(f"{k} {v}" for k, v in sorted(sample["top"].items()))
        inner = ", ".join(f"{k} {v}" for k, v in sorted(sample["inner"].items()))
        rows.append(
            [
                mode,
                f"{sample['turns']} ({sample['hits']} hits)",
                fmt(sample["round_trips_per_turn"]),
                top,
                inner,
            ]
        )
    lines += table(
        ["router", "turns", "round trips/turn", "sent by the router", "inside scripts"], rows
    )
    lines += table(
        ["timed run", "round trips/turn", "server us/turn", "calls per turn"], redis_rows(results)
    )
    rtt = oh.get("redis_rtt")
    if rtt:
        lines += [
            "Loopback round trip from a redis-py asyncio client on this machine: PING "
            f"{fmt(rtt['ping_50_us'], 0)} us p50 ({fmt(rtt['ping_99_us'], 0)} p99), a "
            f"one-command EVALSHA {fmt(rtt['script_50_us'], 0)} us p50 "
            f"({fmt(rtt['script_99_us'], 0)} p99). With 2 round trips per turn the store "
            f"costs a turn about {fmt(2 * rtt['script_50_us'] / 1000, 2)} ms of waiting at p50 "
            "on an idle loop (more under load, when the reply waits for the event loop).",
            "",
        ]
    hist = oh.get("history_cost")
    if hist:
        lines += [
            "Sessions found by history (requests without a conversation id) add a lookup "
            f"before the claim, one MGET: {fmt(hist['lookup_4_50_us'], 0)} us p50 for 4 "
            f"candidate keys, {fmt(hist['lookup_64_50_us'], 0)} us for 64 "
            f"({fmt(hist['lookup_64_99_us'], 0)} p99), and an index write after the commit "
            f"(SET PX) of {fmt(hist['index_50_us'], 0)} us p50.",
            "",
        ]
    pins = oh.get("pin_note_cost")
    if pins:
        lines += _pin_note_lines(pins)
    return lines


def _pin_note_lines(pins: dict[str, float]) -> list[str]:
    """The commit's pin note (COMMIT_NOTED) by the handle's blocks: Redis's own time per call."""
    sizes = sorted({int(k.split("_")[1]) for k in pins if k.startswith("first_")})
    rows = [
        f"| {k:,} | {fmt(pins[f'first_{k}_server_us'], 0)} | "
        f"{fmt(pins[f'next_{k}_server_us'], 0)} |"
        for k in sizes
    ]
    return [
        "The commit with its pin note (one script) by the handle's blocks on D: Redis's time "
        "per call (INFO commandstats), for a conversation's first handle there and for its "
        "next one (the same blocks and 16 more; docs/architecture.md, *The pin index*).",
        "",
        "| blocks | first handle us | next handle us |",
        "|---|---|---|",
        *rows,
        "",
    ]


def _entry(name: str) -> bool:
    """The process entry points, on every stack."""
    return any(
        f"({m})" in name for m in ("router/server.py", "router/cli.py", "router/__main__.py")
    )


PROFILE_TITLES = {
    "json": "JSON turns, zero-cost engines",
    "stream": "Streaming turns, zero-cost engines (chunks arrive back to back)",
    "stream-paced": "Streaming turns, D paced at 5 ms per token (one chunk per read)",
    "hits": "Hits: JSON conversation turns with history (the hit path's stack, section 1)",
}


def profile_section(res: dict[str, Any] | None) -> list[str]:
    lines = ["## 5. Profile", ""]
    if not res:
        return [*lines, "Not run in this mode (`--quick`), or py-spy is not installed.", ""]
    lines += [
        "py-spy (`record --nonblocking --rate 200`) on the router process while clients keep",
        "it busy: first turns of new conversations on stock engines, and (*hits*) the hit",
        "path's conversations; shares are of the router's busy samples. On uvloop (the",
        "default) the loop's own work in C (libuv reading and writing sockets) shows as",
        "`Runner.run`. *Group*: each sample is charged to the innermost frame of",
        "a known package (the stdlib's socket writes go to the caller that wrote); *self*: the",
        "innermost frame itself; *inclusive*: router and sessions functions on the stack.",
        "",
    ]
    for label, prof in res.items():
        per_event = (
            prof["cpu_ms_per_turn"] * 1000.0 * prof["turns"] / prof["events"]
            if prof.get("events")
            else math.nan
        )
        lines += [
            f"### {PROFILE_TITLES.get(label, label)}",
            "",
            f"`max_tokens={prof['max_tokens']}`, {prof['clients']} clients, {prof['turns']} "
            f"turns in {prof['seconds']:.0f} s, {prof['samples']} busy samples (and "
            f"{prof.get('idle', 0)} idle in epoll_wait, left out); router CPU "
            f"{fmt(prof['cpu_ms_per_turn'], 3)} ms per turn"
            + (f", {fmt(per_event, 1)} us per SSE event" if label != "json" else "")
            + ".",
            "",
        ]
        lines += table(
            ["group (exclusive)", "share"],
            [[k, f"{v * 100:.1f}%"] for k, v in prof["groups"].items()],
        )
        lines += table(
            ["function (self)", "share"],
            [[f"`{k}`", f"{v * 100:.1f}%"] for k, v in list(prof["self"].items())[:10]],
        )
        lines += table(
            ["router/sessions function (inclusive)", "share"],
            [
                [f"`{k}`", f"{v * 100:.1f}%"]
                for k, v in [(k, v) for k, v in prof["inclusive_router"].items() if not _entry(k)][
                    :10
                ]
            ],
        )
    return lines


def config_section(results: dict[str, Any]) -> list[str]:
    lines = [
        "## Configuration",
        "",
        "Exact command lines of the processes each part started (ports are free ones picked at",
        "run time; everything binds 127.0.0.1):",
        "",
    ]
    for part in ("overhead", "reuse", "pins", "peers"):
        for name, commands in part_commands(results.get(part, {})).items():
            lines += [f"**{part} / {name}**", "", "```"]
            lines += [f"{label}: {' '.join(argv)}" for label, argv in commands.items()]
            lines += ["```", ""]
    return lines


def part_commands(res: dict[str, Any]) -> dict[str, dict[str, list[str]]]:
    """A part's command lines by arm; section 7's mixed workload and each of its faults too."""
    found = dict(res.get("commands", {}))
    if res.get("mixed"):
        found["mixed workload"] = res["mixed"]["commands"]
    for name, arm in res.get("faults", {}).get("arms", {}).items():
        found[name] = arm["commands"]
    return found
