"""4. What the session store costs per turn: its round trips, counted by a short MONITOR
sample outside the timed runs."""

from __future__ import annotations

import contextlib
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from bench.screen import Screen, Table
from bench.stack import LoadGen
from bench.stats import fmt
from harness.procs import stop
from harness.stack import Stack

_LINE = re.compile(r'^\d+\.\d+ \[\d+ ([^\]]+)\] "([^"]+)"')


@contextlib.contextmanager
def monitor(redis_url: str, path: Path) -> Iterator[None]:
    """`redis-cli MONITOR` into a file while the block runs (only for untimed samples)."""
    exe = shutil.which("redis-cli")
    if exe is None:
        raise RuntimeError("redis-cli is not installed")
    port = str(urlparse(redis_url).port)
    with open(path, "wb") as fh:
        proc = subprocess.Popen(
            [exe, "-h", "127.0.0.1", "-p", port, "monitor"], stdout=fh, stderr=subprocess.STDOUT
        )
        try:
            time.sleep(0.3)
            yield
            time.sleep(0.3)
        finally:
            stop(proc)


def parse_monitor(text: str) -> tuple[Counter[str], Counter[str]]:
    """(commands sent by clients, commands run inside scripts), lower-case names."""
    top: Counter[str] = Counter()
    inner: Counter[str] = Counter()
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        source, cmd = m.group(1), m.group(2).lower()
        (inner if source == "lua" else top)[cmd] += 1
    return top, inner


def monitor_sample(st: Stack, lg: LoadGen, spec: dict[str, Any]) -> dict[str, Any]:
    """Round trips per turn of a load-generator job (not a timed one: MONITOR slows Redis)."""
    assert st.redis_url is not None
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "monitor.txt"
        with monitor(st.redis_url, path):
            r = lg.run(spec, timeout=90.0)
        top, inner = parse_monitor(path.read_text(errors="replace"))
    ok = [t for t in r["turns"] if t["ok"]]
    return {
        "turns": len(ok),
        "first_turns": sum(1 for t in ok if t["turn"] == 1),
        "hits": sum(1 for t in ok if t["reuse"].startswith("hit")),
        "top": dict(top),
        "inner": dict(inner),
        "round_trips_per_turn": sum(top.values()) / len(ok) if ok else None,
    }


def screen(res: dict[str, Any]) -> Screen:
    """Section 4 from section 1's results: the MONITOR samples."""
    rows = []
    monitor = res.get("monitor", {})
    for mode, sample in monitor.items():
        n = max(1, sample["turns"])
        sent = ", ".join(f"{k} {v / n:.2f}" for k, v in sorted(sample["top"].items()))
        inner = fmt(sum(sample["inner"].values()) / n, 1)
        turns = f"{sample['turns']} ({sample['hits']} hits)"
        rows.append([mode, turns, fmt(sample["round_trips_per_turn"]), sent, inner])
    head = ["router", "turns", "round trips/turn", "sent per turn", "commands in scripts/turn"]
    trips = monitor.get("reuse", {}).get("round_trips_per_turn")
    answer = [f"A turn takes {fmt(trips)} round trips."]
    question = (
        "How many Redis round trips does a turn cost? redis-cli MONITOR on 4 conversations x 3 "
        "JSON turns, outside the timed runs."
    )
    return Screen("Redis cost per turn", question, [Table(head, rows)], answer)
