"""KV events that cannot be trusted (issue 32, item 6): an engine that publishes nothing while
turns run on it is named (log, /status, metric) with the likely cause, a connect-style
endpoint; and an index that missed the engine's history (its replay did not answer) claims
nothing, so no turn says `via=prefill-cache` from it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from harness.chat import chat_body, get_json, post
from harness.metrics import metric
from harness.procs import SimProc, free_port, sims, wait_until
from harness.router import RouterProc, router
from harness.stack import started

BIDIR = ("--bidirectional", "--kv-recompute-threshold", "0")
REPLAY_TIMEOUT = 2.0  # the subscriber's (router/engines/kv_events.py)


@pytest.fixture(scope="module")
def engines() -> Iterator[tuple[SimProc, SimProc, int]]:
    """P publishing KV events without a replay socket (vLLM without replay_endpoint), and D."""
    pub = free_port()
    specs = [("prefill", *BIDIR, "--kv-events-port", str(pub)), ("decode", *BIDIR)]
    with started(lambda: sims(*specs, name="rel-kvev")) as (p, d):
        yield p, d, pub


def kv_view(r: RouterProc, url: str) -> dict[str, Any]:
    view: dict[str, Any] = get_json(r.url + "/status")["kv_events"]["engines"][url]
    return view


def turns(r: RouterProc, count: int, tag: str) -> list[str]:
    """`count` two-turn conversations; the second turns' X-KV-Reuse. The answers are longer
    than a block: the second turn's P lacks a full block of D's, which it can only read (so
    nothing but a wrong index could say `hit;via=prefill-cache`)."""
    reuse = []
    for i in range(count):
        messages = [{"role": "user", "content": f"{tag} {i}: tea or rain?"}]
        body = chat_body(messages, cid=f"{tag}-{i}", max_tokens=32)
        first = post(r.url + "/v1/chat/completions", body)
        assert first.status == 200, first.body[:300]
        messages += [{"role": "assistant", "content": first.answer()}]
        messages += [{"role": "user", "content": "and then?"}]
        second = post(r.url + "/v1/chat/completions", {**body, "messages": messages})
        assert second.status == 200, second.body[:300]
        reuse.append(second.reuse)
    return reuse


def test_an_engine_that_publishes_nothing_is_named_with_the_likely_cause(
    engines: tuple[SimProc, SimProc, int],
) -> None:
    """The router follows a port nobody publishes on: what it sees of a vLLM whose
    --kv-events-config endpoint is tcp://HOST:PORT (vLLM then connects, as the router does)."""
    p, d, _ = engines
    nobody = free_port()
    spec = f"{p.url}=tcp://127.0.0.1:{nobody}"
    with router([p.url], [d.url], "--kv-events", spec, name="rel-kvev-silent") as r:
        assert kv_view(r, p.url)["warning"] == ""
        turns(r, 3, "silent")  # 6 turns on P
        view = kv_view(r, p.url)
        assert view["batches"] == 0 and not view["in_sync"]
        assert "wildcard" in view["warning"] and "tcp://*:PORT" in view["warning"]
        assert metric(r.url, "kvbaton_kv_events_warning", instance=p.url) == 1
        assert metric(r.url, "kvbaton_kv_events_warning", instance=d.url) == 0
        time.sleep(0.2)
        lines = [line for line in r.log.read_text().splitlines() if "wildcard" in line]
    assert len(lines) == 1 and "WARNING" in lines[0], lines


def test_an_index_that_missed_the_engines_history_claims_nothing(
    engines: tuple[SimProc, SimProc, int],
) -> None:
    """P cached blocks before the router subscribed, and its replay does not answer: the live
    batches that follow do not make the index complete, so it is not in sync and no turn is
    reported `hit;via=prefill-cache` from it."""
    p, d, pub = engines
    for i in range(3):  # history the router never sees
        body = chat_body([{"role": "user", "content": f"before the router {i}"}], max_tokens=2)
        assert post(p.url + "/v1/chat/completions", body).status == 200
    with router([p.url], [d.url], "--kv-events", f"{p.url}=tcp://127.0.0.1:{pub}",
                name="rel-kvev-unsynced") as r:  # fmt: skip
        time.sleep(REPLAY_TIMEOUT + 0.5)  # subscribed; the replay asked on connecting is over
        reuse = turns(r, 3, "unsynced")
        wait_until(lambda: kv_view(r, p.url)["batches"] > 0, "live batches", 5)
        view = kv_view(r, p.url)
        assert view["in_sync"] is False
        assert "no replay answered" in view["warning"]
        assert not any("prefill-cache" in h for h in reuse), reuse
        assert metric(r.url, "kvbaton_kv_index_in_sync", instance=p.url) == 0
