"""How the automatic kernel choice should read its inner splits (issue 15): measured, not guessed.

For every outer fold of ``bench_accuracy.py`` (identical folds), each candidate variance of the model's
grid is fitted on the halves of ``--repeats`` seeded stratified 2-fold splits of the training bags
(scored every 5 sweeps up to 50 on the other half, as ``_select_kernel`` does) and, once, on all
training bags (scored on the test bags at the same checkpoints; the last one runs on to ``max_iter``,
as a choice of 50 sweeps does). Rules then pick a (variance, sweeps) point from the inner scores, and
the test AUC of that point is what the rule is worth. A rule that uses R repeats is scored on every
R-subset of the ``--repeats`` splits and averaged, so one lucky split does not decide the comparison.

Rules: ``mean`` (best mean of the per-half AUCs; ties: fewer sweeps, smaller v: ``best_candidate``),
``pooled`` (the AUC of both halves' held-out scores pooled, averaged over repeats) and ``half_se`` (of
the points within half a standard error of the best mean, the fewest sweeps, then the smallest v).

    python benchmarks/bench_kernel_choice.py --datasets cancer musk1 --methods vgpmil gvgpmil
"""

from __future__ import annotations

import argparse
import itertools
import sys
import warnings
from pathlib import Path

import numpy as np
from sklearn.base import clone
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_accuracy import folds  # noqa: E402

from mil_core import GVGPMIL, RBF, VGPMIL  # noqa: E402
from mil_core.bags import BagIndex  # noqa: E402
from mil_core.engine import BagBlock, SerialExecutor, optimise  # noqa: E402
from mil_core.models.base import best_candidate, take_bags  # noqa: E402

CHECKPOINTS = np.arange(5, 51, 5)
MODELS = {"vgpmil": VGPMIL, "gvgpmil": GVGPMIL}


def scores_along_sweeps(model, X, offsets, labels, X_val, val_offsets, max_iter: int) -> np.ndarray:
    """Bag scores of ``X_val`` at each checkpoint (the last: the end of the run), (checkpoints, bags)."""
    updates = model._start_fit(X, np.repeat(labels, np.diff(offsets)))
    executor = SerialExecutor(updates, [BagBlock(X=X, offsets=offsets, labels=labels)])
    seen: dict[int, np.ndarray] = {}

    def monitor(iteration, glob):
        if iteration in CHECKPOINTS[:-1]:
            seen[iteration] = model._bag_proba_from_state(model.gp_, glob, X_val, val_offsets)
        return False

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        trace = optimise(executor.sweep, updates, updates.init_global(), max_iter=max_iter, tol=model.tol, monitor=monitor)
    final = model._bag_proba_from_state(model.gp_, trace.glob, X_val, val_offsets)
    return np.array([seen.get(c, final) for c in CHECKPOINTS[:-1]] + [final])


def auc(y: np.ndarray, p: np.ndarray) -> float:
    return np.nan if not np.all(np.isfinite(p)) or np.ptp(p) == 0 else float(roc_auc_score(y, p))


def outer_fold(proto, train, test, repeats: int):
    """Per-half AUCs (repeats, 2, V, C), pooled AUCs (repeats, V, C) and test AUCs (V, C)."""
    index = BagIndex.from_ids(train.bags)
    X, offsets = train.X[index.order], index.offsets
    labels = train.y[index.order][offsets[:-1]]
    test_index = BagIndex.from_ids(test.bags)
    X_test, y_test = test.X[test_index.order], test.bag_labels()
    variances = proto._auto_variances()
    halves = np.full((repeats, 2, len(variances), CHECKPOINTS.size), np.nan)
    pooled = np.full((repeats, len(variances), CHECKPOINTS.size), np.nan)
    for r in range(repeats):
        held_out = np.full((len(variances), CHECKPOINTS.size, labels.size), np.nan)
        for k, (tr, va) in enumerate(StratifiedKFold(2, shuffle=True, random_state=r).split(labels, labels)):
            X_tr, tr_offsets = take_bags(X, offsets, tr)
            X_va, va_offsets = take_bags(X, offsets, va)
            y_tr = np.repeat(labels[tr], np.diff(tr_offsets))
            n_inducing = int(max(2, min(proto.n_inducing, 2 * min(np.sum(y_tr == 0), np.sum(y_tr == 1)))))
            for i, v in enumerate(variances):
                model = clone(proto).set_params(kernel=RBF(v), n_inducing=n_inducing)
                s = scores_along_sweeps(model, X_tr, tr_offsets, labels[tr], X_va, va_offsets, CHECKPOINTS[-1])
                held_out[i][:, va] = s
                halves[r, k, i] = [auc(labels[va], x) for x in s]
        pooled[r] = [[auc(labels, held_out[i, c]) for c in range(CHECKPOINTS.size)] for i in range(len(variances))]
    test_auc = np.array([[auc(y_test, x) for x in scores_along_sweeps(clone(proto).set_params(kernel=RBF(v)), X, offsets, labels,
                                                                         X_test, test_index.offsets, proto.max_iter)]
                         for v in variances])
    return variances, halves, pooled, test_auc


def pick(rule: str, variances, samples: np.ndarray) -> tuple[int, int]:
    """(variance index, checkpoint index) from AUC samples (n, V, C)."""
    if rule in ("mean", "pooled"):
        v, sweeps = best_candidate({v: samples[:, i] for i, v in enumerate(variances)}, CHECKPOINTS)
        return variances.index(v), int(np.flatnonzero(CHECKPOINTS == sweeps)[0])
    mean = samples.mean(axis=0)
    se = samples.std(axis=0, ddof=1) / np.sqrt(samples.shape[0])
    i, c = pick("mean", variances, samples)
    near = [(cc, ii) for ii in range(len(variances)) for cc in range(CHECKPOINTS.size)
            if np.all(np.isfinite(samples[:, ii, cc])) and mean[ii, cc] >= mean[i, c] - 0.5 * se[i, c] - 1e-12]
    c, i = min(near)
    return i, c


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["cancer", "musk1", "fox", "text", "digits"])
    parser.add_argument("--methods", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print("| data | method | oracle (best fixed point) | 1 split, mean | 3 splits, mean | 3 splits, pooled | 3 splits, half-SE |")
    print("|---|---|---|---|---|---|---|")
    for dataset in args.datasets:
        for method in args.methods:
            proto = MODELS[method](random_state=0)
            outer = [outer_fold(proto, train, test, args.repeats) for _, train, test in folds(dataset, 5, 1)]
            cells = [np.max(np.mean([o[3] for o in outer], axis=0))]
            for n_repeats, rule in ((1, "mean"), (3, "mean"), (3, "pooled"), (3, "half_se")):
                worth = []
                for variances, halves, pooled, test_auc in outer:
                    picks = []
                    for subset in itertools.combinations(range(args.repeats), n_repeats):
                        samples = pooled[list(subset)] if rule == "pooled" else halves[list(subset)].reshape(-1, *halves.shape[2:])
                        i, c = pick(rule, list(variances), samples)
                        picks.append(test_auc[i, c])
                    worth.append(np.mean(picks))
                cells.append(np.mean(worth))
            print(f"| {dataset} | {method} | " + " | ".join(f"{x:.3f}" for x in cells) + " |", flush=True)


if __name__ == "__main__":
    main()
