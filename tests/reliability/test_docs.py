"""docs/reliability.md stays true: every test it names exists."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
DOC = TESTS.parent / "docs" / "reliability.md"


def test_every_test_named_in_the_reliability_doc_exists() -> None:
    text = DOC.read_text()
    named = re.findall(r"`([a-z0-9_/]+/test_\w+\.py)(?:::(\w+))?", text)
    assert len(named) > 30
    for path, name in named:
        source = TESTS / path
        assert source.is_file(), f"docs/reliability.md names {path}, which does not exist"
        if name:
            assert re.search(rf"^(async )?def {name}\(", source.read_text(), re.MULTILINE), (
                f"docs/reliability.md names {path}::{name}, which does not exist"
            )
    # Shorthand rows (`::test_name` after a full reference) name tests of the file before.
    for row in text.splitlines():
        files = re.findall(r"`([a-z0-9_/]+\.py)::", row)
        for name in re.findall(r"`::(\w+)", row):
            assert files and re.search(
                rf"^def {name}\(", (TESTS / files[-1]).read_text(), re.MULTILINE
            ), f"docs/reliability.md names ::{name} without its file"
