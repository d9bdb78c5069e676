"""CPU seconds of the engine's per-partition work on one partition of a cohort store (issue 19).

Whitening (K(X, Z) and the triangular solve, once per partition in persist mode, every sweep in
stream mode) and a sweep's statistics (E f and Var f, the Gram Σ θ a'a'ᵀ, the projection Σ a'(π − ½)),
in float64 and float32 A', M = 200 inducing points, best of 3 in process CPU time (robust to other
load on the machine, unlike wall time), and the peak memory NumPy allocates while whitening the
partition (``tracemalloc``; the result A' included). Run it with one BLAS thread and the malloc setting Dask
workers get (``distributed.nanny.pre-spawn-environ``), which makes large temporaries fresh mmaps:

    MALLOC_TRIM_THRESHOLD_=65536 OPENBLAS_NUM_THREADS=1 python benchmarks/bench_partition.py --store cohort-1000000.zarr

Prints one Markdown row per dtype. To compare with another commit, put that checkout first on
``PYTHONPATH`` (the script imports ``mil_core`` from there).
"""

from __future__ import annotations

import argparse
import time
import tracemalloc

import numpy as np
from threadpoolctl import threadpool_limits

from mil_core.engine import GaussianQ, SparseGP
from mil_core.kernels import RBF
from tasks.store import open_cohort


def cpu_seconds(f, *args, repeats: int = 3) -> float:
    best = np.inf
    for _ in range(repeats):
        t = time.process_time()
        f(*args)
        best = min(best, time.process_time() - t)
    return best


def peak_mib(f, *args) -> float:
    tracemalloc.start()
    try:
        f(*args)
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", required=True)
    parser.add_argument("--partition-mib", type=int, default=64)
    parser.add_argument("--inducing", type=int, default=200)
    parser.add_argument("--label", default="")
    args = parser.parse_args()

    cohort = open_cohort(args.store)
    X32 = np.asarray(cohort.read_partition(cohort.partitions(args.partition_mib * 2**20)[0]).features)
    n, M = X32.shape[0], args.inducing
    gp = SparseGP.build(RBF(1.0).resolve(X32.shape[1]), X32[:: max(1, n // M)][:M].astype(np.float64))
    rng = np.random.default_rng(0)
    G = rng.standard_normal((M, 3 * M))
    cov = np.linalg.inv(np.eye(M) + G @ G.T)
    q, weights = GaussianQ(mean=rng.standard_normal(M), cov=0.5 * (cov + cov.T)), rng.random(n)
    print("| code | A' dtype | rows | whiten | E f, Var f | Gram | projection | sweep statistics | whitening peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    with threadpool_limits(1):
        for dtype in (np.float64, np.float32):
            X = X32.astype(dtype)
            whitened = gp.whiten(X)
            times = [cpu_seconds(gp.whiten, X), cpu_seconds(whitened.latent_moments, q), cpu_seconds(whitened.weighted_gram, weights),
                     cpu_seconds(whitened.project, weights)]
            print(f"| {args.label} | {dtype.__name__} | {n} | " + " | ".join(f"{t:.3f}" for t in times) + f" | {sum(times[1:]):.3f} | "
                  f"{peak_mib(gp.whiten, X):.0f} |",
                  flush=True)


if __name__ == "__main__":
    main()
