"""`python -m bench [--quick] [--only PART ...] [--out DIR] [--render]`: run the benchmarks,
save each part's results, write the report and its plots.

Each part's results go to bench/results/<part>.json as soon as the part ends (with the
commit, machine, date and command that measured it), and docs/benchmarks.md is generated
from every file there: `--only` reruns some parts and keeps the others' results. A quick run,
or one with --out, writes DIR/results/ and DIR/benchmarks.md instead (a fresh temporary
directory by default). --render only regenerates the report from the results files.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.metadata
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
from types import ModuleType
from typing import Any

from tqdm import tqdm

from bench import (
    events,
    handover,
    headline,
    overhead,
    peers,
    pins,
    plots,
    profile,
    report,
    reuse,
    throughput,
)
from bench.plan import FULL, QUICK, Plan
from bench.stack import LoadGen
from harness.procs import ROOT

# Each part's module, in the order the parts run (the report has its own: report.PARTS):
# run(plan, lg, tick) gives its results, steps(plan) its progress ticks.
MODULES: dict[str, ModuleType] = {
    "overhead": overhead,
    "throughput": throughput,
    "reuse": reuse,
    "events": events,
    "profile": profile,
    "pins": pins,
    "peers": peers,
    "handover": handover,
}
PARTS = tuple(MODULES)
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs"
PNGS: dict[str, tuple[str, Callable[[dict[str, Any], Path], None]]] = {
    "overhead": ("bench-overhead.png", plots.overhead),
    "reuse": ("bench-ttft.png", plots.ttft),
    "throughput": ("bench-throughput.png", plots.throughput),
    "pins": ("bench-pins.png", plots.pins),
    "peers": ("bench-peers.png", plots.peers),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="a small run (under 4 minutes)")
    p.add_argument(
        "--out",
        type=Path,
        metavar="DIR",
        help="write DIR/results/ and DIR/benchmarks.md (default: bench/results/ and docs/ "
        "for the full plan, a temporary DIR for --quick)",
    )
    p.add_argument("--only", nargs="+", choices=PARTS, help="run only these parts")
    p.add_argument(
        "--render", action="store_true", help="only regenerate the report from the results files"
    )
    return p.parse_args(argv)


def planned_steps(plan: Plan, parts: tuple[str, ...]) -> int:
    """How many progress ticks the run will make (the bar's total)."""
    return sum(MODULES[name].steps(plan) for name in runnable(plan, parts))


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
    dirty = git("status", "--porcelain", "--", "router", "sessions", "vllm_sim", "bench/*.py")
    return head + (" (with uncommitted changes to the code)" if dirty else "")


def meta(argv: list[str]) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(["python -m bench", *argv]),
        "nproc": os.cpu_count(),
        "cpu_model": _cpu_model(),
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
        self.loads: list[float] = []  # the 1-minute load average as each step starts

    def _done(self) -> None:
        if self.label:
            self.bar.update(1)

    def tick(self, label: str) -> None:
        self._done()
        self.label = label
        self.loads.append(os.getloadavg()[0])
        self.bar.set_description(label)

    def close(self) -> None:
        self._done()
        self.label = ""
        self.bar.total = self.bar.n  # sweeps may stop early
        self.bar.refresh()
        self.bar.close()


def runnable(plan: Plan, parts: tuple[str, ...]) -> tuple[str, ...]:
    """The parts this machine and plan can run (the profile needs py-spy and time)."""
    skip = {"profile"} if plan.profile_s <= 0 or not profile.available() else set()
    return tuple(p for p in parts if p not in skip)


def run_parts(
    plan: Plan, parts: tuple[str, ...], argv: list[str], progress: Progress, folder: Path
) -> list[str]:
    """Run each part and save its results file as soon as it ends; the parts saved."""
    saved = []
    with LoadGen() as lg:
        for name in runnable(plan, parts):
            info, started, first = meta(argv), time.monotonic(), len(progress.loads)
            res = MODULES[name].run(plan, lg, progress.tick)
            info.update(
                gpu=dataclasses.asdict(plan.gpu),  # the simulators' cost model, as run
                duration_s=round(time.monotonic() - started, 1),
                step_loads=progress.loads[first:],
            )
            report.save(folder, name, plan, info, res)
            saved.append(name)
    return saved


def write(folder: Path, out: Path) -> Path:
    """The report and its plots in out, from the results files in folder; README's headline
    table too when the report is the committed one."""
    parts = report.load(folder)
    out.mkdir(parents=True, exist_ok=True)
    for part in parts:
        # (peers with every scenario skipped has nothing to draw)
        if part.name in PNGS and part.results.get("scenarios", True):
            png, draw = PNGS[part.name]
            draw(part.results, out / png)
    path = out / "benchmarks.md"
    path.write_text(report.render(parts))
    peers_part = next((p for p in parts if p.name == "peers"), None)
    # README's table stays a full run's: a quick one (fewer arms and scenarios) never replaces it
    if peers_part is not None and not peers_part.plan.quick and out.resolve() == DOCS.resolve():
        m = peers_part.meta
        source = f"the run of {m['date']} UTC (`{m['command']}`, commit {m['commit']})"
        headline.update(ROOT / "README.md", headline.lines(peers_part.results, source))
    return path


def folders(args: argparse.Namespace) -> tuple[Path, Path]:
    """(results folder, report folder): bench/results/ and docs/ for the full plan; a quick
    run, or one with --out, writes DIR/results/ and DIR/ (a fresh temporary DIR by default)
    so that the committed results keep the full plan's figures."""
    if args.out is None and not args.quick:
        return RESULTS, DOCS
    out = Path(args.out) if args.out is not None else Path(tempfile.mkdtemp(prefix="kvbaton-"))
    return out / "results", out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    plan = QUICK if args.quick else FULL
    folder, out = folders(args)
    if not args.render:
        parts = tuple(args.only) if args.only else PARTS
        progress = Progress(planned_steps(plan, parts))
        try:
            with sigterm_as_interrupt():
                run_parts(plan, parts, argv, progress, folder)
        except KeyboardInterrupt:
            progress.close()
            print("interrupted: every started process was stopped", file=sys.stderr)
            return 130
        progress.close()
    print(f"results: {folder}")
    print(f"report: {write(folder, out)}")
    return 0
