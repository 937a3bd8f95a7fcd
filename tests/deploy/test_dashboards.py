"""deploy/grafana and deploy/prometheus: every expression parses (`promtool check rules`; the
dashboard's as recording rules), and every metric they name is in the scrape of a real router
(router + simulator P/D + Redis) after a few turns."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.e2e.conftest import Stack, pd_stack
from tests.ops.conftest import chat

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "kvbaton.json"
RULES = ROOT / "deploy" / "prometheus" / "kvbaton-rules.yml"
METRIC = re.compile(r"\b(kvbaton_[a-zA-Z0-9_:]*)")
SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")
# Grafana's variables, replaced by what they stand for so that promtool can parse the query.
GRAFANA_VARS = {"$__rate_interval": "1m", "$__interval": "1m", "$__range": "1h"}


def promtool() -> str:
    exe = shutil.which("promtool")
    if exe is None:
        message = "promtool is not installed (make install: Debian package prometheus)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)
    return exe


def dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    exprs = []
    for panel in dash["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"]
            for var, value in GRAFANA_VARS.items():
                expr = expr.replace(var, value)
            assert "$" not in expr, f"unknown Grafana variable in {expr!r}"
            exprs.append(expr)
    return exprs


def rule_exprs() -> list[str]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [str(rule["expr"]) for group in groups for rule in group["rules"]]


def check_rules(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [promtool(), "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )


def test_the_alert_rules_pass_promtool() -> None:
    done = check_rules(RULES)
    assert done.returncode == 0, done.stdout + done.stderr
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]}
    assert {
        "KvbatonSessionStoreDown",
        "KvbatonRoleWithoutUsableInstance",
        "KvbatonReuseCollapsed",
        "KvbatonHandlesRefused",
    } <= alerts


def as_recording_rules(exprs: list[str], path: Path) -> Path:
    rules = [{"record": f"kvbaton:dashboard:expr{i}", "expr": e} for i, e in enumerate(exprs)]
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    return path


def test_every_dashboard_expression_parses(tmp_path: Path) -> None:
    exprs = dashboard_exprs()
    assert len(exprs) >= 15
    done = check_rules(as_recording_rules(exprs, tmp_path / "dashboard.yml"))
    assert done.returncode == 0, done.stdout + done.stderr
    # promtool refuses a broken one, so the check above can fail.
    unbalanced = ["sum(rate(kvbaton_requests_total[1m])"]
    broken = check_rules(as_recording_rules(unbalanced, tmp_path / "broken.yml"))
    assert broken.returncode != 0


def test_the_dashboard_has_the_panels_an_operator_needs() -> None:
    text = DASHBOARD.read_text()
    for metric in (
        "kvbaton_kv_reuse_total",  # turns by outcome and reason
        "kvbaton_kv_reused_tokens_total",
        "kvbaton_ttft_seconds_bucket",
        "kvbaton_upstream_duration_seconds_bucket",
        "kvbaton_store_errors_total",
        "kvbaton_store_circuit_open",
        "kvbaton_backend_healthy",
    ):
        assert metric in text, metric
    assert "by (le, route)" in text and "by (le, role, instance)" in text


@pytest.fixture(scope="module")
def scraped(redis_url_session: str) -> Iterator[set[str]]:
    """Names in a real router's /metrics (samples and # TYPE lines) after two turns."""
    with pd_stack(redis_url_session, "dash") as st:
        yield exported(st)


def exported(st: Stack) -> set[str]:
    cid = f"dash-{uuid.uuid4().hex[:8]}"
    assert chat(st.router.url, cid, "Hello there, tell me about tea.")[0] == 200
    assert chat(st.router.url, cid, "And coffee?")[0] == 200
    with urllib.request.urlopen(st.router.url + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


def known(name: str, names: set[str]) -> bool:
    if name in names:
        return True
    return any(name.endswith(s) and name.removesuffix(s) in names for s in SUFFIXES)


@pytest.mark.parametrize("source", ["dashboard", "rules"])
def test_every_metric_named_is_one_the_router_exports(scraped: set[str], source: str) -> None:
    exprs = dashboard_exprs() if source == "dashboard" else rule_exprs()
    named = {m for e in exprs for m in METRIC.findall(e)}
    assert named, "no kvbaton_ metric found"
    assert "kvbaton_kv_reuse_total" in scraped and "kvbaton_backend_healthy" in scraped
    missing = sorted(m for m in named if not known(m, scraped))
    assert not missing, f"{source} names metrics the router does not export: {missing}"
    assert not known("kvbaton_no_such_metric_total", scraped)
