"""The operator docs match the code: every metric, every admin route, every reuse reason."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from starlette.routing import Route, Router

from router.engines.pool import Pool
from router.http.admin import AdminGate, admin_app
from router.metrics import Metrics

DOCS = Path(__file__).resolve().parents[2] / "docs"


def exposed_names() -> dict[str, str]:
    """Name as documented (counters with _total) -> type, for every metric in Metrics."""
    metrics = Metrics(Pool(("http://p:1",), ("http://d:1",)), lambda: False)
    names: dict[str, str] = {}
    for family in metrics.registry.collect():
        suffix = "_total" if family.type == "counter" else ""
        names[family.name + suffix] = family.type
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


ROOT = DOCS.parent
REASON_SOURCES = (
    "router/turn/reuse.py",
    "router/turn/run.py",
    "router/turn/commit.py",
    "sessions/model.py",
)
REASON_FUNCTIONS = ("handle_unusable_reason", "_placement_reason")


def _strings(node: ast.AST) -> list[str]:
    return [
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    ]


def reuse_reasons() -> set[str]:
    """Reason strings the turn can put in X-KV-Reuse, read from the code."""
    found: set[str] = set()
    for path in REASON_SOURCES:
        tree = ast.parse((ROOT / path).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                if name == "miss":
                    found.update(_strings(node.args[0]) if node.args else [])
                elif name == "Reuse" and len(node.args) >= 2:
                    found.update(_strings(node.args[1]))
            elif isinstance(node, ast.Assign) and any(
                "reason" in {getattr(e, "id", "") for e in ast.walk(t)} for t in node.targets
            ):
                found.update(_strings(node.value))
            elif isinstance(node, ast.FunctionDef) and node.name in REASON_FUNCTIONS:
                for ret in ast.walk(node):
                    if isinstance(ret, ast.Return) and ret.value is not None:
                        found.update(_strings(ret.value))
    return {r for r in found if re.fullmatch(r"[a-z]+(-[a-z]+)*", r)}


def test_every_reuse_reason_is_explained() -> None:
    text = (DOCS / "troubleshooting.md").read_text()
    reasons = reuse_reasons()
    assert {"no-session", "busy", "expired", "prefix-mismatch", "handle-rejected"} <= reasons
    for reason in reasons:
        assert f"reason={reason}`" in text, (
            f"X-KV-Reuse reason {reason!r} is not in troubleshooting"
        )


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
