"""Instructions per turn under callgrind: a lever's A/B that the machine's noise cannot hide.

`python -m bench.instructions [--base REV] [--kind json|stream] [--conversations N]
[--rounds R]` runs the hit path's conversations (section 1's stack: zero-cost simulators,
kvbaton with the hit path's flags, 4 of every 5 turns hits, 1 client) through routers under
`valgrind --tool=callgrind` and prints the user-space instructions each arm executed per
turn, counted only while the measured conversations ran (instrumentation is switched on and
off around them with callgrind_control). Arms: this checkout's router; with `--base REV`,
the router of that commit (a temporary git worktree, removed after); and the work floor
(bench/passthrough.py with Redis: the floor plus a hit's I/O, bare). Arms alternate, R
rounds, each in a fresh process.

`--kind chunk-0.33` (or `chunk-0.32`) counts instructions per relayed chunk instead:
section 1's paced per-chunk stack (D sleeps 5 ms a token, so each chunk is its own read and
write; D speaks that vLLM version's stream shapes), the default router, and the floor
(bench/passthrough.py without Redis) in place of the work floor. Per arm, `--conversations`
one-turn streams of 8 tokens and as many of 128, 4 at a time, each length counted on its
own; the figure is the slope, (instructions per stream at 128 - at 8) / (events per stream
at 128 - at 8), as `make bench` takes its CPU per chunk.

CPU seconds on a shared 2-core VM vary by 10-30% between identical runs (measured: the same
router gave 62-102 us per paced chunk in five rounds); instruction counts of the same code
vary by 0.7% over 60 conversations (300 turns) and by up to 5% over 20 (a collection of the
whole heap, or a background loop's tick, falls in the window or not).
They leave out the kernel's work (reads, writes, wake-ups), which the router and the floor
share, so they measure the router's own work; a lever that changes the syscalls is measured
by `make bench` instead. The router's timeouts are raised: under callgrind it runs about 30
times slower.
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import redis

from bench import hitpath, overhead
from bench.plan import FULL
from bench.stack import LoadGen, start_stack
from harness.procs import free_port, wait_http
from harness.router import serve_argv

ROOT = Path(__file__).resolve().parent.parent
# Under callgrind a turn takes ~30x longer: no timeout may fire, no health probe run.
SLOW = ["--store-timeout", "30", "--connect-timeout", "30", "--prefill-timeout", "60"]
SLOW += ["--decode-first-byte-timeout", "60", "--decode-idle-timeout", "60"]
SLOW += ["--health-interval", "3600"]
READY_S = 300.0


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
    subprocess.run(
        ["git", "worktree", "add", "--detach", "-f", str(folder), rev],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    try:
        yield folder
    finally:
        subprocess.run(
            ["git", "worktree", "remove", "--force", str(folder)], cwd=ROOT, capture_output=True
        )
        shutil.rmtree(folder, ignore_errors=True)


class Arm:
    """One process under callgrind (a router of some tree, or the work floor)."""

    def __init__(self, name: str, module_argv: Sequence[str], cwd: Path, port: int) -> None:
        self.name, self.argv, self.cwd, self.port = name, list(module_argv), cwd, port
        self.url = f"http://127.0.0.1:{port}"

    @contextlib.contextmanager
    def running(self, out: Path) -> Iterator[subprocess.Popen[bytes]]:
        argv = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
        argv += [f"--callgrind-out-file={out}", sys.executable, "-m", *self.argv]
        env = dict(os.environ, PYTHONHASHSEED="0", PYTHONUNBUFFERED="1")
        with open(out.with_suffix(".log"), "wb") as log:
            proc = subprocess.Popen(
                argv, cwd=self.cwd, stdout=log, stderr=subprocess.STDOUT, env=env
            )
        try:
            wait_http(self.url + "/health", READY_S, proc)
            yield proc
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def empty_store(redis_url: str) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        client.flushdb()
    finally:
        client.close()


def _callgrind(action: str, pid: int) -> None:
    subprocess.run(["callgrind_control", action, str(pid)], check=True, capture_output=True)


def measure(
    arm: Arm, lg: LoadGen, *, stream: bool, conversations: int, work: Path
) -> dict[str, Any]:
    """One fresh process of `arm`: a warm-up conversation, then `conversations` measured."""
    slug = "".join(c if c.isalnum() else "-" for c in arm.name)
    out = work / f"{slug}.{time.monotonic_ns()}.callgrind"
    with arm.running(out) as proc:
        lg.run(_job(arm.url, stream, 1, rnd=99), timeout=600)
        _callgrind("--instr=on", proc.pid)
        result = lg.run(_job(arm.url, stream, conversations, rnd=0), timeout=3600)
        _callgrind("--instr=off", proc.pid)
        _callgrind("--dump", proc.pid)
    dumps = [p for p in work.glob(out.name + ".*") if p.suffix != ".log"]
    if len(dumps) != 1:
        raise RuntimeError(f"{arm.name}: expected one callgrind dump, found {dumps}")
    turns = result["turns"]
    failed = sum(1 for t in turns if not t["ok"])
    reuse: dict[str, int] = {}
    for t in turns:
        if t["turn"] > 1:
            reuse[t.get("reuse") or "-"] = reuse.get(t.get("reuse") or "-", 0) + 1
    return {
        "turns": len(turns),
        "failed": failed,
        "later_turns": reuse,
        "instructions_per_turn": total_instructions(dumps[0]) / max(1, len(turns)),
    }


def _job(url: str, stream: bool, conversations: int, rnd: int) -> dict[str, Any]:
    spec = hitpath.job(FULL, url, stream=stream, clients=1, rnd=rnd, ids=True)
    spec.update(n=conversations, deadline_s=3000.0, request_timeout_s=300.0)
    return spec


CHUNK_LENGTHS = (8, 128)
CHUNK_CONCURRENCY = 4


def measure_chunks(arm: Arm, lg: LoadGen, *, streams: int, work: Path) -> dict[str, Any]:
    """One fresh process of `arm`: a warm-up of each length, then `streams` one-turn streams of
    CHUNK_LENGTHS tokens, each length's instructions dumped on its own. The result's
    `instructions_per_turn` is the slope per chunk (the summary's figure)."""
    slug = "".join(c if c.isalnum() else "-" for c in arm.name)
    out = work / f"{slug}.{time.monotonic_ns()}.callgrind"
    runs = []
    with arm.running(out) as proc:
        for tokens in CHUNK_LENGTHS:  # each length's code paths run once before the count
            lg.run(_chunk_job(arm.url, tokens, CHUNK_CONCURRENCY), timeout=600)
        _callgrind("--instr=on", proc.pid)
        for tokens in CHUNK_LENGTHS:
            runs.append(lg.run(_chunk_job(arm.url, tokens, streams), timeout=3600))
            _callgrind("--dump", proc.pid)
        _callgrind("--instr=off", proc.pid)
    dumps = sorted(
        (p for p in work.glob(out.name + ".*") if p.suffix != ".log"),
        key=lambda p: int(p.suffix[1:]),
    )
    if len(dumps) != len(CHUNK_LENGTHS):
        raise RuntimeError(f"{arm.name}: expected {len(CHUNK_LENGTHS)} dumps, found {dumps}")
    per_stream = [
        total_instructions(d) / max(1, r["sent"]) for d, r in zip(dumps, runs, strict=True)
    ]
    events = [sum(r["events"]) / max(1, len(r["events"])) for r in runs]
    return {
        "turns": sum(r["sent"] for r in runs),
        "failed": sum(r["failed"] for r in runs),
        "events": events,
        "instructions_per_turn": chunk_slope(per_stream, events),
    }


def chunk_slope(per_stream: Sequence[float], events: Sequence[float]) -> float:
    """Instructions per chunk between the shortest and the longest streams."""
    if events[-1] <= events[0]:
        raise ValueError(f"the longer streams carried no more events: {list(events)}")
    return (per_stream[-1] - per_stream[0]) / (events[-1] - events[0])


def _chunk_job(url: str, tokens: int, count: int) -> dict[str, Any]:
    spec = overhead.closed_job(
        overhead.via_url(url),
        stream=True,
        concurrency=CHUNK_CONCURRENCY,
        count=count,
        warmup=0,
        seed=7,
    )
    spec.update(max_tokens=tokens, deadline_s=3000.0, request_timeout_s=300.0)
    return spec


KINDS = ("json", "stream", "chunk-0.33", "chunk-0.32")


def run(
    *, base: str | None, kind: str, conversations: int, rounds: int, floor: bool
) -> dict[str, list[dict[str, Any]]]:
    """R alternating rounds of the arms on one stack; per arm its rounds' results."""
    chunks = kind.startswith("chunk-")
    if chunks:
        version = ["--vllm-version", kind.removeprefix("chunk-")]
        p_args, d_args = [*overhead.P_ARGS, *version], [*overhead.D_ARGS, *overhead.PACED]
        d_args += version
        router_args: list[str] = []
    else:
        p_args, d_args, router_args = hitpath.P_ARGS, hitpath.D_ARGS, hitpath.ROUTER_ARGS
    results: dict[str, list[dict[str, Any]]] = {}
    lg = LoadGen()
    try:
        with (
            start_stack(prefill_args=[p_args], decode_args=[d_args], name="instructions") as st,
            contextlib.ExitStack() as stack,
            tempfile.TemporaryDirectory(prefix="kvbaton-callgrind-") as tmp,
        ):
            assert st.redis_url is not None
            p_url, d_url = st.ps[0].url, st.ds[0].url

            def router(name: str, tree: Path) -> Arm:
                port = free_port()
                argv = serve_argv(
                    [p_url], [d_url], *router_args, *SLOW, port=port, redis_url=st.redis_url
                )
                return Arm(name, argv, tree, port)

            arms = [router("kvbaton", ROOT)]
            if base is not None:
                arms.append(router(f"kvbaton at {base}", stack.enter_context(worktree(base))))
            if floor:
                port = free_port()
                argv = ["bench.passthrough", str(port), p_url, d_url, "uvloop"]
                arms.append(
                    Arm("floor", argv, ROOT, port)
                    if chunks
                    else Arm("work floor", [*argv, st.redis_url], ROOT, port)
                )
            unit = "chunk" if chunks else "turn"
            for rnd in range(rounds):
                for arm in arms if rnd % 2 == 0 else arms[::-1]:
                    # Every measurement starts on an empty store, as the first of a run did:
                    # with the earlier ones' sessions and D's pin ledger left in it, the first
                    # read ~1.5% under the same code's later ones (measured; emptied, the
                    # same code's rounds agree within 0.6%).
                    empty_store(st.redis_url)
                    if chunks:
                        r = measure_chunks(arm, lg, streams=conversations, work=Path(tmp))
                        detail = f"events per stream {r['events']}"
                    else:
                        r = measure(
                            arm,
                            lg,
                            stream=kind == "stream",
                            conversations=conversations,
                            work=Path(tmp),
                        )
                        detail = f"later turns {r['later_turns']}"
                    results.setdefault(arm.name, []).append(r)
                    print(
                        f"round {rnd + 1}: {arm.name}: {_figure(r['instructions_per_turn'])}"
                        f" instructions per {unit} ({r['turns']} turns, {r['failed']} failed,"
                        f" {detail})",
                        flush=True,
                    )
    finally:
        lg.close()
    return results


def _figure(instructions: float) -> str:
    """Millions for a turn's count, thousands for a chunk's."""
    if instructions >= 1e6:
        return f"{instructions / 1e6:.3f} M"
    return f"{instructions / 1e3:.1f} k"


def summary(results: dict[str, list[dict[str, Any]]], unit: str = "turn") -> list[str]:
    """Per arm the median and range of instructions per turn (or chunk); each arm against
    the first, as a ratio and, per chunk, as the difference."""
    lines = []
    medians = {
        arm: statistics.median(r["instructions_per_turn"] for r in rows)
        for arm, rows in results.items()
    }
    first = next(iter(medians.values()), 0.0)
    scale, suffix, digits = (1e3, "k", 1) if unit == "chunk" else (1e6, "M", 3)
    for arm, rows in results.items():
        values = [r["instructions_per_turn"] / scale for r in rows]
        line = f"{arm}: {medians[arm] / scale:.{digits}f} {suffix} instructions per {unit}"
        line += f" (median of {len(values)}, {min(values):.{digits}f}-{max(values):.{digits}f})"
        if arm != next(iter(results)) and medians[arm]:
            line += f"; kvbaton is {first / medians[arm]:.3f}x this"
            if unit == "chunk":
                line += f", {(first - medians[arm]) / scale:.{digits}f} {suffix} above it"
        lines.append(line)
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.instructions", description=__doc__)
    ap.add_argument("--base", help="also measure the router of this commit (a git revision)")
    ap.add_argument("--kind", choices=KINDS, default="json")
    ap.add_argument(
        "--conversations",
        type=int,
        help="measured, 5 turns each (default 60); chunk kinds: streams of each length"
        " (default 24)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-floor", action="store_true", help="leave the (work) floor out")
    args = ap.parse_args(argv)
    if not available():
        print("python -m bench.instructions needs valgrind (Debian package valgrind)")
        return 2
    chunks = args.kind.startswith("chunk-")
    conversations = args.conversations or (24 if chunks else 60)
    results = run(
        base=args.base,
        kind=args.kind,
        conversations=conversations,
        rounds=args.rounds,
        floor=not args.no_floor,
    )
    print("\n".join(summary(results, "chunk" if chunks else "turn")))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
