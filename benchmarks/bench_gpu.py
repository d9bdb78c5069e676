"""VGPMIL on one GPU (issue 19): 10⁷ instances × 10 iterations, resident on the device and end to
end from a Zarr cohort store through the Dask pipeline (``fit_cohort``, one GPU worker, persist).

Targets for one H100: under 10 s of compute for the 10 iterations once resident, under 60 s from
the store. D = 128 float32 features, M = 200 inducing points, bags of 100–1,000 instances.

    python benchmarks/bench_gpu.py --store /scratch/gpu-1e7.zarr                 # one H100 (CuPy)
    python benchmarks/bench_gpu.py --store /scratch/gpu-1e7.zarr --model VGPMILPR   # the probit model of seed 002
    python benchmarks/bench_gpu.py --n 1000000 --store /scratch/gpu-1e6.zarr --skip resident --defaults   # the pipeline's default model
    python benchmarks/bench_gpu.py --n 20000 --namespace numpy --store /tmp/s.zarr   # CPU smoke test
    python benchmarks/bench_gpu.py --n 5000 --namespace array_api_strict:device1 --store /tmp/s.zarr
    python benchmarks/bench_gpu.py --n 1000000 --store /scratch/gpu-1e6.zarr --skip resident store --choice --model GVGPMIL

``--choice`` times the defaults' kernel choice alone (``_select_kernel`` on the bags the store
fit's choice reads, at most 20,000 instances): on the host and on the namespace's arrays. It is
most of the first iteration of ``--defaults``, which runs it on the client's host.

``--namespace``: ``cupy`` (the GPU), ``numpy`` (the same code on the host), or any array-API
namespace ``module[:device]``. ``--dtype float32`` keeps the whitened features A' in float32
(statistics in float64). The store is written when missing (features float32) and kept.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
from distributed import Client, LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_distributed import log_iteration, write_cohort  # noqa: E402

from mil_core import GVGPMIL, RBF, VGPMIL, VGPMILPR  # noqa: E402
from mil_core.engine import BagBlock, SerialExecutor, optimise  # noqa: E402
from tasks.store import open_cohort  # noqa: E402
from tasks.training import fit_cohort  # noqa: E402
from mil_core.models.base import choice_bags  # noqa: E402
from mil_core.threadpools import native_threads  # noqa: E402
from tasks.training.placement import ArrayPlacement  # noqa: E402
from tasks.training.preprocess import kmeans_sample, read_bags  # noqa: E402

KERNEL = RBF(variance=1.0)  # pinned (ℓ = √D): kernel=None would also time the automatic kernel choice
MODELS = {"VGPMIL": VGPMIL, "GVGPMIL": GVGPMIL, "VGPMILPR": VGPMILPR}


def synchronise(namespace: str) -> None:
    if namespace.startswith("cupy"):
        import cupy

        cupy.cuda.Device().synchronize()


def resident(store: str, args, dtype: str) -> tuple[dict[str, float], object]:
    """All features on the device once, whitened once, then ``--iterations`` sweeps (serial executor)."""
    cohort = open_cohort(store)
    placement = ArrayPlacement(kind="cpu" if args.namespace == "numpy" else "gpu", namespace=args.namespace, dtype=dtype)
    labels = np.asarray(cohort.bag_labels)
    training = np.flatnonzero(labels >= 0)
    model = MODELS[args.model](n_inducing=args.m, kernel=KERNEL, max_iter=args.iterations, tol=0.0, random_state=0)
    X_sample, sample_labels, sample_offsets, _ = kmeans_sample(cohort, labels, training, 200_000, 0, None)
    updates = model._start_fit(X_sample, sample_labels, offsets=sample_offsets)
    t = time.perf_counter()
    blocks = []
    for p in cohort.partitions(args.partition_mib * 2**20):
        stored = cohort.read_partition(p)
        blocks.append(BagBlock(X=placement.to_device(np.asarray(stored.features)), offsets=np.asarray(stored.offsets),
                               labels=np.asarray(stored.bag_labels).astype(np.int8)))
    synchronise(args.namespace)
    loaded = time.perf_counter() - t
    t = time.perf_counter()
    executor = SerialExecutor(updates, blocks)  # whitening: K(X, Z) and the triangular solve, once
    synchronise(args.namespace)
    whitened = time.perf_counter() - t
    t = time.perf_counter()
    trace = optimise(executor.sweep, updates, updates.init_global(), max_iter=args.iterations, tol=0.0)
    synchronise(args.namespace)
    iterations = time.perf_counter() - t
    assert trace.n_iter == args.iterations and np.isfinite(trace.objective[-1])
    return {"load s": loaded, "whiten s": whitened, f"{args.iterations} iterations s": iterations,
            "s / iteration": iterations / args.iterations}, trace


def kernel_choice(store: str, args) -> dict[str, float]:
    """The default model's kernel choice on the bags a store fit's choice reads
    (:func:`~mil_core.models.base.choice_bags`), on the host and on ``--namespace``'s arrays."""
    cohort = open_cohort(store)
    labels = np.asarray(cohort.bag_labels)
    training = np.flatnonzero(labels >= 0)
    picked = training[choice_bags(np.diff(cohort.offsets)[training], labels[training], 0)]
    X, row_labels, offsets, _ = read_bags(cohort, labels, picked, None)
    placement = ArrayPlacement(kind="gpu", namespace=args.namespace) if args.namespace != "numpy" else None
    times = {}
    for where, data in (("host", X), (args.namespace, None if placement is None else placement.to_device(X))):
        if data is None:
            continue
        model = MODELS[args.model](random_state=0)
        synchronise(where)
        t = time.perf_counter()
        kernel = model._select_kernel(data, offsets, row_labels[offsets[:-1]], None)
        synchronise(where)
        times[f"{where} s"] = time.perf_counter() - t
        print(f"kernel choice on {where} ({X.shape[0]} rows of {picked.size} bags): {times[f'{where} s']:.1f} s; chose {kernel}, "
              f"{model.auto_max_iter_} sweeps, bag rule {getattr(model, 'bag_rule_', None)}", flush=True)
    return times


