"""Throughput of the Dask executor (issue 6): instance-iterations/s next to this machine's GEMM roofline.

Writes synthetic feature cohorts (D features, bags of ~`--bag-size` instances, float32) into Zarr
stores under `--workdir`, then fits VGPMIL (or `--models`: VGPMILPR, VWSGP) with M inducing points for `--iterations` sweeps on a
LocalCluster of 1 and 2 single-threaded workers, in persist and stream mode. Prints a Markdown table.

    python benchmarks/bench_distributed.py                                   # N = 1e4, 1e5, 1e6 (~10 min)
    python benchmarks/bench_distributed.py --sizes 10000 --workers 1 --iterations 3   # quick

Flop counts per instance-iteration: persist mode reuses the whitened features a'ₙ, so a sweep is
E f, Var f (2M² + 2M) and the Gram statistics (2M²): ≈ 4M². Stream mode recomputes K(x, Z) (2MD)
and the triangular solve (M²) every sweep: ≈ 2MD + 5M². These are GEMM-equivalent counts: the
engine runs Var f as a triangular product (TRMM) and the Gram as a symmetric rank-k update (SYRK),
about half of those flops each, so the fraction of the roofline can exceed 1. The roofline is the measured GEMM rate
of one core in the fit's ``--dtype`` times the number of cores used (workers × threads). The
kernel is pinned (RBF, v = 1, ℓ = √D) so that the automatic kernel choice is not timed.

The 10⁷ figures of ``docs/BENCHMARKS.md`` (store written once, ~5 GB, then reused)::

    python benchmarks/bench_distributed.py --workdir /scratch --sizes 10000000 --bag-size-range 100 1000 \
        --models VGPMIL --workers 2 --modes persist --dtype float32 --iterations 9 --log-iterations
"""

from __future__ import annotations

import argparse
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from distributed import Client, LocalCluster
from threadpoolctl import threadpool_limits

from mil_core import RBF, VGPMIL, VGPMILPR, VWSGP
from tasks.store import BagData, CohortSpec, append_bags, create_cohort
from tasks.training import fit_cohort

MODELS = {"VGPMIL": VGPMIL, "VGPMILPR": VGPMILPR, "VWSGP": VWSGP}


