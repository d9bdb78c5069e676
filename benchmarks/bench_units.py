"""Held-out AUCs of ``bench_accuracy``'s methods with every feature in its own units: the same
folds, each column multiplied by its own scale (10⁻² … 10³, geometric) and shifted by 50 of those
units, not standardised. A model that standardises its input gives the standardised run's numbers.

    OMP_NUM_THREADS=1 python benchmarks/bench_units.py --datasets hastie --methods embedded_gpmil

Prints, per data set and method, the default rule's bag AUC (mean ± sd over folds) and the
instance AUC where the set has instance labels.
"""

from __future__ import annotations

import argparse
import platform
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
from sklearn.metrics import roc_auc_score

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_accuracy import METHODS, folds, primary_bag_auc  # noqa: E402


def in_own_units(X: np.ndarray) -> np.ndarray:
    units = np.geomspace(1e-2, 1e3, X.shape[1])
    return X * units + 50.0 * units


def held_out_aucs(method: str, dataset: str, n_splits: int, draws: int, cv_seed: int) -> tuple[list[float], list[float]]:
    bag_aucs, instance_aucs = [], []
    for _, train, test in folds(dataset, n_splits, draws, cv_seed, standardize=False):
        train, test = replace(train, X=in_own_units(train.X)), replace(test, X=in_own_units(test.X))
        prediction = METHODS[method](train, test)
        bag_aucs.append(primary_bag_auc(prediction, test))
        if prediction.instance is not None and test.instance_labels is not None:
            instance_aucs.append(float(roc_auc_score(test.instance_labels, prediction.instance)))
    return bag_aucs, instance_aucs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--datasets", nargs="+", default=["hastie"])
    parser.add_argument("--methods", nargs="+", default=["embedded_gpmil"], choices=sorted(METHODS))
    parser.add_argument("--splits", type=int, default=5)
    parser.add_argument("--draws", type=int, default=3)
    parser.add_argument("--cv-seed", type=int, default=0)
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, python {platform.python_version()}; columns in their own units, CV seed {args.cv_seed}")
    print("| data | method | bag AUC | instance AUC |\n|---|---|---|---|")
    for dataset in args.datasets:
        for method in args.methods:
            bag, instance = held_out_aucs(method, dataset, args.splits, args.draws, args.cv_seed)
            shown = f"{np.mean(instance):.3f}" if instance else "—"
            print(f"| {dataset} | {method} | {np.mean(bag):.3f} ± {np.std(bag):.3f} | {shown} |", flush=True)


if __name__ == "__main__":
    main()
