"""`python -m bench [--quick] [--out DIR]`: run the benchmarks, write the report and plots.

The full run writes docs/benchmarks.md and docs/bench-*.png; --quick (under 4 minutes) and
--only (some parts: not the whole report, which it would replace) write to a fresh temporary
directory unless --out is given.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench import (
    events,
    handover,
    headline,
    hit_throughput,
    hitpath,
    overhead,
    peers,
    pins,
    pins_faults,
    pins_mixed,
    plots,
    profile,
    report,
    reuse,
    throughput,
)
from bench.plan import FULL, QUICK, Plan
from bench.stack import LoadGen
from harness.procs import ROOT

PARTS = ("overhead", "throughput", "reuse", "events", "profile", "pins", "peers", "handover")
PNGS = {
    "overhead": "bench-overhead.png",
    "ttft": "bench-ttft.png",
    "throughput": "bench-throughput.png",
    "pins": "bench-pins.png",
    "peers": "bench-peers.png",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a small run (under 4 minutes)")
    p.add_argument(
        "--out",
        type=Path,
        help="report directory (default: docs/ for a full run, else a temp dir)",
    )
    p.add_argument("--only", nargs="+", choices=PARTS, help="run only these parts")
    p.add_argument("--raw", type=Path, help="also write the raw results as JSON here")
    p.add_argument("--from-raw", type=Path, help="only render the report from a raw JSON file")
    return p.parse_args(argv)


def planned_steps(plan: Plan, parts: tuple[str, ...], no_reuse: bool) -> int:
    """How many progress ticks the run will make (the bar's total)."""
    n = 0
    if "overhead" in parts:
        # the cells; 4 chunk-cost configurations and the passthrough, 2 runs each; the Redis
        # round trip and the bare relay; the long streams (8, 1,000 and 16,000 tokens)
        n += len(plan.overhead_counts) * 2 + 5 * 2 + 2 + 1 + len(overhead.LONG_TOKENS)
        n += hitpath.steps(plan)
    if "throughput" in parts:
        n += 2 * (1 + len(throughput.WORKERS)) * plan.sweep_steps + hit_throughput.steps(plan)
    if "reuse" in parts:
        arms = sum(len(reuse.arms_for(plan, cache, no_reuse)) for cache in reuse.CACHES)
        n += arms * plan.conv_rounds
    if "events" in parts:
        n += events.steps(plan)
    if "profile" in parts and plan.profile_s > 0:
        n += len(profile.PROFILES) + 1  # and the hits
    if "pins" in parts:
        n += pins.steps(plan) + pins_mixed.steps(plan) + pins_faults.steps(plan)
    if "peers" in parts:
        n += peers.steps(plan)
    if "handover" in parts:
        n += handover.steps(plan)
    return n


def router_has_no_reuse() -> bool:
    """Whether `kvbaton serve` has the --no-reuse flag (affinity only, never a handle)."""
    out = subprocess.run(
        [sys.executable, "-m", "router", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    return "--no-reuse" in out.stdout


def _versions() -> str:
    names = ("aiohttp", "hypercorn", "starlette", "msgspec", "redis")
    parts = [f"Python {platform.python_version()}"]
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            parts.append(f"{name} {importlib.metadata.version(name)}")
    exe = shutil.which("redis-server")
    if exe:
        text = subprocess.run([exe, "--version"], capture_output=True, text=True, check=False)
        parts.append("redis-server " + text.stdout.split("v=")[-1].split()[0])
    return ", ".join(parts)


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as fh:
        for line in fh:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def _commit() -> str:
    def git(*args: str) -> str:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return out.stdout.strip()

    head = git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = git("status", "--porcelain", "--", "router", "sessions", "vllm_sim")
    return head + (" (router/sessions/vllm_sim with uncommitted changes)" if dirty else "")


def _load() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def meta(argv: list[str]) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python -m bench", *argv]),
        "nproc": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "load_before": _load(),
        "versions": _versions(),
        "commit": _commit(),
    }


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM and SIGINT unwind as KeyboardInterrupt, so every started process is stopped."""

    def handler(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    # A shell starts background jobs with SIGINT ignored; Ctrl-C must still clean up.
    previous_int = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, previous_int)


class Progress:
    """A tqdm bar over the run's steps; a step counts as done when the next one starts."""

    def __init__(self, total: int) -> None:
        self.bar = tqdm(total=total, unit="step", dynamic_ncols=True, file=sys.stderr)
        self.label = ""
        self.since = time.monotonic()
        self.seconds: dict[str, float] = {}  # each step's wall time, for the record
        self.loads: list[float] = []  # the 1-minute load average as each step starts

    def _done(self) -> None:
        if self.label:
            self.seconds[self.label] = round(time.monotonic() - self.since, 2)
            self.bar.update(1)

    def tick(self, label: str) -> None:
        self._done()
        self.label, self.since = label, time.monotonic()
        self.loads.append(os.getloadavg()[0])
        self.bar.set_description(label)

    def close(self) -> None:
        self._done()
        self.label = ""
        self.bar.total = self.bar.n  # sweeps may stop early
        self.bar.refresh()
        self.bar.close()


def run_parts(
    plan: Plan, parts: tuple[str, ...], no_reuse: bool, tick: Callable[[str], None]
) -> dict[str, Any]:
    results: dict[str, Any] = {}
    with LoadGen() as lg:
        if "overhead" in parts:
            results["overhead"] = overhead.run(plan, lg, tick, no_reuse)
        if "throughput" in parts:
            results["throughput"] = throughput.run(plan, lg, tick)
            results["throughput"]["hits"] = hit_throughput.run(plan, lg, tick)
        if "reuse" in parts:
            results["reuse"] = reuse.run(plan, lg, tick, no_reuse)
        if "events" in parts:
            results["events"] = events.run(plan, lg, tick)
        if "profile" in parts and plan.profile_s > 0 and profile.available():
            results["profile"] = profile.run(plan, lg, tick)
        if "pins" in parts:
            results["pins"] = pins.run(plan, lg, tick)
            results["pins"]["mixed"] = pins_mixed.run(plan, lg, tick)
            results["pins"]["faults"] = pins_faults.run(plan, lg, tick)
        if "peers" in parts:
            results["peers"] = peers.run(plan, lg, tick)
        if "handover" in parts:
            results["handover"] = handover.run(plan, lg, tick)
    return results


def write(results: dict[str, Any], plan: Plan, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    pngs: dict[str, str] = {}
    if "overhead" in results:
        plots.overhead(results["overhead"], out / PNGS["overhead"])
        pngs["overhead"] = PNGS["overhead"]
    if "reuse" in results:
        plots.ttft(results["reuse"], plan.conv_turns, out / PNGS["ttft"])
        pngs["ttft"] = PNGS["ttft"]
    if "throughput" in results:
        plots.throughput(results["throughput"], out / PNGS["throughput"])
        pngs["throughput"] = PNGS["throughput"]
    if "pins" in results:
        plots.pins(results["pins"], out / PNGS["pins"])
        pngs["pins"] = PNGS["pins"]
    if results.get("peers", {}).get("scenarios"):
        plots.peers(results["peers"], out / PNGS["peers"])
        pngs["peers"] = PNGS["peers"]
    path = out / "benchmarks.md"
    path.write_text(report.render(results, plan, pngs))
    if "peers" in pngs and out.resolve() == (ROOT / "docs").resolve():
        meta = results.get("meta", {})
        source = (
            f"the run of {meta.get('date', '?')} UTC (`{meta.get('command', '?')}`, commit "
            f"{meta.get('commit', '?')})"
        )
        headline.update(ROOT / "README.md", headline.lines(results["peers"], source))
    return path


def report_dir(args: argparse.Namespace, parts: tuple[str, ...]) -> Path:
    """--out, else docs/ for a full run; a quick run, or some parts only, would replace the
    committed report with a partial one: a fresh temporary directory."""
    if args.out is not None:
        return Path(args.out)
    if args.quick or parts != PARTS:
        return Path(tempfile.mkdtemp(prefix="kvbaton-bench-"))
    return ROOT / "docs"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    if args.from_raw is not None:
        results = json.loads(args.from_raw.read_text())
        print(f"report: {write(results, plan, args.out or args.from_raw.parent)}")
        return 0
    parts = tuple(args.only) if args.only else PARTS
    out = report_dir(args, parts)
    started = time.monotonic()
    info = meta(argv)
    no_reuse = router_has_no_reuse()
    progress = Progress(planned_steps(plan, parts, no_reuse))
    try:
        with sigterm_as_interrupt():
            results = run_parts(plan, parts, no_reuse, progress.tick)
    except KeyboardInterrupt:
        progress.close()
        print("interrupted: every started process was stopped", file=sys.stderr)
        return 130
    progress.close()
    info.update(load_after=_load(), duration_s=time.monotonic() - started)
    info["step_seconds"] = progress.seconds
    info["step_loads"] = progress.loads
    results["meta"] = info
    results["flags"] = {"no_reuse": no_reuse}
    raw = args.raw
    if raw is None and out.resolve() != (ROOT / "docs").resolve():
        raw = out / "bench-results.json"  # docs/ holds only the report and its plots
    if raw is not None:
        raw.parent.mkdir(parents=True, exist_ok=True)
        raw.write_text(json.dumps(results, indent=1, default=str))
    path = write(results, plan, out)
    print(f"report: {path}")
    return 0