def gemm_flops_per_core(n: int = 1024, repeats: int = 5, dtype: str = "float64") -> float:
    """Best-of-``repeats`` GEMM rate on one thread in ``dtype``."""
    a, b = np.random.default_rng(0).standard_normal((2, n, n)).astype(dtype)
    best = np.inf
    with threadpool_limits(1):
        for _ in range(repeats):
            t = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def bag_sizes(n_instances: int, low: int, high: int, seed: int = 0) -> np.ndarray:
    """Bag sizes drawn uniformly from ``[low, high]`` until they hold ``n_instances`` (the last one trimmed)."""
    rng = np.random.default_rng(seed + 1)
    sizes = rng.integers(low, high + 1, size=2 * n_instances // (low + high) + 2)
    sizes = sizes[: int(np.searchsorted(np.cumsum(sizes), n_instances)) + 1]
    sizes[-1] -= int(sizes.sum()) - n_instances
    return sizes[sizes > 0]


def write_cohort(path: Path, n_instances: int, n_features: int, bag_size: int | tuple[int, int], seed: int = 0) -> None:
    """Bags of ``bag_size`` instances (or sizes drawn from a ``(low, high)`` range), float32;
    positive bags (every other) hold 10% shifted witnesses."""
    rng = np.random.default_rng(seed)
    create_cohort(path, CohortSpec(name=path.stem, n_features=n_features, coords_dim=1, coords_meaning="index"))
    sizes = bag_sizes(n_instances, *bag_size, seed) if isinstance(bag_size, tuple) else np.full(max(2, n_instances // bag_size), bag_size)

    def bags():
        for b, size in enumerate(sizes.tolist()):
            X = rng.standard_normal((size, n_features), dtype=np.float32)
            label = b % 2
            if label:
                X[: max(1, size // 10), 0] += 3.0
            yield BagData(bag_id=f"b{b:08d}", label=label, source="synthetic", features=X,
                          coords=np.arange(size)[:, None], instance_labels=np.full(size, -1))

    append_bags(path, bags())


def worker_peak_rss_mib(client: Client) -> list[float]:
    """Each worker process's peak resident memory (``ru_maxrss``), in MiB."""
    peaks = client.run(lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    return [peaks[w] / 1024 for w in sorted(peaks)]


def log_iteration(stamps: list[float], iteration: int, t0: float, live: bool) -> None:
    stamps.append(time.perf_counter())
    if live:  # long runs: each iteration's time as it happens (stderr), before the table row
        step = stamps[-1] - (stamps[-2] if len(stamps) > 1 else t0)
        print(f"iteration {iteration}: {step:.1f} s (since start {stamps[-1] - t0:.1f} s)", file=sys.stderr, flush=True)


def run(store: Path, model_name: str, workers: int, mode: str, args) -> dict:
    with LocalCluster(n_workers=workers, threads_per_worker=args.threads_per_worker, processes=True, dashboard_address=":0",
                      memory_limit=args.memory_limit) as cluster, Client(cluster) as client:
        stamps = []
        # the kernel is pinned (RBF, v = 1, ℓ = √D): kernel=None would time the automatic kernel choice, not the engine;
        # the generated features are unit-scale: standardize=False times the sweeps without the scaling pass
        model = MODELS[model_name](n_inducing=args.inducing, kernel=RBF(variance=1.0), max_iter=args.iterations + 1, tol=0.0,
                                   random_state=0, standardize=False)
        t0 = time.perf_counter()
        fit_cohort(model, store, client, run=f"bench-{model_name}-{workers}-{mode}-{args.dtype}", resume=False, mode=mode,
                   partition_bytes=args.partition_mib * 2**20, checkpoint_every=10**6, compute_dtype=args.dtype,
                   on_iteration=lambda i, _: log_iteration(stamps, i, t0, args.log_iterations))
        total = time.perf_counter() - t0
        per_iter = (stamps[-1] - stamps[0]) / (len(stamps) - 1)  # first sweep includes loading
        return {"seconds_per_iteration": per_iter, "first_iteration": stamps[0] - t0, "total": total,
                "peak_rss_mib": worker_peak_rss_mib(client)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", type=int, default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--workers", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--modes", nargs="+", default=["persist", "stream"])
    parser.add_argument("--models", nargs="+", default=["VGPMIL"], choices=list(MODELS))
    parser.add_argument("--features", type=int, default=128)
    parser.add_argument("--inducing", type=int, default=200)
    parser.add_argument("--bag-size", type=int, default=100)
    parser.add_argument("--bag-size-range", type=int, nargs=2, default=None, metavar=("LOW", "HIGH"),
                        help="bag sizes drawn uniformly from [LOW, HIGH] instead of --bag-size")
    parser.add_argument("--iterations", type=int, default=5, help="sweeps after the first (the first loads and whitens)")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64", help="compute_dtype of the fit (A' in float32)")
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--partition-mib", type=int, default=64)
    parser.add_argument("--memory-limit", default="auto")
    parser.add_argument("--log-iterations", action="store_true", help="print each iteration's time to stderr as it ends")
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()

    roof = gemm_flops_per_core(dtype=args.dtype)
    M, D = args.inducing, args.features
    flops = {"persist": 4 * M * M + 2 * M, "stream": 2 * M * D + 5 * M * M}
    print(f"machine: {platform.machine()}, {platform.processor() or ''} python {platform.python_version()}; "
          f"{args.dtype} GEMM, one core: {roof / 1e9:.1f} GFLOP/s; D={D}, M={M}, bags of "
          f"{'-'.join(map(str, args.bag_size_range)) if args.bag_size_range else args.bag_size}, "
          f"partitions of {args.partition_mib} MiB, compute_dtype {args.dtype}, {args.threads_per_worker} thread(s) per worker\n")
    print("| model | N | workers | mode | s / iteration | instance-iterations / s | GFLOP/s | fraction of roofline | first iteration s | end to end s | peak RSS MiB per worker |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="gpmil-bench-"))
    try:
        for n in args.sizes:
            store = workdir / f"cohort-{n}.zarr"
            if not store.exists():
                t = time.perf_counter()
                write_cohort(store, n, D, tuple(args.bag_size_range) if args.bag_size_range else args.bag_size)
                print(f"<!-- wrote {store.name}: {time.perf_counter() - t:.0f} s -->", flush=True)
            for model_name in args.models:
                for workers in args.workers:
                    for mode in args.modes:
                        r = run(store, model_name, workers, mode, args)
                        rate = n / r["seconds_per_iteration"]
                        # the flop counts are VGPMIL's (VWSGP works on per-bag sums; VGPMILPR adds truncated-normal moments)
                        gflops = rate * flops[mode] / 1e9 if model_name == "VGPMIL" else float("nan")
                        print(f"| {model_name} | {n:.0e} | {workers} | {mode} | {r['seconds_per_iteration']:.3f} | {rate:.3g} | {gflops:.1f} | "
                              f"{gflops * 1e9 / (roof * workers * args.threads_per_worker):.2f} | {r['first_iteration']:.1f} | {r['total']:.0f} | "
                              f"{' / '.join(f'{m:.0f}' for m in r['peak_rss_mib'])} |", flush=True)
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
