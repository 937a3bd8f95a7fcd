"""README's headline table: the peers' later-turn TTFT per arm and scenario, from one run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from bench import peers
from bench.stats import table

START = "<!-- bench:peers:start (written by a full `make bench`: bench/headline.py) -->"
END = "<!-- bench:peers:end -->"


def lines(res: dict[str, Any], source: str) -> list[str]:
    """The report's summary table and, per scenario, who is lowest at p50."""
    t = peers.summary_table(res["scenarios"])
    return [
        START,
        "",
        f"TTFT after turn 1, p50 / p90 in ms, from {source}; details in "
        "[docs/benchmarks.md](docs/benchmarks.md#side-by-side-with-other-routers).",
        "",
        *table(t.header, t.rows),
        *peers.winners(res["scenarios"]),
        "",
        END,
    ]


def update(readme: Path, block: list[str]) -> bool:
    """Replace the block between the markers in readme; False where it has none."""
    text = readme.read_text()
    start, end = text.find(START), text.find(END)
    if start < 0 or end < start:
        return False
    readme.write_text(text[:start] + "\n".join(block) + text[end + len(END) :])
    return True
