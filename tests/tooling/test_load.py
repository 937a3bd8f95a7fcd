"""The load test's quick variant (40 conversations x 3 turns, every fault of the full run):
no failed request where a path existed, no handle used twice, no wrong answer."""

from __future__ import annotations

import asyncio

import pytest

from loadtest.cli import parse
from loadtest.run import Plan, failed_before_kill, run_plan, start_stack


@pytest.mark.timeout(120)
def test_quick_load_with_faults() -> None:
    plan = Plan(conversations=40, turns=3, concurrency=40, time_limit=60)
    with start_stack("load-quick") as stack:
        result = asyncio.run(run_plan(stack, plan))
    print("\n" + result.table())
    assert result.complete
    assert result.sent == 120
    assert len(result.faults) == 10, result.faults
    assert result.failed == 0, result.failures
    assert result.used_twice == 0
    assert result.wrong == 0
    # None but the killed D's: a read naming it (in flight at the kill, or sent before the
    # router saw the new process) fails and P recomputes; the oracle still checks the answer.
    assert result.failed_before_kill == 0, result.table()
    assert result.hits > 0 and result.engine["kv_pulled_tokens"] > 0


@pytest.mark.unit
def test_failed_transfers_are_counted_up_to_the_kill() -> None:
    before = {"failed_transfers": 2.0}
    # The run's 5 (the killed D's too); the counters read 3 at the kill, 2 at the start.
    run = {"failed_transfers": 5.0}
    assert failed_before_kill(before, run, {"transfers_failed_at_kill": 3.0}) == 1
    assert failed_before_kill(before, run, {"transfers_failed_at_kill": 2.0}) == 0
    assert failed_before_kill(before, run, {}) == 5  # no kill: every one of the run's


@pytest.mark.unit
def test_command_line_plans() -> None:
    quick, path = parse(["--quick", "--json", "out.json"])
    assert (quick.conversations, quick.turns, quick.concurrency) == (40, 3, 40)
    assert quick.faults and path == "out.json"
    plan, _ = parse(["--conversations", "10", "--turns", "2", "--no-faults"])
    assert (plan.conversations, plan.turns, plan.concurrency, plan.faults) == (10, 2, 10, False)
