"""Mixing and cost of the Gibbs reference (``VGPMILPRGibbs``) on the accuracy benchmark's first fold.

Per data set and seed: fit time, the split-R̂ of the 100 whitened inducing values (median, 90 %, max;
``rhat_`` is the max) and the effective sample size (initial positive autocorrelations, cut at 0.05) of
``‖v‖`` and of the mean latent value over the training instances, out of ``n_samples`` kept sweeps.
The kernel is the one ``kernel=None`` chooses there (the variational model's choice: 64 on MUSK1, 16 on
digits), fixed so that only the chain differs.

    nice env OMP_NUM_THREADS=1 python benchmarks/bench_gibbs.py [--seeds 0 1 2] [--datasets musk1 digits]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_accuracy import folds  # noqa: E402  (the same standardised folds)

from mil_core import RBF, VGPMILPRGibbs  # noqa: E402

VARIANCE = {"musk1": 64.0, "digits": 16.0}


def split_rhats(samples: np.ndarray) -> np.ndarray:
    n = samples.shape[0] // 2
    halves = np.stack([samples[:n], samples[-n:]])
    within = halves.var(axis=1, ddof=1).mean(axis=0)
    between = n * halves.mean(axis=1).var(axis=0, ddof=1)
    return np.sqrt(((n - 1) / n * within + between / n) / within)


def effective_sample_size(x: np.ndarray, cut: float = 0.05) -> float:
    x = x - x.mean()
    n = x.shape[0]
    acf = np.correlate(x, x, "full")[n - 1 :] / (x @ x)
    below = np.flatnonzero(acf[1:] < cut)
    lag = below[0] + 1 if below.size else n
    return float(n / (1.0 + 2.0 * acf[1:lag].sum()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["musk1", "digits"], choices=list(VARIANCE))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--n-samples", type=int, default=2000)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}, python {platform.python_version()}")
    print("| data | seed | fit s | split-R̂ median / 90 % / max | ESS ‖v‖ | ESS mean f | kept |")
    print("|---|---|---|---|---|---|---|")
    for dataset in args.datasets:
        _, train, _ = next(folds(dataset, 5, 1))
        for seed in args.seeds:
            model = VGPMILPRGibbs(kernel=RBF(VARIANCE[dataset]), n_samples=args.n_samples, random_state=seed)
            start = time.perf_counter()
            model.fit(train.X, train.bags, train.y)
            seconds = time.perf_counter() - start
            r = np.quantile(split_rhats(model.v_samples_), [0.5, 0.9, 1.0])
            mean_f = (model.gp_.whiten(train.X).A @ model.v_samples_.T).mean(axis=0)
            print(f"| {dataset} | {seed} | {seconds:.1f} | {r[0]:.3f} / {r[1]:.3f} / {r[2]:.3f} | "
                  f"{effective_sample_size(np.linalg.norm(model.v_samples_, axis=1)):.0f} | {effective_sample_size(mean_f):.0f} | "
                  f"{model.v_samples_.shape[0]} |", flush=True)


if __name__ == "__main__":
    main()
