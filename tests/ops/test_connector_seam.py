"""The connector seam keeps its promise: every `ConnectorName` has a package that builds it,
and outside router/connectors/ nothing compares a connector's name (the turn asks
`Capabilities`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from router.config import Settings
from router.connectors.base import Defaults
from router.connectors.names import ConnectorName
from router.connectors.select import select

ROOT = Path(__file__).resolve().parents[2]
NAMES = {name.value for name in ConnectorName}


@pytest.mark.parametrize("name", list(ConnectorName))
def test_every_name_has_a_package_that_builds_its_connector(name: ConnectorName) -> None:
    settings = Settings(
        prefill=("http://p",),
        decode=("http://d",),
        kv_connector=name,
        moriio_register="tcp://127.0.0.1:1" if name is ConnectorName.MORIIO else "",
    )
    connector = select(settings)
    assert connector.name is name and isinstance(connector, Defaults)
    assert type(connector).__module__ == name.package + ".connector"
    assert (ROOT / name.package.replace(".", "/") / "__init__.py").is_file()


def _name_tests(tree: ast.AST) -> list[int]:
    """Lines comparing something with a connector's name (a string or a ConnectorName)."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare):
            continue
        for side in (node.left, *node.comparators):
            literal = isinstance(side, ast.Constant) and side.value in NAMES
            members = isinstance(side, ast.Tuple | ast.Set | ast.List) and any(
                isinstance(e, ast.Constant) and e.value in NAMES for e in side.elts
            )
            enum = isinstance(side, ast.Attribute) and (
                isinstance(side.value, ast.Name) and side.value.id == "ConnectorName"
            )
            named = isinstance(side, ast.Attribute) and side.attr in ("kv_connector", "name")
            if literal or members or enum or (named and _mentions_connector(side)):
                found.append(node.lineno)
    return found


def _mentions_connector(side: ast.Attribute) -> bool:
    text = ast.unparse(side)
    return "connector" in text


def test_no_connector_name_is_compared_outside_the_connector_packages() -> None:
    offenders = []
    for path in sorted((ROOT / "router").rglob("*.py")):
        rel = path.relative_to(ROOT)
        demo = rel.parent == Path("router/lifecycle") and rel.name.startswith("demo")
        if rel.parts[:2] == ("router", "connectors") or demo:
            continue  # the demo starts simulators in the mode the user chose (its own flag)
        lines = _name_tests(ast.parse(path.read_text()))
        offenders += [f"{rel}:{n}" for n in lines]
    assert not offenders, f"connector names compared outside router/connectors/: {offenders}"
