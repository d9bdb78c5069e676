"""EmbeddedGPMIL and the ABMIL baseline on the folds of ``bench_accuracy.py`` (issue 15). Needs the extra ``torch``.

Three tables from one set of fits (each method is fitted once per fold), all on bench_accuracy's
identical folds (stratified 5-fold CV over bags, CV seed 0 or ``--cv-seed``, features standardised on the training
fold, a column with std < 1e-12 left unscaled):

* bench_accuracy's rows for these methods (bag AUC per bag score, size correlation, instance AUC
  where instance labels are known, fit time);
* calibration: every bag is held out once; the held-out bag probabilities of all folds are
  pooled and scored by the expected calibration error (10 equal-width bins,
  :func:`mil_core.calibration.expected_calibration_error`), the Brier score and the reliability
  diagram's bins, before and after each method's Platt scaling. ``--figure PATH`` also draws the
  reliability diagrams (PNG);
* instance AUC of each instance score of the same fits (``EmbeddedGPMIL``: the default mixture of
  the networks and the GPs, and each alone), fold by fold.

    python benchmarks/bench_embedded.py --datasets musk1 musk2 digits --figure docs/figures/reliability_embedded.png

``--seed S`` refits every model with ``random_state=S`` on the same folds (network weights, bag
order, inner splits and the GPs' seeds change): how much of a difference between two designs is
the seed. ``--cv-seed C`` draws other folds (bench_accuracy's ``--cv-seeds``): how much is the split.

``EMBEDDED_METHODS`` (``abmil``, ``abmil_platt``, ``embedded_gpmil``; ``embedded_gpmil_n1`` (one
network), ``_n5``/``_n10`` (members), ``_e50`` (50 epochs, no early stopping), ``_d8`` and
``_d128``, ``_bag_loss`` (networks trained on the bag loss alone), ``_embedding``
(``representation="embedding"``: never the GPs on the input features), ``abmil_negative_instances`` on
request) have bench_accuracy's method signature; bench_accuracy's ``METHODS`` includes ``abmil``
and ``embedded_gpmil``. ``--draws N`` runs N large-bag draws.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import sys
from functools import partial
from pathlib import Path

import numpy as np
from scipy.special import expit, logit
from sklearn.metrics import roc_auc_score

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mil_core import ABMIL, EmbeddedGPMIL
from mil_core.calibration import expected_calibration_error, reliability_bins

GP_RULES = ("top_fraction", "max", "mean", "noisy_or")  # the GP's own bag rules
SEED = 0  # random_state of every fitted model (``--seed``: the same folds, other network weights, bag orders, inner splits)


def _uncalibrated(p: np.ndarray, model) -> np.ndarray:
    """``σ(s)`` from a Platt-calibrated ``σ(a s + c)``: the same score before calibration."""
    return expit((logit(p) - model.calibration_intercept_) / model.calibration_slope_)


def fit_predict_abmil(train, test, **params):
    """The ABMIL baseline (Ilse et al. 2018, gated attention), untuned: Adam lr 5e-4, weight decay
    5e-4, 50 epochs on all training bags. Instance scores: the network's classifier on each instance alone."""
    from bench_accuracy import Prediction

    model = ABMIL(random_state=SEED, **params).fit(train.X, train.bags, train.y)
    return Prediction({"own": model.predict_bag_proba(test.X, test.bags)[1]}, model.predict_instance_proba(test.X))


def fit_predict_abmil_platt(train, test):
    """``ABMIL(calibration="platt")``: the same untuned network trained on 80 % of the training bags,
    its bag logit Platt-scaled on the other 20 % (``own``; ``uncalibrated``: its sigmoid)."""
    from bench_accuracy import Prediction

    model = ABMIL(calibration="platt", random_state=SEED).fit(train.X, train.bags, train.y)
    p = model.predict_bag_proba(test.X, test.bags)[1]
    return Prediction({"own": p, "uncalibrated": _uncalibrated(p, model)}, model.predict_instance_proba(test.X),
                      {"a": model.calibration_slope_})


