"""The operator docs match the code: every metric, every admin route, every reuse reason."""

from __future__ import annotations

import re
from enum import StrEnum
from pathlib import Path

import pytest
from starlette.routing import Route, Router

from router.engines.kv_events import Source
from router.engines.kv_watch import KvEvents
from router.engines.pool import Pool
from router.http.admin import AdminGate, admin_app
from router.metrics import Metrics
from router.turn.outcomes import Reason, docs_table, header_values
from sessions import vocabulary

DOCS = Path(__file__).resolve().parents[2] / "docs"


def exposed_names() -> dict[str, str]:
    """Name as documented (counters with _total) -> type, for every metric in Metrics."""
    metrics = Metrics(Pool(("http://p:1",), ("http://d:1",)), lambda: False)
    kv = KvEvents({"http://p:1": Source("http://p:1", "tcp://p:5557", "tcp://p:5558")}, 10)
    metrics.watch_kv_events(kv)  # the per-engine KV-events families exist with --kv-events
    names: dict[str, str] = {}
    try:
        for family in metrics.registry.collect():
            suffix = "_total" if family.type == "counter" else ""
            names[family.name + suffix] = family.type
    finally:
        kv._ctx.destroy(linger=0)
    return names


def test_every_metric_is_documented_with_its_type() -> None:
    text = (DOCS / "metrics.md").read_text()
    names = exposed_names()
    assert len(names) >= 12
    for name, kind in names.items():
        row = re.search(rf"^\| `{re.escape(name)}` \| (\w+) \|", text, re.MULTILINE)
        assert row, f"{name} is not in docs/metrics.md"
        assert row.group(1) == kind, f"{name} is a {kind}, docs say {row.group(1)}"
    documented = set(re.findall(r"^\| `(kvbaton_\w+)` \|", text, re.MULTILINE))
    assert documented == set(names), f"documented but not exported: {documented - set(names)}"


def test_the_router_and_sessions_share_one_reason_enum() -> None:
    """sessions/ cannot import the router: both use sessions/vocabulary.py's `Reason`, so the
    reasons the session model gives are the ones the table below documents."""
    assert Reason is vocabulary.Reason


@pytest.mark.parametrize(
    ("metric", "words"),
    [
        ("kvbaton_session_commits_total", vocabulary.CommitResult),
        ("kvbaton_turns_aborted_total", vocabulary.AbortReason),
        ("kvbaton_upstream_duration_seconds", vocabulary.LegOutcome),
    ],
)
def test_every_label_value_of_the_vocabulary_is_documented(
    metric: str, words: type[StrEnum]
) -> None:
    text = (DOCS / "metrics.md").read_text()
    row = re.search(rf"^\| `{metric}` \|.*$", text, re.MULTILINE)
    assert row, f"{metric} is not in docs/metrics.md"
    for word in words:
        assert f"`{word}`" in row.group(0), f"{metric}: {word!r} is not documented"


def test_the_x_kv_reuse_table_is_the_enum() -> None:
    """docs/architecture.md's table is generated from router/turn/outcomes.py (regenerate it
        with `python -c 'from router.engines.kv_events import Source
    from router.engines.kv_watch import KvEvents
    from router.turn.outcomes import docs_table; print(docs_table())'`)."""
    assert docs_table() in (DOCS / "architecture.md").read_text()


def test_every_reuse_reason_is_explained() -> None:
    text = (DOCS / "troubleshooting.md").read_text()
    for value in header_values():
        if value != "hit":
            assert f"{value}`" in text, f"X-KV-Reuse {value!r} is not in troubleshooting"


def test_every_admin_route_is_in_operations_md() -> None:
    gate = admin_app("key")
    assert isinstance(gate, AdminGate) and isinstance(gate.app, Router)
    text = (DOCS / "operations.md").read_text()
    routes = [r for r in gate.app.routes if isinstance(r, Route)]
    assert len(routes) >= 8
    for route in routes:
        for method in route.methods or ():
            if method == "HEAD":
                continue
            fixed = route.path.split("{", 1)[0]
            assert f"`{method} /admin{fixed}" in text, f"{method} /admin{route.path} undocumented"
