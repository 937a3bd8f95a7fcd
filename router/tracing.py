"""Optional OpenTelemetry tracing: spans around a turn's steps (claim, prefill, decode, commit).

A no-op unless the `otel` extra is installed and `--otel-endpoint` is set (or an OTel SDK was
configured for the process by other means, e.g. `opentelemetry-instrument`). OpenTelemetry is
imported lazily, never required: the router runs the same without it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

log = logging.getLogger("kvbaton.tracing")

SERVICE_NAME = "kvbaton"
AttrValue = str | bool | int | float


@functools.cache
def _module(name: str) -> Any | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


_NO_SPAN = contextlib.nullcontext()


def span(name: str, **attrs: AttrValue | None) -> contextlib.AbstractContextManager[Any]:
    """A span named `name` around the block (None-valued attributes are left out); yields the
    span, or None without OpenTelemetry (one shared no-op then: a turn opens several). An
    exception is recorded on the span and re-raised."""
    trace = _module("opentelemetry.trace")
    if trace is None:
        return _NO_SPAN
    return _span(trace, name, attrs)


@contextlib.contextmanager
def _span(trace: Any, name: str, attrs: dict[str, AttrValue | None]) -> Iterator[Any]:
    attributes = {key: value for key, value in attrs.items() if value is not None}
    tracer = trace.get_tracer(SERVICE_NAME)
    with tracer.start_as_current_span(name, attributes=attributes) as current:
        yield current


def past_span(name: str, seconds: float, **attrs: AttrValue | None) -> None:
    """A span that ended now and began `seconds` ago (one that no block encloses: the
    handover runs from P's answer to D's first byte, across the response's start)."""
    trace = _module("opentelemetry.trace")
    if trace is None:
        return
    attributes = {key: value for key, value in attrs.items() if value is not None}
    end = time.time_ns()
    current = trace.get_tracer(SERVICE_NAME).start_span(
        name, attributes=attributes, start_time=end - int(seconds * 1e9)
    )
    current.end(end_time=end)


def trace_headers() -> dict[str, str]:
    """W3C `traceparent` (and `tracestate`) of the current span, for the engine requests, so
    vLLM's own spans (`--otlp-traces-endpoint`) join the turn's trace; {} without OTel."""
    propagate = _module("opentelemetry.propagate")
    headers: dict[str, str] = {}
    if propagate is not None:
        propagate.inject(headers)
    return headers


def _noop() -> None:
    return None


def setup_tracing(endpoint: str) -> Callable[[], None]:
    """Export spans to an OTLP/HTTP endpoint; returns the function that flushes and stops it."""
    if not endpoint:
        return _noop
    names = (
        "opentelemetry.trace",
        "opentelemetry.sdk.trace",
        "opentelemetry.sdk.trace.export",
        "opentelemetry.sdk.resources",
        "opentelemetry.exporter.otlp.proto.http.trace_exporter",
    )
    modules = [_module(name) for name in names]
    if any(m is None for m in modules):
        missing = [n for n, m in zip(names, modules, strict=True) if m is None]
        log.warning(
            "--otel-endpoint is set but OpenTelemetry is not installed (pip install "
            "'kvbaton[otel]'); tracing is off. Missing: %s",
            ", ".join(missing),
        )
        return _noop
    trace, sdk, export, resources, otlp = modules
    assert trace and sdk and export and resources and otlp
    provider = sdk.TracerProvider(
        resource=resources.Resource.create({"service.name": SERVICE_NAME})
    )
    provider.add_span_processor(export.BatchSpanProcessor(otlp.OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    log.info("tracing: exporting spans to %s", endpoint)
    shutdown: Callable[[], None] = provider.shutdown
    return shutdown
