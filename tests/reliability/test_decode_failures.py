"""D failing: after the first byte (one SSE error event, the stream closes, nothing committed),
stalling past --decode-first-byte-timeout (the turn is redone with a new P leg), restarting
with a new engine id (its handles are not used), and expiring its pinned blocks (P declines a
late read because the handle carries D's deadline)."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator

import pytest

from harness.chat import JSON, post
from harness.procs import SimProc, wait_until
from harness.router import RouterProc
from router.engines.identity import REFUSALS_TO_PAUSE
from tests.reliability.conftest import ADMIN_KEY, FIRST_BYTE_TIMEOUT, ROUTER_FLAGS, Stack
from tests.reliability.helpers import (
    Conversation,
    advance_clock,
    faults,
    instance,
    metric,
    new_cid,
    placed,
    router,
    running,
    session,
    total,
)


def started(main: Stack, tag: str, via: str = "") -> tuple[Conversation, SimProc]:
    """A conversation after one committed turn (through `via`, a router on main's engines, or
    main's router), and the D holding its KV."""
    conv = Conversation(via or main.url, main.ref, new_cid(tag))
    assert conv.turn().reuse == "miss;reason=no-session"
    assert conv.cid is not None
    return conv, placed(main.ds, session(main.redis_url, conv.cid)["decode"])


@pytest.mark.parametrize(
    ("fault", "abort_reason"),
    [
        ({"drop_after_chunks": 2, "drop_next": 1}, "decode-broke"),
        ({"error_after_chunks": 2, "error_next": 1}, "decode-error-event"),
    ],
    ids=["connection-dropped", "error-event"],
)
def test_decode_failing_after_the_first_byte(
    main: Stack, fault: dict[str, int], abort_reason: str
) -> None:
    conv, d = started(main, "d-broke")
    aborted = metric(main.url, "kvbaton_turns_aborted_total", reason=abort_reason)
    faults(d, **fault)
    reply = conv.turn(stream=True, max_tokens=12, check=False)
    assert reply.status == 200 and reply.reuse == "hit"
    events = [e for e in reply.events() if e != b"[DONE]"]
    errors = reply.error_events()
    assert len(errors) == 1 and isinstance(errors[0].get("message"), str)
    assert json.loads(events[-1]) == {"error": errors[0]}, "the error event is the last event"
    assert 1 <= len(events) - 1 < 12, "some chunks, then the error, not the whole answer"
    assert all(b'"finish_reason":"length"' not in e for e in events)
    assert metric(main.url, "kvbaton_turns_aborted_total", reason=abort_reason) == aborted + 1
    # Nothing was committed: the handle the failed turn took is gone, and the turn after
    # computes from scratch (and answers correctly).
    assert conv.turn().reuse == "miss;reason=no-handle"
    assert conv.turn().reuse == "hit"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_decode_stalling_past_the_first_byte_timeout_redoes_the_turn(
    main: Stack, stream: bool
) -> None:
    conv, d = started(main, "d-stall")
    legs = total(main.ps, "vllm:request_success_total")
    faults(d, stall_s=FIRST_BYTE_TIMEOUT + 2)
    reply = conv.turn(stream=stream)  # 200 and the oracle's answer, from the other D
    assert reply.reuse == "miss;reason=decode-retried"
    assert total(main.ps, "vllm:request_success_total") == legs + 2, "a new P leg for the redo"
    assert session(main.redis_url, str(conv.cid))["decode"] != d.url
    wait_until(lambda: running(d) == 0, "the stalled D is still running")
    assert conv.turn().reuse == "hit"


def stale_uses(main: Stack) -> float:
    """P's reads and free notifications that failed (an engine id or address that is gone)."""
    return total(main.ps, "vllm:nixl_num_failed_transfers_total") + total(
        main.ps, "vllm:nixl_num_failed_notifications_total"
    )


def on_first_decode(main: Stack, tag: str, count: int, via: str = "") -> list[Conversation]:
    """`count` conversations whose last turn ran on main.ds[0]."""
    found: list[Conversation] = []
    for _ in range(6 * count):
        conv, d = started(main, tag, via)
        if d.url == main.ds[0].url:
            found.append(conv)
            if len(found) == count:
                return found
    raise AssertionError("placement never chose the first D")


def restart_seen(main: Stack, index: int, *extra: str) -> SimProc:
    """Restart a D (new process, new engine id) and wait until the router's health loop has
    read its new process start time."""
    d = main.restart("decode", index, *extra)
    wait_seen(main, d)
    return d


def wait_seen(main: Stack, d: SimProc, via: str = "") -> None:
    """Wait until the router's health loop has read this D's process start time."""
    started_at = metric(d.url, "process_start_time_seconds")
    wait_until(
        lambda: instance(via or main.url, "decode", d.url)["started"] == started_at,
        "the router did not see the restart",
    )


@pytest.mark.timeout(60)
def test_a_restarted_decodes_old_handles_never_reach_prefill(main: Stack) -> None:
    first, second = on_first_decode(main, "d-restart", 2)
    restarts = metric(main.url, "kvbaton_backend_restarts_total", role="decode")
    restart_seen(main, 0, "--engine-id", f"restarted-{uuid.uuid4()}")
    assert metric(main.url, "kvbaton_backend_restarts_total", role="decode") == restarts + 1
    failed = stale_uses(main)
    for conv in (first, second):  # each answer is the oracle's (Conversation checks it)
        assert conv.turn().reuse == "miss;reason=decode-restarted"
    assert stale_uses(main) == failed, "P was sent a handle naming the old D"
    assert second.turn().reuse == "hit"  # reuse resumes on the new engine


@contextlib.contextmanager
def checking_every(
    main: Stack, interval: float, *extra: str, prefill: list[SimProc] | None = None
) -> Iterator[RouterProc]:
    """A second router on main's engines (or these P) whose health loop runs every
    `interval` seconds, with `extra` flags."""
    args = [*ROUTER_FLAGS, *extra]
    args[args.index("--health-interval") + 1] = str(interval)
    ps, ds = [p.url for p in prefill or main.ps], [d.url for d in main.ds]
    with router(ps, ds, *args, redis_url=main.redis_url, name=f"rel-health-{interval}") as r:
        yield r


@pytest.mark.timeout(60)
def test_a_restart_the_router_has_not_seen_yet_is_caught_by_the_engine_id(main: Stack) -> None:
    """With no health read between a restart and the next turns, the old handle goes to P; P
    refuses it (its engine id is gone) and the prefill is redone as a miss. Once the new D made
    a handle, the changed engine id alone marks older handles, and the new ones are used."""
    # The pin sweep reads every D's /metrics each second (as the health loop does): off here,
    # or a read in the restart's gap marks D unreachable (decode-unreachable, not this test).
    with checking_every(main, 600, "--no-release-pins") as blind:
        first, second = on_first_decode(main, "d-fast", 2, via=blind.url)
        d = main.restart("decode", 0, "--engine-id", f"restarted-{uuid.uuid4()}")
        failed = stale_uses(main)
        assert first.turn().reuse == "miss;reason=handle-rejected"  # and the oracle's answer
        assert stale_uses(main) == failed + 1, "P tried the old handle once"
        assert session(main.redis_url, str(first.cid))["decode"] == d.url
        assert second.turn().reuse == "miss;reason=decode-restarted"
        assert stale_uses(main) == failed + 1
        assert [second.turn().reuse, first.turn().reuse] == ["hit", "hit"]
        assert session(main.redis_url, str(second.cid))["decode"] == d.url


@pytest.mark.timeout(90)
def test_a_restart_with_a_fixed_engine_id_never_reads_an_old_handle(main: Stack) -> None:
    """An engine id fixed in kv_transfer_config survives a restart: only the start time tells
    the new process from the old. While the health loop cannot connect, D's handles wait; once
    it reads the new start time, that marks the old ones. P keeps the old process's NIXL agent
    (as vLLM does), so it refuses the new process's handles too: after three in a row that P
    gets none of them for a while, and turns are plain misses without a failed P leg. Every
    answer is the oracle's. (One P; health read every 2 s, so the turn after the restart comes
    before the read.)"""
    with checking_every(main, 2.0, prefill=main.ps[:1]) as slow:
        (conv,) = on_first_decode(main, "d-fixed", 1, via=slow.url)
        assert conv.turn().reuse == "hit"  # P reads from D: it now knows D's agent
        old = main.ds[0]

        def unreachable() -> None:
            wait_until(lambda: instance(slow.url, "decode", old.url)["unreachable"], "not down")

        d = main.restart("decode", 0, "--engine-id", old.engine_id, down=unreachable)
        try:
            assert d.engine_id == old.engine_id
            first = conv.turn().reuse  # the old handle: never sent to P
            assert first in ("miss;reason=decode-unreachable", "miss;reason=decode-restarted")
            wait_seen(main, d, via=slow.url)
            assert not instance(slow.url, "decode", d.url)["unreachable"]
            failed = stale_uses(main)
            reasons = [conv.turn().reuse for _ in range(REFUSALS_TO_PAUSE)]
            assert reasons == ["miss;reason=handle-rejected"] * REFUSALS_TO_PAUSE
            assert stale_uses(main) == failed + REFUSALS_TO_PAUSE
            assert conv.turn().reuse == "miss;reason=reads-paused"
            assert stale_uses(main) == failed + REFUSALS_TO_PAUSE, "no P leg with a handle"
            paused = instance(slow.url, "decode", d.url)["reads_paused"]
            assert list(paused) == [main.ps[0].url] and 0 < paused[main.ps[0].url] <= 30
        finally:  # main's P must not keep the stale agent for the next tests
            main.restart("decode", 0)


@pytest.mark.timeout(60)
def test_decode_stopped_is_ejected_and_its_handles_are_not_used(main: Stack) -> None:
    (conv,) = on_first_decode(main, "d-down", 1)
    d = main.ds[0]
    d.proc.terminate()
    d.proc.wait(10)
    for _ in range(10):  # one-off turns: those placed on the dead D are redone on the other
        if not instance(main.url, "decode", d.url)["healthy"]:
            break
        Conversation(main.url, main.ref, None).turn()
    assert not instance(main.url, "decode", d.url)["healthy"]
    failed = stale_uses(main)
    assert conv.turn().reuse == "miss;reason=decode-unhealthy"  # and the oracle's answer
    assert stale_uses(main) == failed, "P was sent a handle naming the dead D"
    back = main.restart("decode", 0)
    wait_until(lambda: instance(main.url, "decode", back.url)["usable"], "not re-admitted")


def test_decode_removed_by_the_admin_api_its_handles_are_not_used(main: Stack) -> None:
    (conv,) = on_first_decode(main, "d-removed", 1)
    d = main.ds[0]
    admin = {**JSON, "Authorization": f"Bearer {ADMIN_KEY}"}
    removed = post(main.url + "/admin/instances?url=" + d.url, method="DELETE", headers=admin)
    assert removed.status == 200, removed.body
    try:
        failed = stale_uses(main)
        assert conv.turn().reuse == "miss;reason=decode-removed"
        assert stale_uses(main) == failed
        assert session(main.redis_url, str(conv.cid))["decode"] == main.ds[1].url
    finally:
        body = {"role": "decode", "url": d.url}
        assert post(main.url + "/admin/instances", body, headers=admin).status in (200, 201)


def test_decode_side_expiry_makes_p_decline_a_late_read(main: Stack) -> None:
    conv, d = started(main, "d-expiry")
    handle = json.loads(session(main.redis_url, str(conv.cid))["kv_transfer_params"])
    assert isinstance(handle["remote_blocks_expiry_time"], float)
    declined = total(main.ps, "vllm_sim:reads_declined_total")
    served = metric(d.url, "vllm_sim:reads_served_total")
    # D's clock past its decoder_kv_blocks_ttl: its pins expire and its blocks may be reused.
    assert advance_clock(d, 500.0) >= 1
    reply = conv.turn()  # the router's own TTL has not expired: it sends the handle
    assert reply.reuse == "miss;reason=handle-rejected"
    assert total(main.ps, "vllm_sim:reads_declined_total") == declined + 1
    assert metric(d.url, "vllm_sim:reads_served_total") == served, "no read of freed blocks"
