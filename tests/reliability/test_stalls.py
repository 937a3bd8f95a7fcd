"""Stalls and hang-ups (issue 32, item 5): a D that stops sending mid-stream (SIGSTOP) past
--decode-idle-timeout is ejected at once, so new turns go to the other D within seconds; a
client that hangs up on a non-streaming turn leaves nothing running on the engines."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest

from harness.chat import chat_body, post
from harness.procs import SimProc, sims, wait_until
from harness.router import router
from harness.stack import started
from tests.reliability.conftest import SLOW_TOKEN_MS, Slow
from tests.reliability.helpers import instance, metric, running, send_and_hang_up

IDLE_S = 1.0
PACED = ("--bidirectional", "--kv-recompute-threshold", "0", "--decode-ms-per-token", "50")


@pytest.fixture(scope="module")
def paced() -> Iterator[list[SimProc]]:
    """One P and two D's decoding a token every 50 ms (a stream lasts long enough to stop)."""
    specs = [("prefill", *PACED), ("decode", *PACED), ("decode", *PACED)]
    with started(lambda: sims(*specs, name="rel-stall")) as procs:
        yield procs


@pytest.mark.timeout(120)
def test_a_d_that_stops_mid_stream_is_avoided_within_seconds(paced: list[SimProc]) -> None:
    p, *ds = paced
    flags = ["--decode-idle-timeout", str(IDLE_S), "--decode-first-byte-timeout", "10"]
    flags += ["--health-interval", "0.5"]
    with router([p.url], [d.url for d in ds], *flags, name="rel-stall-router") as r:
        body = chat_body([{"role": "user", "content": "a long story"}], stream=True)
        stream = threading.Thread(
            target=post, args=(r.url + "/v1/chat/completions", {**body, "max_tokens": 200})
        )
        stream.start()
        wait_until(lambda: any(running(d) == 1 for d in ds), "the stream started")
        stopped = next(d for d in ds if running(d) == 1)
        other = next(d for d in ds if d is not stopped)
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        try:
            stream.join(IDLE_S + 5)
            assert not stream.is_alive(), "the stalled stream was not cut"
            assert instance(r.url, "decode", stopped.url)["healthy"] is False
            served = metric(other.url, "vllm:request_success_total")
            for i in range(5):
                began = time.monotonic()
                reply = post(
                    r.url + "/v1/chat/completions",
                    chat_body([{"role": "user", "content": f"quick {i}"}], max_tokens=4),
                )
                assert reply.status == 200, reply.body[:300]
                assert time.monotonic() - began < 3, "a new turn waited on the stopped D"
            assert metric(other.url, "vllm:request_success_total") >= served + 5
        finally:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        wait_until(lambda: instance(r.url, "decode", stopped.url)["healthy"], "re-admitted", 10)


@pytest.mark.timeout(120)
def test_a_client_hanging_up_on_a_json_turn_stops_d(slow: Slow) -> None:
    """Non-streaming: D answers only at the end; the hang-up closes D's connection and D stops
    (vLLM cancels a request whose client left; the simulator too)."""
    with router([slow.p.url], [slow.d.url], name="rel-hangup") as r:
        wait_until(lambda: running(slow.d) == 0, "the slow D is busy")
        tokens = metric(slow.d.url, "vllm:generation_tokens_total")
        pinned = metric(slow.p.url, "vllm_sim:pinned_blocks")
        body = chat_body([{"role": "user", "content": "tell me everything"}], max_tokens=40)
        send_and_hang_up(r.port, "/v1/chat/completions", body, after=1.5)  # 20 s if not cut
        wait_until(lambda: running(slow.d) == 0, "D still decodes for nobody", timeout=3)
        assert metric(slow.d.url, "vllm:generation_tokens_total") - tokens < 40 / 2
        assert SLOW_TOKEN_MS * 40 / 1000 > 10
        wait_until(lambda: metric(slow.p.url, "vllm_sim:pinned_blocks") <= pinned, "P pins", 3)


@pytest.fixture(scope="module")
def two_p() -> Iterator[list[SimProc]]:
    """Two P's and a D, at no cost."""
    specs = [("prefill", *PACED[:3]), ("prefill", *PACED[:3]), ("decode", *PACED[:3])]
    with started(lambda: sims(*specs, name="rel-pstall")) as procs:
        yield procs


@pytest.mark.timeout(120)
def test_a_p_that_stops_answering_is_avoided_at_once(two_p: list[SimProc]) -> None:
    """P answers in one piece, so its stall is no whole answer within --prefill-timeout: the
    turn goes to the other P and the stopped one is ejected at once (not after
    --unhealthy-after such turns, each waiting the whole timeout)."""
    *ps, d = two_p
    flags = ["--prefill-timeout", "2", "--health-interval", "60", "--unhealthy-after", "3"]
    with router([p.url for p in ps], [d.url], *flags, name="rel-pstall-router") as r:
        stopped, other = ps
        os.kill(stopped.proc.pid, signal.SIGSTOP)
        try:
            waits = []
            for i in range(6):  # the P's take turns: the first turns on the stopped one wait
                began = time.monotonic()
                reply = post(
                    r.url + "/v1/chat/completions",
                    chat_body([{"role": "user", "content": f"quick {i}"}], max_tokens=4),
                )
                assert reply.status == 200, reply.body[:300]
                waits.append(time.monotonic() - began)
            assert instance(r.url, "prefill", stopped.url)["healthy"] is False
            assert "stalled" in instance(r.url, "prefill", stopped.url)["last_error"]
            assert sum(w > 1.5 for w in waits) == 1, waits  # one turn found it stopped
        finally:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        assert other.proc.poll() is None