def from_store(store: str, args) -> dict[str, float]:
    """End to end through ``fit_cohort``: one GPU worker (persist mode), reading the store."""
    device = "cpu" if args.namespace == "numpy" else "gpu"
    resources = {"GPU": 1} if device == "gpu" else None
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=args.namespace.startswith("cupy"), resources=resources,
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        if args.defaults:  # as a user's run: kernel choice and stop, bag rule, n_inducing
            model = MODELS[args.model](random_state=0)
        else:
            model = MODELS[args.model](n_inducing=args.m, kernel=KERNEL, max_iter=args.iterations, tol=0.0, random_state=0,
                                       standardize=False)  # the sweeps alone, as the in-memory timings
        stamps = []
        t = time.perf_counter()
        fit_cohort(model, store, client, run="bench-gpu", resume=False, mode="persist", device=device,
                   gpu_namespace=args.namespace, compute_dtype=args.dtype, partition_bytes=args.partition_mib * 2**20,
                   checkpoint_every=10**6, on_iteration=lambda i, _: log_iteration(stamps, i, t, live=True))
        total = time.perf_counter() - t
    if args.defaults:
        scales = np.atleast_1d(model.kernel_.length_scale)
        lengths = "one length scale" if scales.size == 1 else f"per-feature length scales {scales.min():.3g}–{scales.max():.3g}"
        print(f"defaults chose kernel variance {model.kernel_.variance:g} ({lengths}), bag rule "
              f"{getattr(model, 'bag_rule_', None)}, {model.n_iter_} iterations", flush=True)
    return {"end to end s": total, "first iteration s (incl. load + whiten)": stamps[0] - t,
            "s / later iteration": (stamps[-1] - stamps[0]) / max(len(stamps) - 1, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000_000)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--m", type=int, default=200)
    parser.add_argument("--iterations", type=int, default=10)
    parser.add_argument("--model", choices=list(MODELS), default="VGPMIL")
    parser.add_argument("--namespace", default="cupy")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--partition-mib", type=int, default=512)
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--skip", choices=["resident", "store"], nargs="*", default=[])
    parser.add_argument("--defaults", action="store_true",
                        help="the store run fits the constructor's defaults (kernel choice and stop, bag rule, n_inducing)")
    parser.add_argument("--choice", action="store_true", help="time the defaults' kernel choice alone, on the host and the device")
    parser.add_argument("--compare-float64", action="store_true",
                        help="also run the resident fit in float64 and print the float32 error against it")
    args = parser.parse_args()

    if not args.store.exists():
        t = time.perf_counter()
        write_cohort(args.store, args.n, args.d, (100, 1000))
        print(f"wrote {args.store} ({args.n:.0e} instances) in {time.perf_counter() - t:.0f} s")
    n = open_cohort(str(args.store)).n_instances
    print(f"{platform.node()} {platform.machine()}, python {platform.python_version()}, {native_threads()} native threads "
          f"(the kernel choice runs that many splits side by side); namespace {args.namespace}, "
          f"A' {args.dtype}; {args.model}, N={n:.2e}, D={args.d}, M={args.m}, {args.iterations} iterations"
          + ("; the store run fits the defaults" if args.defaults else ""))
    if "resident" not in args.skip:
        times, trace = resident(str(args.store), args, args.dtype)
        print(f"resident ({args.dtype}):", {k: round(v, 2) for k, v in times.items()}, flush=True)
        if args.compare_float64 and args.dtype == "float32":
            times64, trace64 = resident(str(args.store), args, "float64")
            print("resident (float64):", {k: round(v, 2) for k, v in times64.items()}, flush=True)
            m32, m64 = trace.glob.mean, trace64.glob.mean
            print(f"float32 vs float64 after {args.iterations} iterations: max |m' error| / max |m'| = "
                  f"{np.abs(m32 - m64).max() / np.abs(m64).max():.2e}, ELBO relative error = "
                  f"{abs(trace.objective[-1] - trace64.objective[-1]) / abs(trace64.objective[-1]):.2e}", flush=True)
    if args.choice:
        print("kernel choice:", {k: round(v, 2) for k, v in kernel_choice(str(args.store), args).items()}, flush=True)
    if "store" not in args.skip:
        print("from the store:", {k: round(v, 2) for k, v in from_store(str(args.store), args).items()}, flush=True)


if __name__ == "__main__":
    main()
