"""The tests' own layout: what test files share lives in helper modules (tests/support/, a
folder's helpers.py or conftest.py), never in a test module (`tests/**/test_*.py`), so that a
test file changes without breaking another."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# bench, loadtest, tools and harness may not import a test module either.
SCANNED = ("tests", "bench", "loadtest", "tools", "harness")

pytestmark = pytest.mark.unit


def owning_test_module(name: str) -> str | None:
    """The test module a dotted name imported under tests/ is, or is in (None: neither)."""
    parts = name.split(".")
    if parts[0] != "tests":
        return None
    for i, part in enumerate(parts[1:], start=2):
        if part.startswith("test_"):
            return ".".join(parts[:i])
    return None


def imported(tree: ast.AST, package: str) -> set[str]:
    """Every module `tree` imports at any depth of the file (`from a import b` imports a, and
    a.b too where a is a package); relative imports resolved against `package`."""
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            module = node.module or ""
            if node.level:
                module = ".".join([*base, module] if module else base)
            out.add(module)
            if (ROOT / Path(*module.split("."))).is_dir():
                out.update(f"{module}.{alias.name}" for alias in node.names)
    return out


def imported_test_modules(source: str, package: str) -> set[str]:
    found = (owning_test_module(name) for name in imported(ast.parse(source), package))
    return {name for name in found if name is not None}


def package_of(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).parent.parts)


def test_no_module_imports_a_test_module() -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(found)
        for folder in SCANNED
        for path in sorted((ROOT / folder).rglob("*.py"))
        if (found := imported_test_modules(path.read_text(), package_of(path)))
    }
    assert offenders == {}, f"import a helper module instead of a test module: {offenders}"


# (source, its package, the test modules it imports)
CASES: list[tuple[str, str, set[str]]] = [
    ("from tests.unit.test_turn import services", "tests.unit", {"tests.unit.test_turn"}),
    ("from tests.unit import test_turn", "tests.ops", {"tests.unit.test_turn"}),
    ("from tests.unit.test_pins import test_x", "tests.unit", {"tests.unit.test_pins"}),
    ("import tests.e2e.test_push as push", "tests.e2e", {"tests.e2e.test_push"}),
    ("from . import test_pd", "tests.sim", {"tests.sim.test_pd"}),
    ("from .test_pd import answer", "tests.sim", {"tests.sim.test_pd"}),
    ("from ..unit.test_turn import turn", "tests.ops", {"tests.unit.test_turn"}),
    ("def f():\n    import tests.deploy.test_compose", "bench", {"tests.deploy.test_compose"}),
    # A contract's tests, imported from the helper module that holds them, are fine.
    ("from tests.sessions.store_contract import test_absent_key", "tests.sessions", set()),
    ("from tests.unit.turns import services", "tests.unit", set()),
    ("from harness.procs import free_port", "bench", set()),
    ("from tests.e2e.conftest import BIDIR", "tests.e2e", set()),
    ("from aiohttp.test_utils import TestServer", "tests.sim", set()),
]


@pytest.mark.parametrize(
    ("source", "package", "found"), CASES, ids=[c[0].split("\n")[-1].strip() for c in CASES]
)
def test_the_check_finds_an_imported_test_module(
    source: str, package: str, found: set[str]
) -> None:
    assert imported_test_modules(source, package) == found


def test_the_harness_imports_neither_bench_nor_tests() -> None:
    """harness/ sits below both of its users: bench/ and tests/ import it, never the reverse."""
    offenders = {
        str(path.relative_to(ROOT)): sorted(
            name
            for name in imported(ast.parse(path.read_text()), package_of(path))
            if name.split(".")[0] in ("bench", "tests")
        )
        for path in sorted((ROOT / "harness").rglob("*.py"))
    }
    assert {k: v for k, v in offenders.items() if v} == {}
