"""Redis stopped, restarted or hung under load: every turn still answers correctly, without
reuse while the store is away; a circuit breaker keeps the failures from costing every request
a timeout; reuse resumes once Redis is back."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from harness.metrics import metric
from harness.procs import wait_until
from harness.waiting import scaled, timeout_scale
from tests.reliability.conftest import ROUTER_FLAGS, STORE_RETRY_AFTER, Stack
from tests.reliability.helpers import Conversation, new_cid, router
from tests.support.slow_redis import slow_redis

UNAVAILABLE = "miss;reason=store-unavailable"


def conversations(main: Stack, n: int, tag: str) -> list[Conversation]:
    convs = [Conversation(main.url, main.ref, new_cid(tag)) for _ in range(n)]
    for conv in convs:
        assert conv.turn().reuse == "miss;reason=no-session"
    return convs


def store_errors(main: Stack) -> float:
    return metric(main.url, "kvbaton_store_errors_total")


def run_until_hits(convs: list[Conversation], timeout: float = 15.0) -> list[str]:
    """Turns on every conversation until each has had a hit again; the reuse verdicts."""
    seen: list[str] = []
    pending = set(range(len(convs)))
    limit = scaled(timeout)
    deadline = time.monotonic() + limit
    while pending:
        assert time.monotonic() < deadline, f"no hit again within {limit:.1f}s: {seen[-8:]}"
        for i in sorted(pending):
            reuse = convs[i].turn().reuse
            seen.append(reuse)
            if reuse == "hit":
                pending.discard(i)
        time.sleep(0.1)
    return seen


@pytest.mark.timeout(90)
def test_redis_stopped_mid_load_then_restarted(main: Stack) -> None:
    convs = conversations(main, 4, "outage")
    verdicts: list[tuple[float, str]] = []  # (when the turn started, X-KV-Reuse)
    stop_load = threading.Event()
    errors_before = store_errors(main)

    def load(conv: Conversation) -> int:
        sent = 0
        while not stop_load.is_set():
            started = time.monotonic()
            verdicts.append((started, conv.turn().reuse))  # each one 200 and the right answer
            sent += 1
        return sent

    def down_for_long_enough() -> bool:
        # Three breaker windows, and enough turns started in them to judge (a loaded machine
        # runs fewer turns a second: the outage then lasts until they are in).
        after = sum(1 for started, _ in list(verdicts) if started > stopped)
        return time.monotonic() - stopped >= 3 * STORE_RETRY_AFTER and after >= 8

    with ThreadPoolExecutor(len(convs)) as pool:
        futures = [pool.submit(load, conv) for conv in convs]
        wait_until(lambda: any(reuse == "hit" for _, reuse in list(verdicts)), "no hit yet")
        main.stop_redis()
        stopped = time.monotonic()
        wait_until(down_for_long_enough, "too few turns while Redis was down", timeout=30)
        stop_load.set()
        sent = sum(f.result() for f in futures)
    assert sent == len(verdicts)
    assert any(reuse == "hit" for started, reuse in verdicts if started < stopped)
    during = [reuse for started, reuse in verdicts if started > stopped]
    assert set(during) == {UNAVAILABLE}, set(during)
    # The breaker: one store failure per STORE_RETRY_AFTER window, not one per request.
    failures = store_errors(main) - errors_before
    assert 1 <= failures <= len(during) / 3, (failures, len(during))

    main.start_redis()  # same port, empty: sessions start over, then hit again
    seen = run_until_hits(convs)
    assert set(seen) <= {UNAVAILABLE, "miss;reason=no-session", "hit"}, set(seen)


@pytest.mark.timeout(60)
def test_redis_hung_costs_one_timeout_per_window(main: Stack) -> None:
    """SIGSTOP: Redis accepts but never answers. Without the breaker every request would wait
    --store-timeout twice (claim and commit)."""
    convs = conversations(main, 2, "hung")
    errors_before = store_errors(main)
    main.redis_proc.send_signal(signal.SIGSTOP)
    started = time.monotonic()
    try:
        verdicts = [convs[i % 2].turn().reuse for i in range(12)]
    finally:
        main.redis_proc.send_signal(signal.SIGCONT)
    windows = math.ceil((time.monotonic() - started) / STORE_RETRY_AFTER)
    assert set(verdicts) == {UNAVAILABLE}
    # The breaker opens after 3 timeouts in a row, then lets one call through per
    # --store-retry-after window (a busy machine makes the 12 turns span more windows).
    failures = store_errors(main) - errors_before
    assert 1 <= failures <= 3 + windows, (failures, windows)
    assert failures < len(verdicts), "one timeout per turn: the breaker did not open"
    # A claim sent before the hang may run when Redis resumes ("busy" once): never a wrong
    # answer, and hits come back.
    seen = run_until_hits(convs)
    assert set(seen) <= {UNAVAILABLE, "miss;reason=busy", "hit"}, set(seen)


def ready(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url + "/ready", timeout=10) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, json.loads(exc.read())


@pytest.mark.timeout(90)
def test_reuse_resumes_as_soon_as_ready_says_the_store_is_back(main: Stack) -> None:
    """A breaker window far longer than the outage (60 s), and no background probe within the
    test (--health-interval 60): the direct ping of /ready, which says the store is back,
    closes the breaker, so the very next turn uses the store and its commit lands."""
    flags = (*ROUTER_FLAGS, "--store-retry-after", "60", "--health-interval", "60")
    ps, ds = [p.url for p in main.ps], [d.url for d in main.ds]
    with router(ps, ds, *flags, redis_url=main.redis_url, name="rel-breaker") as r:
        conv = Conversation(r.url, main.ref, new_cid("breaker"))
        assert conv.turn().reuse == "miss;reason=no-session"
        assert conv.turn().reuse == "hit"
        main.stop_redis()
        assert conv.turn().reuse == UNAVAILABLE  # the breaker opens for 60 s
        status, body = ready(r.url)
        # Still ready (turns are served, without reuse), and says why it is degraded.
        assert status == 200 and body["degraded"] is True, body
        assert body["store"].startswith("unavailable: "), body
        main.start_redis()  # same port, empty

        def store_back() -> bool:
            status, body = ready(r.url)
            return status == 200 and body["store"] == "ok"

        wait_until(store_back, "/ready did not see the store back")
        assert conv.turn().reuse == "miss;reason=no-session"  # the store was asked again
        assert conv.turn().reuse == "hit"  # so the commit of the turn before landed


@contextlib.contextmanager
def busy_cores() -> Iterator[None]:
    """A busy loop on each core, as the machine the issue saw (load average ~15)."""
    loops = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(os.cpu_count() or 1)
    ]
    try:
        yield
    finally:
        for proc in loops:
            proc.kill()
            proc.wait()


@pytest.mark.timeout(180)
def test_one_slow_store_call_under_cpu_load_costs_one_turn_only(main: Stack) -> None:
    """Issue 50, item 4: one store call delayed past --store-timeout (0.5 s) while every core
    is busy: that turn runs without reuse, and no other conversation loses its hit (the
    breaker opens on failures in a row or a failure rate, not on one timeout)."""
    assert main.redis_port is not None
    ps, ds = [p.url for p in main.ps], [d.url for d in main.ds]
    # The default --store-timeout (0.25 s) and a delay twice it, both stretched by the load
    # the machine had before the busy loops (a second `make test` beside this one), as waits are.
    scale = timeout_scale()
    flags = (*ROUTER_FLAGS, "--store-timeout", f"{0.25 * scale:.3g}")
    with (
        slow_redis(main.redis_port) as proxy,
        router(ps, ds, *flags, redis_url=proxy.url, name="rel-slow-call") as r,
    ):
        convs = [Conversation(r.url, main.ref, new_cid("slow-call")) for _ in range(20)]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda c: c.turn(), convs))
            with busy_cores():
                proxy.delay_next(0.5 * scale)  # the next turn's claim or commit, whichever
                second = list(pool.map(lambda c: c.turn().reuse, convs))
                third = list(pool.map(lambda c: c.turn().reuse, convs))
        assert proxy.delayed == 1
        log = r.log.read_text()
    lost = {i for i, turns in enumerate(zip(second, third, strict=True)) if set(turns) != {"hit"}}
    assert len(lost) <= 1, f"conversations that lost a hit: {sorted(lost)}: {second} {third}"
    assert "does not answer" not in log, "one slow call opened the breaker"
    said = [line for line in log.splitlines() if "timed out: no answer within" in line]
    assert len(said) == 1 and "--store-timeout" in said[0], said
