"""EmbeddedGPMIL and the ABMIL baseline on the folds of ``bench_accuracy.py`` (issue 15). Needs the extra ``torch``.

Two tables, both on bench_accuracy's identical folds (stratified 5-fold CV over bags, seed 0,
features standardised on the training fold, a column with std < 1e-12 left unscaled):

* ``--table``: bench_accuracy's rows for these methods (bag AUC per bag rule, size correlation,
  instance AUC where instance labels are known, fit time);
* default: calibration. Every bag is held out once; the held-out bag probabilities of all folds
  are pooled and scored by the expected calibration error (10 equal-width bins,
  ``ECE = Σ_k n_k/n |positive fraction_k − mean p_k|``), the Brier score and the reliability
  diagram's bins, plus the instance AUC on digits bags.

    python benchmarks/bench_embedded.py --table --datasets musk1 musk2 digits
    python benchmarks/bench_embedded.py --datasets digits musk1 musk2

``fit_predict_abmil`` and ``fit_predict_embedded_gpmil`` have bench_accuracy's method signature;
``EMBEDDED_METHODS`` can be added to its ``METHODS``.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

import numpy as np
from sklearn.metrics import roc_auc_score

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mil_core import ABMIL, EmbeddedGPMIL
from mil_core.bags import BagIndex

RULES = ("top_fraction", "max", "mean", "noisy_or")  # the GP's own bag rules, beside the attention rule


def fit_predict_abmil(train, test):
    """The ABMIL baseline (Ilse et al. 2018, gated attention), untuned: Adam lr 5e-4, weight decay
    5e-4, 50 epochs. Instance scores: the network's classifier on each instance alone."""
    from bench_accuracy import Prediction

    model = ABMIL(random_state=0).fit(train.X, train.bags, train.y)
    return Prediction({"own": model.predict_bag_proba(test.X, test.bags)[1]}, model.predict_instance_proba(test.X))


def fit_predict_embedded_gpmil(train, test):
    """Default ``EmbeddedGPMIL()`` (seed 000 §6.3): the GP's instance probabilities pooled by the
    network's attention (its default rule, ``default``) and by the GP's own bag rules."""
    from bench_accuracy import Prediction

    model = EmbeddedGPMIL(random_state=0).fit(train.X, train.bags, train.y)
    scores = {"default": model.predict_bag_proba(test.X, test.bags, method="probit")[1]}
    for rule in RULES:
        scores[rule] = model.predict_bag_proba(test.X, test.bags, method="probit", rule=rule)[1]
    return Prediction(scores, model.predict_instance_proba(test.X, method="probit"),
                      {"v": model.gp_.kernel_.variance, "sweeps": model.gp_.n_iter_})


EMBEDDED_METHODS = {"abmil": fit_predict_abmil, "embedded_gpmil": fit_predict_embedded_gpmil}


def reliability(p: np.ndarray, y: np.ndarray, n_bins: int = 10) -> tuple[float, list[tuple[int, float, float]]]:
    """ECE over ``n_bins`` equal-width bins and the non-empty bins' ``(count, mean p, positive fraction)``."""
    bins = np.minimum((p * n_bins).astype(int), n_bins - 1)
    rows, ece = [], 0.0
    for k in range(n_bins):
        inside = bins == k
        if inside.any():
            rows.append((int(inside.sum()), float(p[inside].mean()), float(y[inside].mean())))
            ece += inside.mean() * abs(p[inside].mean() - y[inside].mean())
    return float(ece), rows


def calibration(methods: dict, datasets: list[str], n_splits: int) -> None:
    from bench_accuracy import folds

    print("| data | method | bag AUC (pooled) | ECE | Brier | instance AUC | reliability bins (n, mean p, positive fraction) |")
    print("|---|---|---|---|---|---|---|")
    for dataset in datasets:
        for name, fit_predict in methods.items():
            probs, truth, instance_auc = [], [], []
            for _, train, test in folds(dataset, n_splits, 1):
                prediction = fit_predict(train, test)
                index = BagIndex.from_ids(test.bags)
                probs.append(prediction.bag.get("default", prediction.bag.get("own")))
                truth.append(test.y[index.order][index.offsets[:-1]])
                if prediction.instance is not None and test.instance_labels is not None:
                    instance_auc.append(roc_auc_score(test.instance_labels, prediction.instance))
            p, y = np.concatenate(probs), np.concatenate(truth)
            ece, rows = reliability(p, y)
            bins = "; ".join(f"{n}, {c:.2f}, {a:.2f}" for n, c, a in rows)
            inst = f"{np.mean(instance_auc):.3f}" if instance_auc else "—"
            print(f"| {dataset} | {name} | {roc_auc_score(y, p):.3f} | {ece:.3f} | {np.mean((p - y) ** 2):.3f} | {inst} | {bins} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["musk1", "musk2", "digits"])
    parser.add_argument("--methods", nargs="+", default=list(EMBEDDED_METHODS), choices=list(EMBEDDED_METHODS))
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--table", action="store_true", help="bench_accuracy's table for these methods instead of calibration")
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, python {platform.python_version()}")
    methods = {m: EMBEDDED_METHODS[m] for m in args.methods}
    if not args.table:
        calibration(methods, args.datasets, args.folds)
        return
    import bench_accuracy

    bench_accuracy.METHODS.update(methods)
    bench_accuracy.print_table(list(methods), args.datasets, args.folds, 1)


if __name__ == "__main__":
    main()
