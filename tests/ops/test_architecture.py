"""The layout keeps its promises: dependencies point one way, no import cycle (none hidden
under TYPE_CHECKING either), modules stay one concept, and docs/architecture.md's module map
is the tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("router", "sessions", "vllm_sim")
# The cycle check also covers bench (which may import the packages above).
CYCLE_PACKAGES = (*PACKAGES, "bench")
MAX_LINES = 330


def modules(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            found[name] = path
    return found


def imports(path: Path, known: set[str]) -> set[str]:
    """Every project module this one imports, at any depth of the file (TYPE_CHECKING too)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        out.update(n for n in names if n in known)
    return out


def graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    mods = modules(packages)
    known = set(mods)
    return {name: imports(path, known) - {name} for name, path in mods.items()}


def test_no_import_cycle() -> None:
    deps = graph(CYCLE_PACKAGES)
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            raise AssertionError("import cycle: " + " -> ".join([*path[path.index(node) :], node]))
        if node in done:
            return
        for dep in sorted(deps.get(node, ())):
            visit(dep, [*path, node])
        done.add(node)

    for name in sorted(deps):
        visit(name, [])


def test_dependencies_point_one_way() -> None:
    for name, deps in graph().items():
        top = name.split(".")[0]
        tops = {d.split(".")[0] for d in deps}
        if top == "sessions":
            assert tops <= {"sessions"}, f"{name} imports {deps}"
        if top == "vllm_sim":
            assert tops <= {"vllm_sim"}, f"{name} imports {deps}"
        if top == "router" and name != "router.cli":  # `kvbaton sim` hands over to it
            assert "vllm_sim" not in tops, f"{name} imports the simulator"


def test_the_vocabulary_is_the_base_layer() -> None:
    """The words sessions and the router share import nothing from the project."""
    assert graph()["sessions.vocabulary"] == set()


def test_redis_is_only_in_sessions() -> None:
    for name, path in modules().items():
        if not name.startswith("sessions"):
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                if isinstance(node, ast.ImportFrom) and node.module:
                    mods = [node.module]
                assert not any(m.split(".")[0] == "redis" for m in mods), f"{name} imports redis"


def test_no_module_is_more_than_one_concept() -> None:
    for name, path in modules().items():
        if name.startswith(("router", "sessions", "vllm_sim")):
            lines = len(path.read_text().splitlines())
            assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines"


def test_the_module_map_is_the_tree() -> None:
    text = (ROOT / "docs" / "architecture.md").read_text()
    listed = set(re.findall(r"^\| `((?:router|sessions)/[\w/]+\.py)` \|", text, re.MULTILINE))
    tree = {
        str(p.relative_to(ROOT))
        for name, p in modules().items()
        if name.startswith(("router", "sessions")) and p.name != "__init__.py"
    }
    tree -= {"router/__main__.py"}
    assert listed == tree, f"not in the map: {tree - listed}; not in the tree: {listed - tree}"
