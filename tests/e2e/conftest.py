"""E2E fixtures: simulator P and D, a from-scratch reference instance, and routers."""

from __future__ import annotations

import json
import re
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.e2e.harness import RouterProc, router
from tests.procs import SimProc, sim

BIDIR = ("--bidirectional", "--kv-recompute-threshold", "0")


@dataclass
class Stack:
    p: SimProc
    d: SimProc
    ref: SimProc
    router: RouterProc
    redis_url: str


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of a Prometheus sample on an instance's /metrics, filtered by labels."""
    with urllib.request.urlopen(url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        match = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not match or match.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


def p_route_calls(url: str) -> tuple[float, float]:
    """(/v1/chat/completions, /v1/completions) requests an engine answered with 2xx."""
    return tuple(  # type: ignore[return-value]
        metric(url, "http_requests_total", handler=h, status="2xx")
        for h in ("/v1/chat/completions", "/v1/completions")
    )


def pulled(url: str) -> float:
    return metric(url, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")


@pytest.fixture(scope="module")
def stack(redis_url_session: str) -> Iterator[Stack]:
    with (
        sim("prefill", *BIDIR, name="e2e-p") as p,
        sim("decode", *BIDIR, "--stream-kv-params", name="e2e-d") as d,
        sim("decode", name="e2e-ref") as ref,
        router([p.url], [d.url], "--stream-kv-params", redis_url=redis_url_session) as r,
    ):
        yield Stack(p, d, ref, r, redis_url_session)


@pytest.fixture(scope="module")
def stack_reasoning(redis_url_session: str) -> Iterator[Stack]:
    """Engines whose template drops reasoning from earlier turns (vllm#43094)."""
    think = ("--reasoning-tokens", "8")
    with (
        sim("prefill", *BIDIR, *think, name="think-p") as p,
        sim("decode", *BIDIR, *think, name="think-d") as d,
        sim("decode", *think, name="think-ref") as ref,
        router([p.url], [d.url], redis_url=redis_url_session) as r,
    ):
        yield Stack(p, d, ref, r, redis_url_session)


def post_json(url: str, body: dict[str, object]) -> int:
    """A plain JSON POST (fault injection, admin calls); returns the status."""
    data = json.dumps(body).encode()
    req = urllib.request.Request(url, data, {"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=5) as resp:
        return int(resp.status)


@pytest.fixture(scope="module")
def stock_responses(redis_url_session: str) -> Iterator[Stack]:
    """Stock-vLLM-like engines (no kv_transfer_params in chat streams)."""
    with (
        sim("prefill", *BIDIR, name="resp-p") as p,
        sim("decode", *BIDIR, name="resp-d") as d,
        sim("decode", name="resp-ref") as ref,
        router([p.url], [d.url], redis_url=redis_url_session, name="resp-router") as r,
    ):
        yield Stack(p, d, ref, r, redis_url_session)
