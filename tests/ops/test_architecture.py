"""The layout keeps its promises: dependencies point one way, router/'s layers import only
downwards, the pure modules stay pure, no import cycle (none hidden under TYPE_CHECKING
either), modules stay one concept, and docs/architecture.md's module map is the tree."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("router", "sessions", "vllm_sim")
# The cycle check also covers bench and loadtest (which may import the packages above).
CYCLE_PACKAGES = (*PACKAGES, "bench", "loadtest")
MAX_LINES = 330

# router/'s layers, top to bottom: a module imports only from its own layer or those below it.
# A module is in the layer of the longest name that owns it (a name owns itself and, unless it
# is the top package, what is under it). docs/architecture.md, "Modules", draws them.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("entry", ("router.__main__", "router.cli")),
    ("surface", ("router.http", "router.session_show")),
    ("lifecycle", ("router.lifecycle",)),
    # Each protocol's package, the legs they share (connectors.legs), the selection.
    ("connectors", ("router.connectors",)),
    # One turn: the request as read, the decision core, the steps that apply it.
    ("turn", ("router.turn",)),
    ("services", ("router.services", "router.signing")),
    # The connector seam: what Services holds and each connector's package fills.
    ("seam", ("router.connectors.base",)),
    ("engines", ("router.engines", "router.metrics", "router.metrics_kv")),
    (
        "settings",
        (
            "router.config",
            "router.config_docs",
            "router.command_line",
            "router.flag",
            "router.settings",
            "router.vllm_router_flags",
        ),
    ),
    # The engines' pure model, which the settings validate with (--data-parallel-size).
    (
        "engine model",
        (
            "router.engines.pool",
            "router.engines.identity",
            "router.engines.versions",
            "router.engines.reads",
            "router.engines.ranks",
            "router.engines.metrics_text",
        ),
    ),
    # Leaves that import nothing of the router (the connector names the settings list too).
    (
        "base",
        (
            "router",
            "router.errors",
            "router.logs",
            "router.tracing",
            "router.relay",
            "router.connectors.names",
        ),
    ),
)
# What a pure module (and everything of the project it imports) never imports: I/O.
IO_LIBRARIES = frozenset({"asyncio", "starlette", "aiohttp", "redis"})
# The turn's decision core (router/turn/decide/, one module per question, and the outcomes
# it answers in): each must be marked (pure) in the module map.
DECISION_CORE = "router.turn.decide."


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
            # `from pkg import mod` imports mod (and runs pkg's one-line __init__): an edge to
            # mod, not to pkg; `from mod import name` is an edge to mod.
            subs = [f"{node.module}.{a.name}" for a in node.names]
            names = [n for n in subs if n in known] or [node.module]
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


def layer_of(name: str) -> int:
    """The index in LAYERS of the layer that owns module `name` (-1: none does)."""
    best, found = -1, ""
    for index, (_, owners) in enumerate(LAYERS):
        for owner in owners:
            owns = name == owner or ("." in owner and name.startswith(owner + "."))
            if owns and len(owner) > len(found):
                best, found = index, owner
    return best


def back_edges(deps: dict[str, set[str]]) -> list[str]:
    """Every import of router/ that reaches a layer above the importer's."""
    out = []
    for name, targets in sorted(deps.items()):
        for dep in sorted(targets):
            inside = name.startswith("router") and dep.startswith("router")
            if inside and layer_of(dep) < layer_of(name):
                out.append(
                    f"{name} ({LAYERS[layer_of(name)][0]}) imports {dep} "
                    f"({LAYERS[layer_of(dep)][0]})"
                )
    return out


def test_every_router_module_has_a_layer() -> None:
    missing = [n for n in modules() if n.startswith("router") and layer_of(n) < 0]
    assert not missing, f"not in LAYERS: {missing}"


def test_layers_import_only_downwards() -> None:
    assert back_edges(graph()) == []


def test_an_injected_back_edge_is_caught() -> None:
    """The check itself: one import from the decision core up to the HTTP surface fails it."""
    deps = graph()
    core = "router.turn.decide.sendable"
    deps[core] = deps[core] | {"router.http.app"}
    assert f"{core} (turn) imports router.http.app (surface)" in back_edges(deps)


def test_the_turn_imports_no_connector_and_no_http() -> None:
    """The turn reaches its connector through Services and the protocols its decisions
    declare, never by import (not even the seam), and knows nothing of HTTP."""
    for name, deps in graph().items():
        if name.startswith("router.turn"):
            bad = {d for d in deps if d.startswith(("router.connectors", "router.http"))}
            assert not bad, f"{name} imports {sorted(bad)}"


def _libraries(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def pure_modules() -> list[str]:
    """The modules docs/architecture.md's module map marks (pure)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    paths = re.findall(r"^\| `((?:router|sessions)/[\w/]+)\.py` \|.*\(pure\) \|$", text, re.M)
    return [p.replace("/", ".") for p in paths]


def test_the_decision_core_is_marked_pure() -> None:
    core = {m for m in modules() if m.startswith(DECISION_CORE)} | {"router.turn.outcomes"}
    assert len(core) > 1 and core <= set(pure_modules())


def test_pure_modules_do_no_io() -> None:
    """A module marked (pure), and every project module it imports however deep, imports
    none of asyncio, starlette, aiohttp or redis."""
    deps, paths = graph(), modules()
    for name in pure_modules():
        seen, todo = set(), [name]
        while todo:
            mod = todo.pop()
            if mod not in seen:
                seen.add(mod)
                todo.extend(deps[mod])
        for mod in sorted(seen):
            io = _libraries(paths[mod]) & IO_LIBRARIES
            assert not io, f"{name} is pure, but {mod} (which it imports) imports {sorted(io)}"
