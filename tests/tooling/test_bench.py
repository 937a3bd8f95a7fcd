"""`python -m bench --quick` writes a well-formed report and plots (numbers not judged)."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import peer_venv, peers
from bench.cli import PNGS
from harness.procs import ROOT
from harness.waiting import scaled
from tests.tooling.markdown import tables

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
NUMBER = re.compile(r"-?\d[\d,]*(\.\d+)?")


def section(markdown: str, heading: str) -> str:
    start = markdown.index(heading)
    end = markdown.find("\n## ", start + len(heading))
    return markdown[start : end if end > 0 else None]


TITLES = (
    "## Side by side with other routers",
    "## Targets",
    "## Router overhead",
    "## Redis cost per turn",
    "## Throughput",
    "## What reuse buys",
    "## KV events",
    "## D's memory: pinned handles over time",
    "## The handover",
    "## Cost model",
)


def results(out: Path) -> dict[str, Any]:
    """Each part's results, by part, from the run's results files."""
    return {
        path.stem: json.loads(path.read_text())["results"]
        for path in sorted((out / "results").glob("*.json"))
    }


def check_png(path: Path) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE), f"{path.name} is not a PNG"
    length, kind = struct.unpack(">I4s", data[8:16])
    width, height = struct.unpack(">II", data[16:24])
    assert kind == b"IHDR" and length == 13 and width > 100 and height > 100
    assert data.endswith(b"IEND\xaeB`\x82"), f"{path.name} is truncated"


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "bench", "--quick", "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        # meant to take under 4 minutes; on a loaded machine it takes longer (and the test's
        # own timeout scales)
        timeout=scaled(600),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"report: {out / 'benchmarks.md'}" in proc.stdout
    assert f"results: {out / 'results'}" in proc.stdout
    return out


@pytest.mark.timeout(630)
def test_quick_run_report_reads_at_a_glance(quick_run: Path) -> None:
    """Every screen and plot, under 300 lines, each part with the run it comes from."""
    report = (quick_run / "benchmarks.md").read_text()
    for heading in TITLES:
        assert f"\n{heading}\n" in report, heading
    assert report.index(TITLES[0]) < report.index(TITLES[1])  # who wins comes first
    assert len(report.splitlines()) < 300
    for name, _draw in PNGS.values():
        check_png(quick_run / name)
        assert f"]({name})" in report, f"the report does not show {name}"
    # the quick plan profiles nothing (profile_s 0): every other part, each its provenance line
    parts = {"overhead", "throughput", "reuse", "events", "pins", "peers", "handover"}
    assert set(results(quick_run)) == parts
    for part in parts:
        assert re.search(rf"^\*{part}: .* UTC, commit .*quick plan", report, re.M), part
    assert "Not measured yet: profile." in report


@pytest.mark.timeout(630)
def test_quick_run_writes_every_part(quick_run: Path) -> None:
    raw = results(quick_run)
    # Router overhead: the same conversations, JSON and streamed, through kvbaton (turns 2..
    # hit), the floor and the work floor, every turn answered.
    cells = raw["overhead"]["cells"]
    assert {(c["stream"], c["concurrency"]) for c in cells} == {
        (stream, n) for stream in (False, True) for n in (1, 16)
    }
    for cell in cells:
        assert all(cell[arm]["failed"] == 0 for arm in ("kvbaton", "floor", "work")), cell
        assert set(cell["kvbaton"]["reuse"]) == {"hit"}, cell["kvbaton"]["reuse"]
        assert cell["kvbaton"]["cpu_ms_per_turn"] > 0 and cell["floor"]["later"]["n"] > 0
    assert raw["overhead"]["monitor"]["reuse"]["round_trips_per_turn"] > 0
    # KV events: the same conversations through both routers.
    per_turn = raw["events"]["per_turn"]
    for name in ("events-on", "events-off"):
        assert per_turn[name]["failed"] == 0, per_turn[name]
        # P runs at vLLM's defaults: a short answer is recomputed from P's own cache
        # (`hit;via=prefill-cache`), a longer lack read from D (`hit`); every later turn reuses.
        reuse = per_turn[name]["reuse"]
        assert reuse and all(v.startswith("hit") for v in reuse), per_turn[name]
    # Throughput: a JSON and a streaming sweep of first turns against the pinned router.
    sweeps = raw["throughput"]["sweeps"]
    assert set(sweeps) == {"json", "stream"}
    assert all(step["achieved"] > 0 for s in sweeps.values() for step in s["steps"])
    # Hit turns against the pinned router: every level answered, its later turns hits.
    levels = raw["throughput"]["hits"]["levels"]
    assert [x["clients"] for x in levels] == [8]
    for x in levels:
        assert x["failed"] == 0 and x["turns_s"] > 0 and x["cpu_ms_per_turn"] > 0, x
        assert x["later"] > 0 and x["hits"] == x["later"], x
    # D's memory: the same arrivals with releases on and off; what kvbaton released is gone
    # from D by the end, what the other arm left is still pinned (the engine's 480 s TTL).
    arms = raw["pins"]["arms"]
    assert set(arms) == {"releases on", "releases off"}
    for arm in arms.values():
        assert arm["summary"]["ok"] > 0 and arm["series"], arm["summary"]
    assert sum(arms["releases on"]["releases"].values()) > 0
    assert arms["releases off"]["releases"] == {}
    assert (
        arms["releases on"]["series"][-1]["pinned"] < arms["releases off"]["series"][-1]["pinned"]
    )


@pytest.mark.timeout(630)
def test_quick_run_handover_arms_answer_alike(quick_run: Path) -> None:
    """The handover (vllm#51919): every arm answered every turn, the same answers."""
    handover = results(quick_run)["handover"]
    assert handover["same_answers"] is True
    for arm in handover["arms"].values():
        assert arm["failed"] == 0 and {k.split(";")[0] for k in arm["reuse"]} == {"hit"}, arm


@pytest.mark.timeout(630)
def test_quick_run_side_by_side(quick_run: Path) -> None:
    report = (quick_run / "benchmarks.md").read_text()
    raw = results(quick_run)
    # Side by side with vllm-router (from PyPI): the same arrivals, the same answers.
    peer_arms = raw["peers"]["scenarios"]["arrivals"]["arms"]
    assert set(peer_arms) == {"kvbaton", "vllm-router cache_aware"}, raw["peers"]["skipped"]
    for name, arm in peer_arms.items():
        s = arm["summary"]
        assert s["turns"] > 0 and s["failed"] == 0, (name, s)
        assert s["compared"] > 0 and s["differ"] == 0, (name, s)
    assert peer_arms["kvbaton"]["summary"]["reuse"].get("hit", 0) > 0
    # vLLM's multi-turn benchmark, unchanged, through the same arms: every request answered,
    # the same answers, kvbaton's P read D's KV. Skipped with one line only without a tree.
    multiturn = peers.MULTITURN.name
    if not peer_venv.vllm_tree().exists():
        assert raw["peers"]["skipped_scenarios"] == [multiturn]
        assert f"- skipped: {multiturn} (no vLLM tree" in report
        return
    assert raw["peers"]["skipped_scenarios"] == []
    mt_arms = raw["peers"]["scenarios"][multiturn]["arms"]
    assert set(mt_arms) == set(peer_arms)
    for name, arm in mt_arms.items():
        s = arm["summary"]
        assert not any(r.get("error") for r in arm["rounds"]), (name, arm["rounds"])
        # 4 conversations x 3 turns: measured, or answered without the benchmark's measurement
        assert s["turns"] + s["unmeasured"] == 12 and s["failed"] == 0, (name, s)
        # every answer compared, those it did not measure too
        assert s["compared"] == 12 and s["differ"] == 0, (name, s)
        assert 8 - s["unmeasured"] <= s["ttft_later"]["n"] <= 8 and s["goodput"] > 0, (name, s)
    # (kvbaton's P reads D's KV only where a pull pays: the quick config's short answers are
    # recomputed on the affinity P, whose prefix cache holds the rest; nothing to assert here)
    summary = tables(section(report, "## Side by side with other routers"))[0]
    assert summary[0] == ["arm", "arrivals", multiturn]


@pytest.mark.timeout(630)
def test_tables_are_rectangular_and_numbers_parse(quick_run: Path) -> None:
    report = (quick_run / "benchmarks.md").read_text()
    all_tables = tables(report)
    assert len(all_tables) >= 10
    for rows in all_tables:
        assert all(len(row) == len(rows[0]) for row in rows), rows[0]
    # The targets' measured values and the overhead latencies are numbers.
    targets = tables(section(report, "## Targets"))[0]
    assert targets[0] == ["target", "reference", "measured", "met"]
    for _target, reference, measured, met in targets[1:]:
        assert NUMBER.search(measured), measured
        assert reference and met in ("yes", "**no**", "n/a", "figure")
    named = " ".join(row[0] for row in targets[1:])
    for what in (
        "own added p50 on first turns",
        "own added p50 on hits",
        "router CPU per turn: <= 1.25x the work floor's",
        "every turn after the first: within 10% of the limit",
        "hit turns/s, one core",
    ):
        assert what in named, what
    # The overhead's latencies and reuse's TTFT beside the cost model's limit are numbers.
    overhead = tables(section(report, "## Router overhead"))[0]
    for row in overhead[1:]:
        for cell in row[2:7]:  # floor / kvbaton p50s, kvbaton - floor p50s and p99s, CPU
            assert all(float(x) == float(x) for x in cell.split(" / ")), cell
    reuse_table = tables(section(report, "## What reuse buys"))[0]
    assert reuse_table[0][:2] == ["arm", "P cache"]
    for row in reuse_table[1:]:
        for cell in row[2:5]:  # turn 1 p50, the last turn's p50 / p90, its limit
            assert all(float(x) > 0 for x in cell.split(" / ")), cell
