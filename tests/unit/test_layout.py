"""The package's shape holds: the ground floor imports nothing above it, no import cycles, small
modules, and the old `serve_app.batch` name still works (for one release) and says the new one."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "serve_app"
GROUND_FLOOR = ("serve_app.config", "serve_app.hops", "serve_app.errors", "serve_app.models")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def serve_app_imports(path: Path, *, top_level_only: bool) -> set[str]:
    """serve_app modules ``path`` imports; ``top_level_only``: only those run at import time
    (not inside functions, not under TYPE_CHECKING)."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("serve_app")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("serve_app"):
            assert node.module is not None
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


def existing(name: str, modules: set[str]) -> str | None:
    """The module a dotted import names (``pkg.mod.Class`` → ``pkg.mod``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts}


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith(GROUND_FLOOR)))
def test_ground_floor_imports_nothing_above_it(name: str) -> None:
    for imported in serve_app_imports(MODULES[name], top_level_only=False):
        target = existing(imported, set(MODULES))
        assert target is None or target.startswith(GROUND_FLOOR), f"{name} imports {target}"


def assert_acyclic(graph: dict[str, set[str]], what: str) -> None:
    """Depth-first search; a node met again on the current path is a cycle."""
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            assert state.get(nxt) != 1, f"{what}: " + " -> ".join([*trail, node, nxt])
            if nxt not in state:
                visit(nxt, [*trail, node])
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_no_import_cycles() -> None:
    names = set(MODULES)
    graph = {
        name: {
            t
            for i in serve_app_imports(path, top_level_only=True)
            if (t := existing(i, names)) and t != name and not name.startswith(t + ".")
        }
        for name, path in MODULES.items()
    }
    assert_acyclic(graph, "import cycle")


def test_no_cycles_between_packages() -> None:
    """Roles depend one way (ingress -> batch_api -> graph -> openai -> ground floor): no
    folder imports one that imports it, even through imports inside functions."""

    def folder(module: str) -> str:
        return ".".join(module.split(".")[:2])

    names = set(MODULES)
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        if name == "serve_app":
            continue
        for imported in serve_app_imports(path, top_level_only=False):
            target = existing(imported, names)
            if target and target != "serve_app" and folder(target) != folder(name):
                graph.setdefault(folder(name), set()).add(folder(target))
    assert_acyclic(graph, "package cycle")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small(name: str) -> None:
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= 300, f"{name} has {lines} lines; split it by responsibility"


def test_old_offline_module_name_still_works_and_says_the_new_one() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "serve_app.batch", "run", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "python -m serve_app.offline" in done.stderr
    assert "--input" in done.stdout
