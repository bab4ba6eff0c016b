"""The layout's rules, checked on the source: the ground floor imports nothing above it, no
module imports itself back through another, and no module grows past ~300 lines."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "serve_app"
GROUND_FLOOR = ("serve_app.config", "serve_app.hops", "serve_app.errors", "serve_app.models")
MAX_LINES = 300


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """serve_app modules ``path`` imports, at any depth (TYPE_CHECKING and function bodies too)."""
    name, found = _module_name(path), set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    return {module for module in found if module.startswith("serve_app")}


def _graph() -> dict[str, set[str]]:
    modules = {_module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: _imports(path) & set(modules) for name, path in modules.items()}


def _below(module: str) -> bool:
    return any(module == floor or module.startswith(floor + ".") for floor in GROUND_FLOOR)


def test_the_ground_floor_imports_nothing_above_it() -> None:
    upward = {
        (module, imported)
        for module, imports in _graph().items()
        if _below(module)
        for imported in imports
        if not _below(imported) and imported != "serve_app"
    }
    assert not upward, f"ground-floor modules import upward: {sorted(upward)}"


def test_no_import_cycles_between_modules() -> None:
    graph = _graph()
    # A package's __init__ re-exporting its children is not a cycle of the code itself.
    edges = {
        m: {i for i in imports if i != m and not m.startswith(i + ".")}
        for m, imports in graph.items()
    }
    state: dict[str, int] = {}

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for imported in sorted(edges[module]):
            if state.get(imported) == 1:
                cycle = [*path[path.index(imported) :], imported]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if imported not in state:
                visit(imported, [*path, imported])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])


def test_no_module_over_the_line_budget() -> None:
    long = {
        str(path.relative_to(PACKAGE)): n
        for path in PACKAGE.rglob("*.py")
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"modules over {MAX_LINES} lines: {long}"
