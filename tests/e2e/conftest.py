"""E2E fixtures: simulator P and D, a from-scratch reference instance, and routers."""

from __future__ import annotations

import contextlib
import json
import re
import urllib.request
from collections.abc import Iterator, Sequence
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


@contextlib.contextmanager
def pd_stack(
    redis_url: str,
    name: str,
    *router_args: str,
    engines: Sequence[str] = (),
    decode: Sequence[str] = (),
    ready_timeout: float = 20.0,
) -> Iterator[Stack]:
    """Simulator P and D (bidirectional; `engines` on all three, `decode` on D only), a
    from-scratch reference engine, and a router on Redis."""
    with (
        sim("prefill", *BIDIR, *engines, name=f"{name}-p") as p,
        sim("decode", *BIDIR, *engines, *decode, name=f"{name}-d") as d,
        sim("decode", *engines, name=f"{name}-ref") as ref,
        router(
            [p.url],
            [d.url],
            *router_args,
            redis_url=redis_url,
            name=f"{name}-router",
            ready_timeout=ready_timeout,
        ) as r,
    ):
        yield Stack(p, d, ref, r, redis_url)


@pytest.fixture(scope="module")
def stack(redis_url_session: str) -> Iterator[Stack]:
    kv = "--stream-kv-params"
    with pd_stack(redis_url_session, "e2e", kv, decode=[kv]) as st:
        yield st


@pytest.fixture(scope="module")
def stack_reasoning(redis_url_session: str) -> Iterator[Stack]:
    """Engines whose template drops reasoning from earlier turns (vllm#43094)."""
    with pd_stack(redis_url_session, "think", engines=["--reasoning-tokens", "8"]) as st:
        yield st


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
