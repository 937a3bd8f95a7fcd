"""A P instance that answers 5xx, stalls past --prefill-timeout or refuses connections: the
turn goes to the other P within a bounded time and answers correctly; the instance is ejected
after --unhealthy-after consecutive failures (one stall is enough) and re-admitted once a
health probe passes."""

from __future__ import annotations

import time

import pytest

from harness.procs import SimProc, wait_until
from tests.reliability.conftest import PREFILL_TIMEOUT, UNHEALTHY_AFTER, Stack
from tests.reliability.helpers import (
    Conversation,
    faults,
    instance,
    metric,
    new_cid,
    pending_faults,
    placed,
    running,
    session,
    total,
)


def log_lines(main: Stack, text: str) -> int:
    return main.log.read_text(errors="replace").count(text)


def turns_until_consumed(main: Stack, p: SimProc, key: str, limit: int = 8) -> list[float]:
    """One-off turns (no conversation id) until P has taken its armed faults; their durations.

    Placement spreads turns over both P, so P is reached within a few turns."""
    durations = []
    for _ in range(limit):
        if pending_faults(p)[key] == 0:
            return durations
        started = time.monotonic()
        reply = Conversation(main.url, main.ref, None).turn()  # 200 and the oracle's answer
        durations.append(time.monotonic() - started)
        assert reply.reuse == "miss;reason=no-session"  # a new history session
    raise AssertionError(f"{p.url} still has {key} armed after {limit} turns")


def assert_ejected_then_readmitted(main: Stack, p: SimProc, before: tuple[int, int]) -> None:
    ejected = f"ejected prefill instance {p.url} after {UNHEALTHY_AFTER} failures"
    readmitted = f"re-admitted prefill instance {p.url}"
    wait_until(lambda: log_lines(main, ejected) > before[0], "not ejected", timeout=15)
    wait_until(lambda: log_lines(main, readmitted) > before[1], "not re-admitted")
    wait_until(lambda: instance(main.url, "prefill", p.url)["usable"], "not usable")


def log_marks(main: Stack, p: SimProc) -> tuple[int, int]:
    return (
        log_lines(main, f"ejected prefill instance {p.url}"),
        log_lines(main, f"re-admitted prefill instance {p.url}"),
    )


def test_prefill_5xx_goes_to_the_other_p_and_ejects(main: Stack) -> None:
    p = main.ps[0]
    marks = log_marks(main, p)
    errors = metric(main.url, "kvbaton_upstream_duration_seconds_count", instance=p.url)
    faults(p, fail_next=UNHEALTHY_AFTER, status=503)
    durations = turns_until_consumed(main, p, "fail_next")
    assert max(durations) < 10
    assert_ejected_then_readmitted(main, p, marks)
    assert metric(main.url, "kvbaton_upstream_duration_seconds_count", instance=p.url) > errors


@pytest.mark.timeout(60)
def test_prefill_stalling_past_the_timeout_goes_to_the_other_p(main: Stack) -> None:
    p = main.ps[0]
    marks = log_marks(main, p)
    stall = PREFILL_TIMEOUT + 2
    faults(p, stall_s=stall, stall_next=1)
    durations = turns_until_consumed(main, p, "stall_next")
    # The stalled turn waited --prefill-timeout, then went to the other P: bounded. One stall
    # ejects P at once (a stopped engine would hold every turn sent to it for the timeout).
    assert max(durations) < PREFILL_TIMEOUT + 8
    assert_ejected_then_readmitted(main, p, marks)


@pytest.mark.timeout(60)
def test_prefill_refusing_connections_goes_to_the_other_p(main: Stack) -> None:
    p = main.ps[0]
    marks = log_marks(main, p)
    p.proc.terminate()
    p.proc.wait(10)
    for _ in range(8):
        if not instance(main.url, "prefill", p.url)["healthy"]:
            break
        Conversation(main.url, main.ref, None).turn()  # 200 and the oracle's answer
    view = instance(main.url, "prefill", p.url)
    assert not view["healthy"] and view["failures"] >= UNHEALTHY_AFTER
    time.sleep(1.0)  # several failed health probes later: still out
    assert not instance(main.url, "prefill", p.url)["healthy"]
    assert log_lines(main, f"ejected prefill instance {p.url}") > marks[0]

    back = main.restart("prefill", 0)
    wait_until(lambda: instance(main.url, "prefill", back.url)["usable"], "not re-admitted")
    served = metric(back.url, "vllm:request_success_total")
    for _ in range(6):  # placement uses it again
        Conversation(main.url, main.ref, None).turn()
        if metric(back.url, "vllm:request_success_total") > served:
            break
    assert metric(back.url, "vllm:request_success_total") > served


@pytest.mark.timeout(60)
def test_prefill_timeout_never_sends_the_handle_to_a_second_p(main: Stack) -> None:
    conv = Conversation(main.url, main.ref, new_cid("p-timeout"))
    conv.turn()
    assert conv.cid is not None
    fields = session(main.redis_url, conv.cid)
    p, d = placed(main.ps, fields["prefill"]), placed(main.ds, fields["decode"])
    unknown = total(main.engines, "vllm_sim:notify_unknown_total")
    faults(p, stall_s=PREFILL_TIMEOUT + 1.5)
    # The stalled P times out while it may still read the handle: the other P computes the
    # turn as a miss (a handle is never sent to two P legs), and answers correctly.
    assert conv.turn().reuse.startswith("miss;reason=")
    wait_until(lambda: pending_faults(p)["stall_next"] == 0, "stall not taken")
    time.sleep(2.0)  # the stalled P wakes up and runs the request it was sent
    wait_until(lambda: running(p) == 0 and running(d) == 0, "engines still busy")
    assert total(main.engines, "vllm_sim:notify_unknown_total") == unknown
