"""The router's labelled metrics hand out a child per label values from their own dict: the
same series prometheus_client's `labels` would, whatever spelling of the values."""

from __future__ import annotations

import pytest

from router.engines.pool import Pool
from router.metrics import Metrics
from sessions.vocabulary import LegOutcome


def _metrics() -> Metrics:
    return Metrics(Pool(["http://p:1"], ["http://d:1"], 3), lambda: False)


def _sample(m: Metrics, name: str, labels: dict[str, str]) -> float | None:
    return m.registry.get_sample_value(name, labels)


def test_a_child_is_found_again_and_counts_where_labels_would() -> None:
    m = _metrics()
    first = m.requests.labels("/v1/chat/completions", "200")
    assert m.requests.labels("/v1/chat/completions", "200") is first
    first.inc()
    m.requests.labels("/v1/chat/completions", "200").inc(2)
    m.requests.labels("/v1/chat/completions", "400").inc()
    m.requests.labels(route="/v1/completions", status="200").inc()  # by name: not cached
    route = {"route": "/v1/chat/completions"}
    assert _sample(m, "kvbaton_requests_total", {**route, "status": "200"}) == 3
    assert _sample(m, "kvbaton_requests_total", {**route, "status": "400"}) == 1
    assert _sample(m, "kvbaton_requests_total", {"route": "/v1/completions", "status": "200"}) == 1


def test_an_enum_value_and_its_string_are_one_series() -> None:
    m = _metrics()
    m.upstream.labels("decode", "http://d:1", LegOutcome.OK).observe(0.01)
    m.upstream.labels("decode", "http://d:1", "ok").observe(0.02)
    labels = {"role": "decode", "instance": "http://d:1", "outcome": "ok"}
    assert _sample(m, "kvbaton_upstream_duration_seconds_count", labels) == 2
    assert _sample(m, "kvbaton_upstream_duration_seconds_sum", labels) == pytest.approx(0.03)
