"""Shared fixtures: small synthetic MIL problems with known instance labels."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # before NumPy and torch start their thread pools
    # n workers share the cores: each worker's BLAS, OpenMP and torch get cores / n threads (the suite's
    # subprocesses and local Dask clusters inherit it). With every pool at the core count, 2 workers on
    # 2 cores ran test_embedded.py and test_distributed.py in 243 s against 195 s (session 46).
    _cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    _threads = max(1, _cores // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_name, str(_threads))

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from threadpoolctl import threadpool_limits  # noqa: E402

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:  # a pool loaded before this file (NumPy's OpenBLAS, by a plugin)
    _LIMITS = threadpool_limits(limits=_threads)


def make_toy_bags(n_bags: int = 40, n_features: int = 2, seed: int = 0):
    """Bags of 3–8 instances; negatives ~ N(0, I), positives ~ N(3·e₁, I).

    Positive bags (every other bag) hold 1–3 positive instances. Returns
    ``X, bag_ids, y (bag label per instance), instance_labels``.
    """
    rng = np.random.default_rng(seed)
    X, bags, y, inst = [], [], [], []
    for b in range(n_bags):
        size = int(rng.integers(3, 9))
        label = b % 2
        n_pos = int(rng.integers(1, min(3, size) + 1)) if label else 0
        x = rng.normal(size=(size, n_features))
        x[:n_pos, 0] += 3.0
        X.append(x)
        bags += [b] * size
        y += [label] * size
        inst += [1] * n_pos + [0] * (size - n_pos)
    return np.concatenate(X), np.array(bags), np.array(y), np.array(inst)


def bag_labels(bags: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Each bag's label, in ``np.unique(bags)`` order, from the per-instance ``y``."""
    return y[np.unique(bags, return_index=True)[1]]


@pytest.fixture
def toy_bags():
    return make_toy_bags()


@pytest.fixture
def relevance_weightings(monkeypatch):
    """Records the distinct relevance length scales the kernel choice computes on each set of bags
    (``mil_core.relevance.relevance_weightings`` as ``mil_core.models.base`` calls it):
    ``weightings(n_bags)`` → how many distinct weightings each set of fewer than ``n_bags`` bags
    (each split's training half) got since the last call. Candidates whose forms coincide on a half
    share one fit, so a half's relevance fits per variance are its distinct weightings."""
    import mil_core.models.base as base

    found: dict[tuple, set] = {}
    real = base.relevance_weightings

    def scales(X, offsets, labels):
        by_form = real(X, offsets, labels)
        found.setdefault((offsets.size - 1, offsets.tobytes(), np.asarray(labels).tobytes()), set()).update(by_form.values())
        return by_form

    def weightings(n_bags: int) -> list[int]:
        counts = [len(ells) for (n, *_), ells in found.items() if n < n_bags]
        found.clear()
        return counts

    monkeypatch.setattr(base, "relevance_weightings", scales)
    return weightings


@pytest.fixture(scope="session")
def prefect_server():
    """A real (ephemeral, SQLite) Prefect server for flow tests; its first start can take a minute."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


@pytest.fixture(scope="module")
def bench_accuracy():
    """``benchmarks/bench_accuracy.py`` as a module (the benchmarks are scripts, not a package)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    try:
        import bench_accuracy
    finally:
        sys.path.pop(0)
    return bench_accuracy
