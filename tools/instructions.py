"""Instructions per turn under callgrind: a lever's A/B that the machine's noise cannot hide.

`python -m tools.instructions [--base REV] [--kind json|stream|chunk-0.33|chunk-0.32]` counts
the user-space instructions each arm executes per turn (json/stream: the conversations of
`make bench`'s router overhead section, 1 client) or per relayed paced chunk (chunk-*: the
slope between streams of 8 and 128 tokens, D speaking that vLLM version), only around the
measured load. Arms, each a fresh process, alternate over R rounds: this checkout's router,
`--base`'s (a temporary git worktree), the work floor (chunks: the floor). CPU seconds here
vary 10-30% between identical runs, instruction counts 0.7% over 60 conversations; the
kernel's work is left out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

from bench import overhead, throughput
from bench.plan import FULL
from bench.stack import LoadGen, start_stack
from harness.procs import free_port, stop, wait_http
from harness.router import serve_argv

ROOT = Path(__file__).resolve().parent.parent
# Under callgrind a turn takes ~30x longer: no timeout may fire, no health probe run.
SLOW = ["--store-timeout", "30", "--connect-timeout", "30", "--prefill-timeout", "60"]
SLOW += ["--decode-first-byte-timeout", "60", "--decode-idle-timeout", "60"]
SLOW += ["--health-interval", "3600"]
KINDS = ("json", "stream", "chunk-0.33", "chunk-0.32")
CHUNK_LENGTHS = (8, 128)
# The chunks' engines: make bench's for floods of first turns, D paced as a GPU paces tokens
# (one SSE chunk per read).
PACED = ["--decode-ms-per-token", "5"]


def available() -> bool:
    return shutil.which("valgrind") is not None and shutil.which("callgrind_control") is not None


def total_instructions(path: Path) -> int:
    """The `totals:` line of a callgrind dump (its `summary:` is 0 for a dump on request)."""
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("totals:"):
            return int(line.split()[1])
    raise ValueError(f"{path}: no totals line")


@contextlib.contextmanager
def worktree(rev: str) -> Iterator[Path]:
    """A detached checkout of `rev` in a temporary folder, removed after."""
    folder = Path(tempfile.mkdtemp(prefix="kvbaton-base-"))
    git = ["git", "worktree"]
    subprocess.run([*git, "add", "--detach", "-f", str(folder), rev], cwd=ROOT, check=True)
    try:
        yield folder
    finally:
        subprocess.run([*git, "remove", "--force", str(folder)], cwd=ROOT, capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def callgrind(argv: Sequence[str], cwd: Path, port: int, out: Path) -> Iterator[int]:
    """`python -m argv` under callgrind (instrumentation off) until the block ends; its pid."""
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}"]
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONUNBUFFERED="1")
    with open(out.with_suffix(".log"), "wb") as log:
        proc = subprocess.Popen(
            [*cmd, sys.executable, "-m", *argv], cwd=cwd, stdout=log, stderr=log, env=env
        )
    try:
        wait_http(f"http://127.0.0.1:{port}/health", 300.0, proc)
        yield proc.pid
    finally:
        stop(proc, 60.0)


def _control(action: str, pid: int) -> None:
    subprocess.run(["callgrind_control", action, str(pid)], check=True, capture_output=True)


def _conversations(url: str, stream: bool, n: int, rnd: int) -> dict[str, Any]:
    spec = overhead.job(FULL, url, stream=stream, clients=1, rnd=rnd)
    spec.update(n=n, deadline_s=3000.0, request_timeout_s=300.0)
    return spec


def _streams(url: str, tokens: int, count: int) -> dict[str, Any]:
    """`count` streams of `tokens` tokens, 4 at a time, each a conversation of one turn."""
    spec = overhead.job(FULL, url, stream=True, clients=4, rnd=7, turns=1)
    spec.update(n=count, output_tokens=(tokens, tokens), deadline_s=3000.0)
    return {**spec, "request_timeout_s": 300.0}


Arm = tuple[str, list[str], Path, int]  # name, `python -m` argv, its tree, its port


def measure(arm: Arm, lg: LoadGen, kind: str, n: int, work: Path) -> dict[str, Any]:
    """One fresh process of the arm: a warm-up, then the measured load, dumped per job (one
    for a turn's kind, one per stream length for a chunk's)."""
    name, argv, cwd, port = arm
    url = f"http://127.0.0.1:{port}"
    chunks = kind.startswith("chunk-")
    if chunks:
        warm, jobs = ([_streams(url, t, k) for t in CHUNK_LENGTHS] for k in (4, n))
    else:
        warm = [_conversations(url, kind == "stream", 1, rnd=99)]
        jobs = [_conversations(url, kind == "stream", n, rnd=0)]
    out = work / f"{''.join(c if c.isalnum() else '-' for c in name)}.{time.monotonic_ns()}.cg"
    with callgrind(argv, cwd, port, out) as pid:
        for spec in warm:
            lg.run(spec, timeout=600)
        _control("--instr=on", pid)
        runs = []
        for spec in jobs:
            runs.append(lg.run(spec, timeout=3600))
            _control("--dump", pid)
        _control("--instr=off", pid)
    dumps = sorted(
        (p for p in work.glob(out.name + ".*") if p.suffix != ".log"),
        key=lambda p: int(p.suffix[1:]),
    )
    if len(dumps) != len(jobs):
        raise RuntimeError(f"{name}: expected {len(jobs)} callgrind dumps, found {dumps}")
    counts = [total_instructions(d) for d in dumps]
    if chunks:
        per_stream = [c / max(1, len(r["turns"])) for c, r in zip(counts, runs, strict=True)]
        events = [statistics.mean(t["events"] for t in r["turns"]) for r in runs]
        return {
            "turns": sum(len(r["turns"]) for r in runs),
            "failed": sum(not t["ok"] for r in runs for t in r["turns"]),
            "events": events,
            "instructions_per_turn": chunk_slope(per_stream, events),
        }
    turns = runs[0]["turns"]
    later = Counter(t.get("reuse") or "-" for t in turns if t["turn"] > 1)
    return {
        "turns": len(turns),
        "failed": sum(1 for t in turns if not t["ok"]),
        "later_turns": dict(later),
        "instructions_per_turn": counts[0] / max(1, len(turns)),
    }


def chunk_slope(per_stream: Sequence[float], events: Sequence[float]) -> float:
    """Instructions per chunk between the shortest and the longest streams."""
    if events[-1] <= events[0]:
        raise ValueError(f"the longer streams carried no more events: {list(events)}")
    return (per_stream[-1] - per_stream[0]) / (events[-1] - events[0])


def run(
    *, base: str | None, kind: str, conversations: int, rounds: int, floor: bool
) -> dict[str, list[dict[str, Any]]]:
    """R alternating rounds of the arms on one stack; per arm its rounds' results."""
    chunks = kind.startswith("chunk-")
    if chunks:
        version = ["--vllm-version", kind.removeprefix("chunk-")]
        (p_args,), (d_args,) = throughput.FIRST_TURNS["prefill"], throughput.FIRST_TURNS["decode"]
        p_args, d_args, router_args = [*p_args, *version], [*d_args, *PACED, *version], []
    else:
        p_args, d_args, router_args = overhead.P_ARGS, overhead.D_ARGS, overhead.ROUTER_ARGS
    results: dict[str, list[dict[str, Any]]] = {}
    lg = LoadGen()
    try:
        with (
            start_stack(prefill=[p_args], decode=[d_args], routers=[], name="instructions") as st,
            contextlib.ExitStack() as stack,
            tempfile.TemporaryDirectory(prefix="kvbaton-callgrind-") as tmp,
        ):
            assert st.redis_url is not None
            p_url, d_url = st.ps[0].url, st.ds[0].url
            trees = [("kvbaton", ROOT)]
            if base is not None:
                trees.append((f"kvbaton at {base}", stack.enter_context(worktree(base))))
            arms: list[Arm] = []
            for name, tree in trees:
                port = free_port()
                args = [*router_args, *SLOW]
                argv = serve_argv([p_url], [d_url], *args, port=port, redis_url=st.redis_url)
                arms.append((name, argv, tree, port))
            if floor:
                port = free_port()
                argv = ["bench.passthrough", str(port), p_url, d_url, "uvloop"]
                work_floor = ("work floor", [*argv, st.redis_url], ROOT, port)
                arms.append(("floor", argv, ROOT, port) if chunks else work_floor)
            for rnd in range(rounds):
                for arm in arms if rnd % 2 == 0 else arms[::-1]:
                    # An empty store for each: with earlier sessions and D's pin ledger left in
                    # it, the same code counted ~1.5% less (measured).
                    client = redis.Redis.from_url(st.redis_url)
                    client.flushdb()
                    client.close()
                    r = measure(arm, lg, kind, conversations, Path(tmp))
                    results.setdefault(arm[0], []).append(r)
                    what = f"{r['turns']} turns, {r['failed']} failed"
                    print(
                        f"round {rnd + 1}: {arm[0]}: {r['instructions_per_turn']:,.0f} per "
                        f"{'chunk' if chunks else 'turn'} ({what})",
                        flush=True,
                    )
    finally:
        lg.close()
    return results


