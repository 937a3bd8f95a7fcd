"""`python -m bench`'s command line: where the report goes."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import cli
from harness.procs import ROOT

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("argv", "in_docs"),
    [([], True), (["--quick"], False), (["--only", "pins"], False), (["--only", *cli.PARTS], True)],
)
def test_only_a_full_run_writes_the_committed_report(argv: list[str], in_docs: bool) -> None:
    """A quick run or one part alone goes to a temporary folder: docs/ keeps the full report."""
    args = cli.parse_args(argv)
    out = cli.report_dir(args, tuple(args.only) if args.only else cli.PARTS)
    assert (out == ROOT / "docs") is in_docs
    if not in_docs:
        assert out.is_dir() and not any(out.iterdir())
        out.rmdir()
    assert cli.report_dir(cli.parse_args([*argv, "--out", "/x"]), cli.PARTS) == Path("/x")