def fit_predict_embedded_gpmil(train, test, **params):
    """Default ``EmbeddedGPMIL()`` (seed 000 §6.3). ``default``: the calibrated average of the
    network's and the GP's bag evidence; ``uncalibrated``: the same before Platt scaling;
    ``attention``: the GP's probabilities pooled by the attention alone; ``network``: the
    network's own bag probability; then the GP's own bag rules on the same fit. Instance scores:
    the default mixture of the networks and the GPs, and the GPs' (``gp``) and the networks'
    (``network``) alone. A fit that kept the GP on the input features (``representation_``, printed
    to stderr with the two AUCs it compared) has no attention pooling: its ``attention`` row holds
    its default probabilities."""
    from bench_accuracy import Prediction

    model = EmbeddedGPMIL(random_state=SEED, **params).fit(train.X, train.bags, train.y)
    print(f"representation {model.representation_}: held-out AUC {model.representation_auc_}", file=sys.stderr, flush=True)
    p = model.predict_bag_proba(test.X, test.bags)[1]
    scores = {"default": p, "uncalibrated": _uncalibrated(p, model)}
    features = model.representation_ == "features"
    scores["attention"] = p if features else model.predict_bag_proba(test.X, test.bags, rule="attention")[1]
    scores["network"] = model.predict_bag_proba(test.X, test.bags, rule="network")[1]
    for rule in GP_RULES:
        scores[rule] = model.predict_bag_proba(test.X, test.bags, method="probit", rule=rule)[1]
    return Prediction(scores, model.predict_instance_proba(test.X, method="probit"),
                      {"v": float(np.median([gp.kernel_.variance for gp in model.gps_])),  # the members' median
                       "sweeps": float(np.median([gp.n_iter_ for gp in model.gps_])), "a": model.calibration_slope_},
                      {"gp": model.predict_instance_proba(test.X, rule="gp", method="probit"),
                       "network": model.predict_instance_proba(test.X, rule="network")})


EMBEDDED_METHODS = {"abmil": fit_predict_abmil, "abmil_platt": fit_predict_abmil_platt,
                    "embedded_gpmil": fit_predict_embedded_gpmil,
                    # on request, not default methods of a run: one network (session 7's default), 5 or 10 members,
                    # ABMIL's fixed 50 epochs instead of early stopping, the GPs on the embeddings always (session 22),
                    # seed 000's other embedding widths
                    "embedded_gpmil_n1": partial(fit_predict_embedded_gpmil, n_networks=1, early_stopping=True, max_epochs=100),
                    "embedded_gpmil_n5": partial(fit_predict_embedded_gpmil, n_networks=5, early_stopping=True, max_epochs=100),
                    "embedded_gpmil_n10": partial(fit_predict_embedded_gpmil, n_networks=10, early_stopping=True, max_epochs=100),
                    "embedded_gpmil_e50": partial(fit_predict_embedded_gpmil, early_stopping=False, max_epochs=50),
                    "embedded_gpmil_embedding": partial(fit_predict_embedded_gpmil, representation="embedding"),  # never X
                    "embedded_gpmil_d8": partial(fit_predict_embedded_gpmil, n_components=8),
                    "embedded_gpmil_d128": partial(fit_predict_embedded_gpmil, n_components=128),
                    # the networks trained on the bag loss alone (the default until session 11)
                    "embedded_gpmil_bag_loss": partial(fit_predict_embedded_gpmil, negative_instances=False),
                    # ABMIL with EmbeddedGPMIL's negative-instance loss: is the gain the network's or the GP's?
                    "abmil_negative_instances": partial(fit_predict_abmil, negative_instances=True)}
DEFAULT_METHODS = ["abmil", "abmil_platt", "embedded_gpmil"]


def _once(fit_predict):
    """``fit_predict`` remembering its prediction per (train, test) fold content, so the tables
    of one run share the fits."""
    cache = {}

    def wrapped(train, test):
        key = (hashlib.sha1(np.ascontiguousarray(train.X)).hexdigest(), hashlib.sha1(np.ascontiguousarray(test.X)).hexdigest())
        if key not in cache:
            cache[key] = fit_predict(train, test)
        return cache[key]

    return wrapped
CALIBRATION_ROWS = ("default", "own", "uncalibrated")  # bag scores whose calibration is reported