def summary(results: dict[str, list[dict[str, Any]]], unit: str = "turn") -> list[str]:
    """Per arm the median and range of instructions per turn (or chunk); each arm against
    the first, as a ratio and, per chunk, as the difference."""
    lines = []
    medians = {
        a: statistics.median(r["instructions_per_turn"] for r in rs) for a, rs in results.items()
    }
    first = next(iter(medians.values()), 0.0)
    scale, suffix, digits = (1e3, "k", 1) if unit == "chunk" else (1e6, "M", 3)
    for i, (arm, rows) in enumerate(results.items()):
        values = [r["instructions_per_turn"] / scale for r in rows]
        line = f"{arm}: {medians[arm] / scale:.{digits}f} {suffix} instructions per {unit}"
        line += f" (median of {len(values)}, {min(values):.{digits}f}-{max(values):.{digits}f})"
        if i and medians[arm]:
            line += f"; kvbaton is {first / medians[arm]:.3f}x this"
            if unit == "chunk":
                line += f", {(first - medians[arm]) / scale:.{digits}f} {suffix} above it"
        lines.append(line)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.instructions", description=__doc__)
    ap.add_argument("--base", help="also measure the router of this commit (a git revision)")
    ap.add_argument("--kind", choices=KINDS, default="json")
    ap.add_argument("--conversations", type=int, help="default 60; chunk kinds: streams, 24")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-floor", action="store_true", help="leave the (work) floor out")
    args = ap.parse_args(argv)
    if not available():
        print("python -m tools.instructions needs valgrind (Debian package valgrind)")
        return 2
    chunks = args.kind.startswith("chunk-")
    n = args.conversations or (24 if chunks else 60)
    results = run(
        base=args.base, kind=args.kind, conversations=n, rounds=args.rounds, floor=not args.no_floor
    )
    print("\n".join(summary(results, "chunk" if chunks else "turn")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
