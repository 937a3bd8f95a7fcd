"""`kvbaton serve --workers 2`: two router processes on one port. The OpenAI SDK, each client
held to one connection (so to one worker), keeps a conversation going across the workers;
/metrics sums both; a killed worker is replaced; SIGTERM stops all; a failed start stops all."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from harness import metrics
from harness.chat import chat_turn
from harness.metrics import metric
from harness.procs import ROOT, free_port, redis_server, sim, stop, wait_until
from harness.router import SESSION_SECRET, RouterProc, router
from harness.waiting import scaled
from tests.e2e.conftest import Stack, pd_stack
from tests.e2e.helpers import checked_turn

REQUESTS = "kvbaton_requests_total"


@dataclass
class Pinned:
    """An OpenAI client whose one kept-alive connection reached the worker `pid`."""

    api: openai.OpenAI
    http: httpx.Client
    pid: int

    def sample(self, name: str, **labels: str) -> float:
        """The sum of a metric's samples on this worker's /metrics (those with `labels`)."""
        return metrics.total(self.http.get("/metrics").text, name, **labels)

    def requests_total(self) -> float:
        return self.sample(REQUESTS)

    def decode_in_flight(self) -> float:
        return self.sample("kvbaton_backend_inflight_requests", role="decode")


def pin(url: str, stack: ExitStack) -> Pinned:
    http = stack.enter_context(
        httpx.Client(base_url=url, limits=httpx.Limits(max_connections=1), timeout=30)
    )
    pid = http.get("/status").json()["worker"]["pid"]
    api = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, http_client=http)
    return Pinned(api, http, pid)


def two_workers(url: str, stack: ExitStack, within: float = 20.0) -> tuple[Pinned, Pinned]:
    """Clients on two different workers (the kernel hands each new connection to one). The
    router answers /health as soon as one worker serves; on a busy machine the other may
    take seconds more to start, so new connections are tried until `within` runs out."""
    first = pin(url, stack)
    deadline = time.monotonic() + scaled(within)
    tries = 0
    while time.monotonic() < deadline:
        tries += 1
        other = pin(url, stack)
        if other.pid != first.pid:
            return first, other
        other.http.close()
        time.sleep(0.05)
    raise AssertionError(f"every one of {tries} connections reached worker {first.pid}")


def children(pid: int) -> set[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return {int(p) for p in text.split()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def stack(redis_url_session: str) -> Iterator[Stack]:
    kv = "--stream-kv-params"
    with pd_stack(
        redis_url_session, "workers", "--workers", "2", kv, decode=[kv], ready_timeout=40.0
    ) as st:
        yield st


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_a_conversation_moves_between_workers_and_hits(stack: Stack, stream: bool) -> None:
    with ExitStack() as held:
        a, b = two_workers(stack.router.url, held)
        cid = f"workers-{uuid.uuid4().hex[:8]}"
        messages = [{"role": "system", "content": f"Two workers, stream {stream}."}]
        for turn, via in enumerate((a, b, a, b), start=1):
            # From turn 2, the previous turn ran on the other worker: its handle came via Redis.
            messages.append({"role": "user", "content": f"Question {turn}: which worker is it?"})
            checked_turn(stack, via.api, messages, turn, stream=stream, cid=cid)


def test_metrics_count_the_turns_of_both_workers(stack: Stack) -> None:
    with ExitStack() as held:
        a, b = two_workers(stack.router.url, held)
        before = a.requests_total()
        assert b.requests_total() == before
        for i in range(6):
            via = (a, b)[i % 2]
            chat_turn(via.api, [{"role": "user", "content": f"count {i}"}], stream=False, cid=None)
        # Each worker answers with the turns of both (its own and the other's files).
        assert a.requests_total() == before + 6
        assert b.requests_total() == before + 6
        # In-flight requests: the other worker's part is published every second.
        wait_until(
            lambda: metric(stack.router.url, "kvbaton_backend_inflight_requests") == 0,
            "nothing in flight",
            timeout=5,
        )


def test_a_killed_worker_is_replaced_and_its_counts_are_kept(stack: Stack) -> None:
    supervisor = stack.router.proc.pid
    with ExitStack() as held:
        a, b = two_workers(stack.router.url, held)
        before = a.requests_total()
        os.kill(b.pid, signal.SIGKILL)
        # The other worker serves meanwhile.
        answer, reuse, _ = chat_turn(
            a.api, [{"role": "user", "content": "still there?"}], stream=False, cid=None
        )
        assert answer and reuse == "miss;reason=no-session"
        wait_until(
            lambda: len(children(supervisor) - {a.pid, b.pid}) == 1, "a new worker", timeout=30
        )
    with ExitStack() as held:
        c, d = two_workers(stack.router.url, held)
        assert b.pid not in {c.pid, d.pid}
        # The killed worker's requests are still counted (its file stays; counters never drop).
        assert c.requests_total() == before + 1


@contextlib.contextmanager
def two_worker_router(
    redis_url: str, name: str, *d_args: str, router_args: Sequence[str] = ()
) -> Iterator[tuple[RouterProc, set[int]]]:
    """Its own P, D and `--workers 2` router, both workers seen serving; (router, worker pids)."""
    args = ("--workers", "2", *router_args)
    with (
        sim("prefill", name=f"{name}-p") as p,
        sim("decode", *d_args, name=f"{name}-d") as d,
        router([p.url], [d.url], *args, redis_url=redis_url, name=name, ready_timeout=40.0) as r,
    ):
        with ExitStack() as held:
            two_workers(r.url, held)
        workers = children(r.proc.pid)
        assert len(workers) == 2
        yield r, workers


def test_sigterm_stops_every_worker(redis_url_session: str) -> None:
    with two_worker_router(redis_url_session, "workers-term") as (r, workers):
        r.proc.send_signal(signal.SIGTERM)
        assert r.proc.wait(15) == 0
        assert not any(alive(pid) for pid in workers)


def test_workers_leave_when_the_supervisor_is_killed(redis_url_session: str) -> None:
    with two_worker_router(redis_url_session, "workers-kill") as (r, workers):
        r.proc.kill()
        r.proc.wait(5)
        wait_until(lambda: not any(alive(pid) for pid in workers), "the orphans to exit", 10)


def test_in_flight_requests_are_summed_over_the_workers(redis_url_session: str) -> None:
    # D paces its tokens 100 ms apart: a 20-token stream on one worker lasts 2 s.
    slow = ("--decode-ms-per-token", "100")
    with two_worker_router(redis_url_session, "workers-busy", *slow) as (r, _), ExitStack() as held:
        a, b = two_workers(r.url, held)
        streaming = threading.Thread(
            target=chat_turn,
            args=(a.api, [{"role": "user", "content": "a slow one"}]),
            kwargs={"stream": True, "cid": None, "max_tokens": 20},
        )
        streaming.start()
        try:
            # Asked on the other worker: the stream is counted through the shared files.
            wait_until(lambda: b.decode_in_flight() == 1, "the other worker's stream", timeout=5)
        finally:
            streaming.join(30)
        wait_until(lambda: b.decode_in_flight() == 0, "the stream to end", timeout=5)


def test_one_workers_open_store_breaker_shows_on_the_other(redis_url_session: str) -> None:
    # The breaker stays open 30 s; no registry re-read (which also calls Redis) meanwhile,
    # and no pin sweep (each worker's would find Redis gone within a second).
    args = ("--store-retry-after", "30", "--health-interval", "60", "--no-release-pins")
    with (
        redis_server() as (redis_url, _, redis_proc),
        two_worker_router(redis_url, "workers-circuit", router_args=args) as (r, _),
        ExitStack() as held,
    ):
        a, b = two_workers(r.url, held)
        assert b.sample("kvbaton_store_circuit_open") == 0
        stop(redis_proc)
        messages = [{"role": "user", "content": "Redis is gone"}]
        for _ in range(3):  # the breaker opens on failures in a row, not on one
            _, reuse, _ = chat_turn(a.api, messages, stream=False, cid="workers-circuit")
            assert reuse == "miss;reason=store-unavailable"
        # Only a's breaker opened; b answers the scrape with a's published value.
        wait_until(lambda: b.sample("kvbaton_store_circuit_open") == 1, "a's open breaker", 5)
        assert b.http.get("/status").json()["store"]["circuit_open"] is False


def test_a_worker_that_fails_at_start_stops_the_server() -> None:
    with sim("prefill", name="workers-bad-p") as p, sim("decode", name="workers-bad-d") as d:
        argv = ["router", "serve", "--port", str(free_port()), "--workers", "2"]
        argv += ["--prefill", p.url, "--decode", d.url, "--model", "not-the-engines-model"]
        argv += ["--redis-url", "redis://127.0.0.1:1/0", "--session-secret", SESSION_SECRET]
        done = subprocess.run(
            [sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    assert done.returncode == 1, done.stderr
    assert "not-the-engines-model" in done.stderr
    assert "failed at start" in done.stderr
    assert "Traceback" not in done.stderr
