"""MUSK1/MUSK2 and digits-bags cross-validation for VGPMIL and G-VGPMIL (issue 2's evidence).

Stratified 5-fold CV over bags, features standardised per training fold, fixed kernel
(RBF, variance v, ℓ = √D), no hyper-parameter learning. Prints a Markdown table.

    python benchmarks/bench_logistic.py                       # full grid (~15 min on 2 cores)
    python benchmarks/bench_logistic.py --variance 5 --inducing 100 --rules max
"""

from __future__ import annotations

import argparse
import itertools
import platform
import time
from pathlib import Path

import numpy as np
from sklearn.datasets import load_digits

from mil_core import GVGPMIL, RBF, VGPMIL
from mil_core.model_selection import cross_validate_bags

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
MODELS = {"VGPMIL": VGPMIL, "GVGPMIL": GVGPMIL}


def load_musk(name: str):
    table = np.loadtxt(DATA / f"{name}.csv", delimiter=",")
    return table[:, 2:], table[:, 1].astype(int), table[:, 0].astype(int), None


def digits_bags(n_bags_per_class: int = 60, bag_size: int = 10, seed: int = 0):
    """Bags of 10 digits, positive iff they hold a 2 or a 9 (1–4 of them), balanced (seed 000, Sec. 6.1)."""
    rng = np.random.default_rng(seed)
    digits = load_digits()
    positive = np.isin(digits.target, (2, 9))
    pos_pool, neg_pool = list(rng.permutation(np.flatnonzero(positive))), list(rng.permutation(np.flatnonzero(~positive)))
    rows, bags, labels = [], [], []
    for b in range(2 * n_bags_per_class):
        n_pos = int(rng.integers(1, 5)) if b % 2 else 0
        members = [pos_pool.pop() for _ in range(n_pos)] + [neg_pool.pop() for _ in range(bag_size - n_pos)]
        rows += members
        bags += [b] * bag_size
        labels += [b % 2] * bag_size
    rows = np.array(rows)
    return digits.data[rows], np.array(bags), np.array(labels), positive[rows].astype(int)


def summarise(folds: list[dict[str, float]]) -> dict[str, str]:
    out = {}
    for key in folds[0]:
        values = np.array([f[key] for f in folds])
        out[key] = f"{values.mean():.3f} ± {values.std():.3f}" if key != "fit_time" else f"{values.mean():.1f}"
    return out


def run(dataset: str, model_name: str, variance: float, n_inducing: int, emax: str, rule: str, max_iter: int, folds: int):
    X, bags, y, instance_labels = digits_bags() if dataset == "digits" else load_musk(dataset)
    kernel = RBF(variance=variance)
    model = MODELS[model_name](n_inducing=n_inducing, kernel=kernel, emax=emax, max_iter=max_iter, random_state=0)
    results = cross_validate_bags(
        model, X, bags, y, instance_labels=instance_labels, n_splits=folds, predict_kwargs={"method": "probit", "rule": rule}
    )
    return summarise(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["musk1", "musk2", "digits"])
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--variance", nargs="+", type=float, default=[1.0], help="kernel variance v (ℓ = √D)")
    parser.add_argument("--inducing", nargs="+", type=int, default=[50, 100, 200])
    parser.add_argument("--emax", nargs="+", default=["exact", "max"])
    parser.add_argument("--rules", nargs="+", default=["noisy_or", "max"])
    parser.add_argument("--max-iter", type=int, default=100)
    parser.add_argument("--folds", type=int, default=5)
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}")
    header = ["bag_auc", "bag_accuracy", "bag_f1", "instance_auc", "instance_accuracy", "instance_f1", "fit_time"]
    print("| dataset | model | v | M | E[max] | bag rule | " + " | ".join(header) + " | wall s |")
    print("|" + "---|" * (len(header) + 7))
    grid = itertools.product(args.datasets, args.models, args.variance, args.inducing, args.emax, args.rules)
    for dataset, model, v, m, emax, rule in grid:
        start = time.perf_counter()
        row = run(dataset, model, v, m, emax, rule, args.max_iter, args.folds)
        cells = [row.get(k, "—") for k in header]
        print(f"| {dataset} | {model} | {v:g} | {m} | {emax} | {rule} | " + " | ".join(cells) + f" | {time.perf_counter() - start:.0f} |", flush=True)


if __name__ == "__main__":
    main()
