"""`python -m bench`'s command line: where the results and the report go, and the report
generated from results files."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bench import cli, report
from bench.plan import EARLIER, FULL, QUICK

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("argv", "committed"),
    [([], True), (["--only", "pins"], True), (["--render"], True), (["--quick"], False)],
)
def test_only_the_full_plan_writes_the_committed_results(argv: list[str], committed: bool) -> None:
    """The full plan, all parts or some, saves to bench/results/ and regenerates docs/; a
    quick run goes to a fresh temporary folder, so the committed results keep full figures."""
    results, out = cli.folders(cli.parse_args(argv))
    if committed:
        assert (results, out) == (cli.RESULTS, cli.DOCS)
    else:
        assert results == out / "results" and out.is_dir() and not any(out.iterdir())
        out.rmdir()
    assert cli.folders(cli.parse_args([*argv, "--out", "/x"])) == (Path("/x/results"), Path("/x"))


META = {
    "date": "2026-12-07 01:00:00",
    "command": "python -m bench --only handover",
    "nproc": 2,
    "cpu_model": "AMD EPYC",
    "versions": "Python 3.11.7",
    "commit": "abc1234",
    "duration_s": 61.0,
    "step_loads": [0.5, 1.5, 1.0],
    "gpu": dataclasses.asdict(QUICK.gpu),
}


def test_a_results_file_round_trips_and_says_where_it_comes_from(tmp_path: Path) -> None:
    res = {"scenarios": {}, "skipped": [], "commands": {}}
    report.save(tmp_path, "peers", QUICK, META, res)
    report.save(tmp_path, "nothing-we-know", FULL, META, res)  # not a part: not read
    (part,) = report.load(tmp_path)
    assert (part.name, part.plan, part.meta, part.results) == ("peers", QUICK, META, res)
    line = report.provenance(part)
    for what in ("2026-12-07 01:00:00 UTC", "abc1234", "`python -m bench --only handover`"):
        assert what in line
    assert "quick plan, 61 s" in line and "2 CPUs (AMD EPYC)" in line
    assert "load at the median step 1.00" in line and "cost model then" not in line


def test_a_part_measured_on_another_cost_model_says_which(tmp_path: Path) -> None:
    """A results file from before the forward's fixed cost records no profile: the earlier
    one's figures are named in its run's line, the code's in the Cost model section."""
    meta = {k: v for k, v in META.items() if k != "gpu"}
    report.save(tmp_path, "peers", QUICK, meta, {"scenarios": {}, "skipped": [], "commands": {}})
    (part,) = report.load(tmp_path)
    assert part.plan.gpu == EARLIER
    line = report.provenance(part)
    assert "cost model then: `prefill_ms_per_token` 0.046, `first_token_forward_ms` 0" in line
    text = report.render([part])
    assert f"--first-token-forward-ms {FULL.gpu.first_token_forward_ms:g}" in text


def test_the_report_names_the_parts_not_measured_yet(tmp_path: Path) -> None:
    report.save(tmp_path, "peers", QUICK, META, {"scenarios": {}, "skipped": [], "commands": {}})
    text = report.render(report.load(tmp_path))
    assert text.startswith("# kvbaton benchmarks\n")
    assert "## Side by side with other routers" in text and "## Targets" in text
    assert "## Cost model" in text
    others = [p for p in report.PARTS if p != "peers"]
    assert f"Not measured yet: {', '.join(others)}." in text
