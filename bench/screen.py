"""What a section shows in docs/benchmarks.md: one screen that answers one question.

Each part's module turns its results (the `results` of bench/results/<part>.json) into
screens with `screens(res, plan)`; bench/report.py lays them out and adds each part's
provenance line. A screen holds data, not Markdown: a table, the answer in a line or two,
and the plot's file name (written by bench/plots.py beside the report).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass(frozen=True)
class Screen:
    title: str  # "Side by side with other routers"
    question: str  # one sentence: what this screen answers, and how it was measured
    tables: list[Table] = field(default_factory=list)
    answer: list[str] = field(default_factory=list)  # who wins, by how much: a line or two
    plot: str | None = None  # a PNG beside the report
