"""Optional OpenTelemetry: a no-op without the packages; with them, spans and an OTLP exporter
(fake `opentelemetry` modules here, since OTel is not a dependency; the real one if present)."""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from router import tracing


@pytest.fixture(autouse=True)
def fresh_imports() -> Iterator[None]:
    tracing._module.cache_clear()
    yield
    tracing._module.cache_clear()


def hide_otel(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every opentelemetry import fail, installed or not."""
    for name in list(sys.modules):
        if name == "opentelemetry" or name.startswith("opentelemetry."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)


def fake_modules(monkeypatch: pytest.MonkeyPatch, **modules: Any) -> None:
    monkeypatch.setitem(sys.modules, "opentelemetry", types.ModuleType("opentelemetry"))
    for name, attrs in modules.items():
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, mod)


def test_without_opentelemetry_everything_is_a_no_op(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    hide_otel(monkeypatch)
    with tracing.span("kvbaton.prefill", instance="http://p:1") as current:
        assert current is None
    with pytest.raises(KeyError), tracing.span("kvbaton.decode"):
        raise KeyError("propagates")
    assert tracing.trace_headers() == {}
    assert tracing.setup_tracing("") is tracing._noop
    with caplog.at_level(logging.WARNING, "kvbaton.tracing"):
        stop = tracing.setup_tracing("http://collector:4318/v1/traces")
    stop()
    assert stop is tracing._noop
    assert "kvbaton[otel]" in caplog.text


def test_spans_go_through_the_otel_api(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, str, dict[str, Any]]] = []

    class Tracer:
        def __init__(self, name: str) -> None:
            self.name = name

        @contextmanager
        def start_as_current_span(self, name: str, attributes: dict[str, Any]) -> Iterator[str]:
            calls.append((self.name, name, attributes))
            yield f"span:{name}"

    def inject(carrier: dict[str, str]) -> None:
        carrier["traceparent"] = "00-abc-def-01"

    fake_modules(
        monkeypatch,
        **{
            "opentelemetry.trace": {"get_tracer": Tracer},
            "opentelemetry.propagate": {"inject": inject},
        },
    )
    with tracing.span("kvbaton.claim", conversation="abc", tokens=3, prefer=None) as current:
        assert current == "span:kvbaton.claim"
    assert calls == [("kvbaton", "kvbaton.claim", {"conversation": "abc", "tokens": 3})]
    assert tracing.trace_headers() == {"traceparent": "00-abc-def-01"}


def test_setup_exports_to_the_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    made: dict[str, Any] = {}

    class Provider:
        def __init__(self, resource: Any) -> None:
            made["resource"] = resource
            self.processors: list[Any] = []

        def add_span_processor(self, processor: Any) -> None:
            self.processors.append(processor)

        def shutdown(self) -> None:
            made["shutdown"] = True

    class Resource:
        @staticmethod
        def create(attrs: dict[str, str]) -> dict[str, str]:
            return attrs

    def set_tracer_provider(provider: Provider) -> None:
        made["provider"] = provider

    fake_modules(
        monkeypatch,
        **{
            "opentelemetry.trace": {"set_tracer_provider": set_tracer_provider},
            "opentelemetry.sdk.trace": {"TracerProvider": Provider},
            "opentelemetry.sdk.trace.export": {"BatchSpanProcessor": lambda exp: ("batch", exp)},
            "opentelemetry.sdk.resources": {"Resource": Resource},
            "opentelemetry.exporter.otlp.proto.http.trace_exporter": {
                "OTLPSpanExporter": lambda endpoint: ("otlp", endpoint)
            },
        },
    )
    stop = tracing.setup_tracing("http://collector:4318/v1/traces")
    assert made["resource"] == {"service.name": "kvbaton"}
    assert made["provider"].processors == [("batch", ("otlp", "http://collector:4318/v1/traces"))]
    stop()
    assert made["shutdown"] is True


def test_real_opentelemetry_records_spans() -> None:
    """With the `otel` extra installed: the turn's spans nest under the current span."""
    pytest.importorskip("opentelemetry.sdk.trace")
    from opentelemetry import trace  # type: ignore[import-not-found, unused-ignore]
    from opentelemetry.sdk.trace import TracerProvider  # type: ignore[import-not-found, unused-ignore]
    from opentelemetry.sdk.trace.export import (  # type: ignore[import-not-found, unused-ignore]
        SimpleSpanProcessor,
    )
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # type: ignore[import-not-found, unused-ignore]
        InMemorySpanExporter,
    )

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(provider)  # once per process: no other test sets one
    with tracing.span("kvbaton.turn", api="chat"), tracing.span("kvbaton.prefill", tokens=1):
        assert tracing.trace_headers()["traceparent"].startswith("00-")
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert set(spans) == {"kvbaton.turn", "kvbaton.prefill"}
    assert spans["kvbaton.prefill"].parent.span_id == spans["kvbaton.turn"].context.span_id
    assert dict(spans["kvbaton.prefill"].attributes) == {"tokens": 1}


def test_a_past_span_began_that_long_ago(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[dict[str, Any]] = []

    class Span:
        def __init__(self, record: dict[str, Any]) -> None:
            self.record = record

        def end(self, end_time: int) -> None:
            self.record["end"] = end_time

    class Tracer:
        def __init__(self, name: str) -> None:
            self.name = name

        def start_span(self, name: str, attributes: dict[str, Any], start_time: int) -> Span:
            made.append({"name": name, "attributes": attributes, "start": start_time})
            return Span(made[-1])

    fake_modules(monkeypatch, **{"opentelemetry.trace": {"get_tracer": Tracer}})
    tracing.past_span("kvbaton.handover", 0.25, mode="concurrent", skipped=None)
    (span,) = made
    assert span["name"] == "kvbaton.handover" and span["attributes"] == {"mode": "concurrent"}
    assert span["end"] - span["start"] == 250_000_000
    hide_otel(monkeypatch)
    tracing._module.cache_clear()
    tracing.past_span("kvbaton.handover", 0.25)  # a no-op without OpenTelemetry
    assert len(made) == 1
