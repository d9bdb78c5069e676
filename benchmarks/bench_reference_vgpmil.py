"""Per-iteration time of our VGPMIL next to the public 2017 VGPMIL code (Haußmann et al., CVPR 2017)
on the same generated data, one thread each (issue 19).

The reference code is not part of this repository and is never copied into it: point
``--reference`` at a checkout of github.com/manuelhaussmann/vgpmil (its ``vgpmil.py`` and
``helperfunctions.py``). Its k-means needs OpenCV; the benchmark gives both models the same
inducing points, so a stand-in ``cv2`` module that refuses to be used is enough to import it.

    python benchmarks/bench_reference_vgpmil.py --reference /path/to/vgpmil --sizes 10000 100000

Both run the same update equations (000, Eq. 25–28) with D = 128 features, M = 200 inducing
points, bags of 100–1,000 instances. Per iteration = (time of 1 + k iterations − time of 1) / k,
so the reference's set-up (K_zz⁻¹ K_zx) and ours (whitening) are left out; the two are timed
alternately ``--repeats`` times and the best of each is kept (the machine may be shared).
"""

from __future__ import annotations

import argparse
import importlib.util
import platform
import sys
import time
import types
from pathlib import Path

import numpy as np
from threadpoolctl import threadpool_limits

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_distributed import bag_sizes  # noqa: E402

from mil_core import VGPMIL  # noqa: E402
from mil_core.engine import BagBlock, SerialExecutor, SparseGP, optimise  # noqa: E402
from mil_core.inducing import kmeans_inducing_points  # noqa: E402
from mil_core.kernels import RBF  # noqa: E402


def load_reference(folder: Path):
    """The reference module, imported from ``folder`` with a ``cv2`` that must not be called."""
    def refuse(*args, **kwargs):
        raise RuntimeError("the benchmark passes the inducing points; the reference's cv2 k-means must not run")

    sys.modules.setdefault("cv2", types.SimpleNamespace(kmeans=refuse, TERM_CRITERIA_EPS=1, TERM_CRITERIA_MAX_ITER=2,
                                                        KMEANS_RANDOM_CENTERS=0))
    sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location("reference_vgpmil", folder / "vgpmil.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, importlib.import_module("helperfunctions")


def data(n: int, d: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    sizes = bag_sizes(n, 100, 1000, seed)
    bags = np.repeat(np.arange(sizes.size), sizes)
    labels = (np.arange(sizes.size) % 2)[bags]
    X = rng.standard_normal((n, d))
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    witnesses = np.concatenate([np.arange(a, a + max(1, s // 10)) for a, s, lab in zip(first, sizes, np.arange(sizes.size) % 2) if lab])
    X[witnesses, 0] += 3.0
    return X, bags, labels


def time_ours(X, bags, labels, Z, iterations: int) -> float:
    model = VGPMIL(n_inducing=Z.shape[0], max_iter=1, tol=0.0, random_state=0)
    model.n_features_in_ = X.shape[1]
    kernel = RBF(variance=1.0, length_scale=float(np.sqrt(X.shape[1])))
    updates = model._make_updates(SparseGP.build(kernel, Z))
    offsets = np.concatenate([[0], np.flatnonzero(np.diff(bags)) + 1, [bags.size]])
    block = BagBlock(X=X, offsets=offsets, labels=labels[offsets[:-1]].astype(np.int8))
    executor = SerialExecutor(updates, [block])

    def sweeps(k: int) -> float:
        t = time.perf_counter()
        optimise(executor.sweep, updates, updates.init_global(), max_iter=k, tol=0.0)
        return time.perf_counter() - t

    return (sweeps(1 + iterations) - sweeps(1)) / iterations


def time_reference(reference, helpers, X, bags, labels, Z, iterations: int) -> float:
    def train(k: int) -> float:
        np.random.seed(0)
        model = reference.vgpmil(helpers.RBF(lengthscale=float(np.sqrt(X.shape[1])), variance=1.0), num_inducing=Z.shape[0],
                                 max_iter=k, normalize=False)
        t = time.perf_counter()
        model.train(X, labels, bags, Z=Z)
        return time.perf_counter() - t

    return (train(1 + iterations) - train(1)) / iterations


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference", type=Path, required=True, help="folder with the reference vgpmil.py")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--inducing", type=int, default=200)
    parser.add_argument("--iterations", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    reference, helpers = load_reference(args.reference)
    print(f"{platform.machine()}, python {platform.python_version()}, numpy {np.__version__}; one thread; "
          f"D={args.features}, M={args.inducing}, bags of 100-1000\n")
    print("| N | bags | ours s / iteration | reference s / iteration | reference / ours |")
    print("|---|---|---|---|---|")
    with threadpool_limits(1):
        for n in args.sizes:
            X, bags, labels = data(n, args.features)
            Z = kmeans_inducing_points(X[:: max(1, n // 20_000)], labels[:: max(1, n // 20_000)], args.inducing, random_state=0)
            ours, theirs = np.inf, np.inf
            for _ in range(args.repeats):
                ours = min(ours, time_ours(X, bags, labels, Z, args.iterations))
                theirs = min(theirs, time_reference(reference, helpers, X, bags, labels, Z, args.iterations))
            print(f"| {n:.0e} | {np.unique(bags).size} | {ours:.3f} | {theirs:.3f} | {theirs / ours:.2f} |", flush=True)


if __name__ == "__main__":
    main()
