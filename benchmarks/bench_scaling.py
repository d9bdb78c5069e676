"""The cohort's feature standardisation (``fit_cohort`` with a standardising model): its cost
against reading the store.

Times, on one single-threaded in-process Dask worker (as ``bench_gpu.py``'s store run), the
standardisation's pass over the training partitions (``training_scaling``: mean and std) and the
partitions loaded as a float32 fit loads them, raw and standardised; reports each against the raw
load, and the peak traced memory of one standardised partition's load against its stored size.

    python benchmarks/bench_scaling.py --store /tmp/scaling-1e6.zarr      # N = 10⁶, D = 128 (~0.5 GB)

The store is written when missing (``bench_distributed.write_cohort``: float32, bags of 100–1,000).
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np
from distributed import Client, LocalCluster

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_distributed import write_cohort  # noqa: E402

from tasks.store import open_cohort  # noqa: E402
from tasks.training.blocks import load_block  # noqa: E402
from tasks.training.fit import training_scaling  # noqa: E402
from tasks.training.placement import ArrayPlacement  # noqa: E402


def load_all(path: str, partitions, scaling) -> float:
    placement = ArrayPlacement(dtype="float32")
    t = time.perf_counter()
    for partition in partitions:
        load_block(path, partition, placement, scaling=scaling)
    return time.perf_counter() - t


def peak_load_mib(path: str, partition, scaling) -> float:
    tracemalloc.start()
    load_block(path, partition, ArrayPlacement(dtype="float32"), scaling=scaling)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--store", type=Path, required=True)
    parser.add_argument("--n", type=int, default=1_000_000)
    parser.add_argument("--d", type=int, default=128)
    parser.add_argument("--partition-mib", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    if not args.store.exists():
        write_cohort(args.store, args.n, args.d, (100, 1000))
    path = str(args.store)
    cohort = open_cohort(path)
    labelled = np.flatnonzero(np.asarray(cohort.bag_labels) >= 0)
    partitions = cohort.partitions(args.partition_mib * 2**20)
    print(f"{platform.machine()}, python {platform.python_version()}; N = {cohort.n_instances:.0e}, "
          f"D = {cohort.n_features}, {len(partitions)} partitions of ≤ {args.partition_mib} MiB", flush=True)
    rows = {"raw load": [], "standardised load": [], "mean and std pass": []}
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        for _ in range(args.repeats):  # interleaved: the machine's load moves all three alike
            rows["raw load"].append(load_all(path, partitions, None))
            t = time.perf_counter()
            scaling = training_scaling(client, cohort, labelled, args.partition_mib * 2**20)
            rows["mean and std pass"].append(time.perf_counter() - t)
            rows["standardised load"].append(load_all(path, partitions, scaling))
    raw = np.median(rows["raw load"])
    print("| step | median s | × raw load |\n|---|---|---|")
    for name, times in rows.items():
        print(f"| {name} | {np.median(times):.2f} | {np.median(times) / raw:.2f} |")
    stored_mib = partitions[0].n_rows * cohort.n_features * 4 / 2**20
    print(f"one partition ({stored_mib:.0f} MiB stored): peak traced memory of its load, raw "
          f"{peak_load_mib(path, partitions[0], None):.0f} MiB, standardised {peak_load_mib(path, partitions[0], scaling):.0f} MiB")


if __name__ == "__main__":
    main()
