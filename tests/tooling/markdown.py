"""Markdown tables read back from the reports the tooling writes."""

from __future__ import annotations

import re

_UNESCAPED_PIPE = re.compile(r"(?<!\\)\|")


def tables(markdown: str) -> list[list[list[str]]]:
    """Every Markdown table as rows of cells (header first, separator dropped)."""
    found: list[list[list[str]]] = []
    current: list[list[str]] = []
    for line in [*markdown.splitlines(), ""]:
        if line.startswith("|"):
            cells = [c.strip() for c in _UNESCAPED_PIPE.split(line.strip())[1:-1]]
            if not all(set(c) <= {"-"} for c in cells):
                current.append(cells)
        elif current:
            found.append(current)
            current = []
    return found
