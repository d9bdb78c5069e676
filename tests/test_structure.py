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


# One home per formula (issue 15): the written-out form of each shared formula, and the one module
# that may hold it; everyone else calls that module's function.
FORMULAS = {
    "the probit scale μ/√(1 + πσ²/8) or μ/√(1 + σ²)": (
        r"sqrt\(\s*1(\.0)?\s*\+\s*(np\.pi\s*\*\s*)?\w+(\s*/\s*8(\.0)?)?\s*\)", "mil_core.predictive"),
    "Monte Carlo draws of f* ~ N(μ, σ²)": (r"sqrt\(\s*\w+\s*\)(\[:, None\])?\s*\*\s*\w+\.standard_normal\(", "mil_core.predictive"),
    "segment log-sum-exp (or softmax) over bags": (
        r"np\.log\(\s*np\.add\.reduceat\(\s*np\.exp|np\.maximum\.reduceat\(\s*\w+\s*,\s*offsets\[:-1\]\)\s*,\s*np\.diff", "mil_core.bags"),
    "the KL of q(v) to the whitened prior": (r"np\.trace\(\s*self\.cov\s*\)|np\.trace\(\s*\w+\.cov\s*\)\s*\+", "mil_core.engine"),
    "whitening A' = K(X, Z) L⁻ᵀ": (r"solve_lower\(\s*like\(\s*\w*\.?chol", "mil_core.engine"),
}


def _code(path: Path) -> str:
    """The source of ``path`` without its strings and comments (a docstring may quote a formula)."""
    import io
    import tokenize

    skip = {tokenize.STRING, tokenize.COMMENT} | {getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END")
                                                   if hasattr(tokenize, n)}
    lines = [list(line) for line in path.read_text().splitlines(keepends=True)]
    for token in tokenize.generate_tokens(io.StringIO("".join(map("".join, lines))).readline):
        if token.type in skip:  # blanked in place: the code around keeps its spacing
            (r0, c0), (r1, c1) = token.start, token.end
            for r in range(r0, r1 + 1):
                row = lines[r - 1]
                for c in range(c0 if r == r0 else 0, c1 if r == r1 else len(row)):
                    if row[c] != "\n":
                        row[c] = " "
    return "".join(map("".join, lines))


def _formula_homes() -> dict[str, set[str]]:
    """For each formula of :data:`FORMULAS`, the modules whose code writes it out."""
    import re

    sources = {_module_name(p): _code(p) for p in ROOT.rglob("*.py")}
    return {what: {name for name, text in sources.items() if re.search(pattern, text)} for what, (pattern, _) in FORMULAS.items()}


def test_each_shared_formula_has_one_home():
    homes = _formula_homes()
    for what, (_, home) in FORMULAS.items():
        assert homes[what] == {home}, f"{what}: written out in {sorted(homes[what])}, its home is {home}"


def test_the_formula_patterns_find_copies():
    import re

    copies = {
        "the probit scale μ/√(1 + πσ²/8) or μ/√(1 + σ²)": ["mean / np.sqrt(1.0 + var)", "m / np.sqrt(1 + np.pi * v / 8)"],
        "Monte Carlo draws of f* ~ N(μ, σ²)": ["mean[:, None] + np.sqrt(var)[:, None] * rng.standard_normal((n, L))"],
        "segment log-sum-exp (or softmax) over bags": ["np.log(np.add.reduceat(np.exp(v - top), offsets[:-1]))",
                                                       "a - np.repeat(np.maximum.reduceat(a, offsets[:-1]), np.diff(offsets))"],
        "the KL of q(v) to the whitened prior": ["0.5 * (np.trace(q.cov) + q.mean @ q.mean - M - logdet)"],
        "whitening A' = K(X, Z) L⁻ᵀ": ["A = solve_lower(like(gp.chol, Kzx), Kzx).T"],
    }
    for what, examples in copies.items():
        for example in examples:
            assert re.search(FORMULAS[what][0], example), (what, example)
    assert not re.search(FORMULAS["the probit scale μ/√(1 + πσ²/8) or μ/√(1 + σ²)"][0], "1.0 / np.sqrt(1.0 + 2.0 * var)")
