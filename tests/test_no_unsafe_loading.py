"""Nothing in the product deserialises in a way that can run code (a static check of every module,
so a new loader cannot slip in): no pickle-family imports, no ``torch.load`` without
``weights_only=True``, no ``np.load(..., allow_pickle=True)``, no ``pd.read_pickle``, no unsafe YAML."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = [p for folder in ("mil_core", "tasks", "flows", "benchmarks") for p in sorted((ROOT / folder).rglob("*.py"))]
PICKLE_FAMILY = {"pickle", "cPickle", "_pickle", "dill", "joblib", "cloudpickle", "shelve", "marshal", "jsonpickle"}


def unsafe_calls(source: str) -> list[str]:
    """``line: what`` for every unsafe import or call in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{node.lineno}: imports {n}" for n in names if n.split(".")[0] in PICKLE_FAMILY]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value.id if isinstance(node.func.value, ast.Name) else ""
            keywords = {k.arg: k.value for k in node.keywords}

            def true(name: str) -> bool:
                return isinstance(keywords.get(name), ast.Constant) and keywords[name].value is True

            call = f"{owner}.{node.func.attr}"
            if call == "torch.load" and not true("weights_only"):
                found.append(f"{node.lineno}: torch.load without weights_only=True")
            elif call in ("np.load", "numpy.load") and true("allow_pickle"):
                found.append(f"{node.lineno}: np.load(allow_pickle=True)")
            elif call in ("pd.read_pickle", "pandas.read_pickle") or call in ("yaml.unsafe_load", "yaml.full_load"):
                found.append(f"{node.lineno}: {call}")
            elif call == "yaml.load" and "Loader" not in keywords:
                found.append(f"{node.lineno}: yaml.load without a safe Loader")
    return found


@pytest.mark.parametrize("path", PRODUCT, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_deserialises_unsafely(path):
    assert unsafe_calls(path.read_text()) == []


def test_the_check_finds_what_it_looks_for():
    source = ("import pickle\nfrom joblib import load\nimport torch, numpy as np, yaml, pandas as pd\n"
              "torch.load('w.pt')\ntorch.load('w.pt', weights_only=True)\nnp.load('a.npy', allow_pickle=True)\n"
              "np.load('a.npy')\npd.read_pickle('t.pkl')\nyaml.load(s)\nyaml.safe_load(s)\n")
    assert [f.split(": ")[1] for f in unsafe_calls(source)] == [
        "imports pickle", "imports joblib", "torch.load without weights_only=True", "np.load(allow_pickle=True)",
        "pd.read_pickle", "yaml.load without a safe Loader"]
