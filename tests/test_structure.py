"""mil_core's layering: no import cycles, numerics never import a model, no orchestration imports.

Static (AST) check of every ``import`` in the package, including those under ``TYPE_CHECKING``
and inside functions, so a cycle cannot hide behind a deferred import.
"""

from __future__ import annotations

import ast
from pathlib import Path

import mil_core

ROOT = Path(mil_core.__file__).parent
FORBIDDEN = ("prefect", "dask", "distributed", "zarr")


def _module_name(path: Path) -> str:
    parts = ("mil_core",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (and, for ``from x import y``, ``x.y``)."""
    name = _module_name(path)
    package = (name if path.name == "__init__.py" else name.rpartition(".")[0]).split(".")
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return found


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: {m for m in _imports(path) if m in files and m != name} for name, path in files.items()}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a closed path, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_import_graph_has_no_cycle():
    graph = _graph()
    assert {"mil_core.models.base", "mil_core.engine"} <= graph["mil_core.models.probit"]  # relative imports resolved
    cycle = _find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_cycle_finder_reports_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_numerics_never_import_a_model():
    for name, deps in _graph().items():
        if name == "mil_core" or name.startswith("mil_core.models"):
            continue
        assert not any(d.startswith("mil_core.models") for d in deps), f"{name} imports a model module"


def test_no_orchestration_imports():
    for path in ROOT.rglob("*.py"):
        bad = {m for m in _imports(path) if m.split(".")[0] in FORBIDDEN}
        assert not bad, f"{_module_name(path)} imports {sorted(bad)}"