def calibration(methods: dict, datasets: list[str], n_splits: int, draws: int, figure: str | None, cv_seed: int = 0) -> None:
    from bench_accuracy import folds

    curves = {}
    print("| data | method | bag probability | bag AUC (fold mean) | bag AUC (pooled) | ECE | Brier | instance AUC | "
          "reliability bins (n, mean p, positive fraction) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dataset in datasets:
        for name, fit_predict in methods.items():
            probs, truth, fold_auc, instance_auc = {}, [], {}, []
            for _, train, test in folds(dataset, n_splits, draws, cv_seed):
                prediction = fit_predict(train, test)
                truth.append(test.bag_labels())
                for key in CALIBRATION_ROWS:
                    if key in prediction.bag:
                        probs.setdefault(key, []).append(prediction.bag[key])
                        fold_auc.setdefault(key, []).append(roc_auc_score(truth[-1], prediction.bag[key]))
                if prediction.instance is not None and test.instance_labels is not None:
                    instance_auc.append(roc_auc_score(test.instance_labels, prediction.instance))
            y = np.concatenate(truth)
            inst = f"{np.mean(instance_auc):.3f}" if instance_auc else "—"
            for key, parts in probs.items():
                p = np.concatenate(parts)
                bins = reliability_bins(p, y)
                curves[(dataset, name, key)] = bins
                cells = "; ".join(f"{n}, {c:.2f}, {a:.2f}" for n, c, a in bins)
                print(f"| {dataset} | {name} | {key} | {np.mean(fold_auc[key]):.3f} | {roc_auc_score(y, p):.3f} | "
                      f"{expected_calibration_error(p, y):.3f} | {np.mean((p - y) ** 2):.3f} | {inst} | {cells} |", flush=True)
    if figure:
        plot_reliability(curves, datasets, figure)


def instance_rules(methods: dict, datasets: list[str], n_splits: int, draws: int, cv_seed: int = 0) -> None:
    """Instance AUC (fold mean, and per fold) of each method's instance scores: its default and the
    other instance scores of the same fits (``Prediction.instance_rules``), where instance labels are known."""
    from bench_accuracy import folds

    print("| data | method | instance score | instance AUC (fold mean) | per fold |")
    print("|---|---|---|---|---|")
    for dataset in datasets:
        for name, fit_predict in methods.items():
            aucs: dict[str, list[float]] = {}
            for _, train, test in folds(dataset, n_splits, draws, cv_seed):
                prediction = fit_predict(train, test)
                if prediction.instance is None or test.instance_labels is None:
                    break
                for rule, scores in {"default": prediction.instance, **prediction.instance_rules}.items():
                    aucs.setdefault(rule, []).append(roc_auc_score(test.instance_labels, scores))
            for rule, values in aucs.items():
                print(f"| {dataset} | {name} | {rule} | {np.mean(values):.3f} | {' / '.join(f'{v:.3f}' for v in values)} |",
                      flush=True)


def plot_reliability(curves: dict, datasets: list[str], path: str) -> None:
    """One panel per data set: positive fraction against mean probability per bin (marker area ∝ bag count)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(datasets), figsize=(4.2 * len(datasets), 4.2), squeeze=False)
    for ax, dataset in zip(axes[0], datasets, strict=True):
        ax.plot([0, 1], [0, 1], color="0.6", lw=1, ls="--")
        for (d, name, key), bins in curves.items():
            if d != dataset:
                continue
            n, mean, fraction = (np.array(column) for column in zip(*bins, strict=True))
            line, = ax.plot(mean, fraction, marker="", lw=1.2, label=f"{name} ({key})")
            ax.scatter(mean, fraction, s=8 + 2 * n, color=line.get_color(), alpha=0.6)
        ax.set(title=dataset, xlabel="mean predicted bag probability", ylabel="fraction of positive bags", xlim=(0, 1), ylim=(0, 1))
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["musk1", "musk2", "digits"])
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS, choices=list(EMBEDDED_METHODS))
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--figure", help="also save the reliability diagrams to this PNG")
    parser.add_argument("--draws", type=int, default=1, help="large-bag draws, each its own 20/20 split of 40 bags")
    parser.add_argument("--seed", type=int, default=0, help="random_state of every model (the folds stay those of --cv-seed)")
    parser.add_argument("--cv-seed", type=int, default=0, help="shuffles bench_accuracy's stratified split (its --cv-seeds)")
    args = parser.parse_args()
    global SEED
    SEED = args.seed
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, OMP_NUM_THREADS={threads}, "
          f"python {platform.python_version()}, model seed {SEED}, CV seed {args.cv_seed}")
    import bench_accuracy

    methods = {m: _once(EMBEDDED_METHODS[m]) for m in args.methods}
    bench_accuracy.METHODS.update(methods)
    bench_accuracy.print_table(list(methods), args.datasets, args.folds, args.draws, (args.cv_seed,))
    print()
    calibration(methods, args.datasets, args.folds, args.draws, args.figure, args.cv_seed)
    print()
    instance_rules(methods, args.datasets, args.folds, args.draws, args.cv_seed)


if __name__ == "__main__":
    main()
