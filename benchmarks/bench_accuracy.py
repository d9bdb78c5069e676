"""Held-out accuracy of the default models against a [mean, max] logistic regression (issue 15).

Every method sees identical folds: stratified 5-fold CV over bags (seed 0; ``--cv-seeds`` repeats it) on MUSK1, MUSK2,
digits bags and the robustness sets ``cancer``, ``text``, ``fox`` (:func:`robustness_set`); on the large-bag set (WSI regime: 1,000–10,000 instances per bag, 0.1–5 % positive
instances) one half of the bags trains and the other half tests, for several draws. Features are
standardised on the training fold (a column with std < 1e-12 is left unscaled; ``--raw-features``:
in their own units, as the public files hold them). Reported per
method (and, for instance-level models, per bag rule): bag AUC, instance AUC where instance labels
are known, the Spearman correlation of bag score with bag size *within* each class (averaged over
the two classes; 0 is what a rule that does not follow size gets), and fit time.

Adding a method: write ``def fit_predict_<name>(train: Fold, test: Fold) -> Prediction`` and add
it to ``METHODS``; it gets standardised features (raw with ``--raw-features``) and returns bag scores in ``np.unique`` order.

    python benchmarks/bench_accuracy.py                           # everything (~1 h on 2 busy cores)
    python benchmarks/bench_accuracy.py --datasets musk1 --methods lr_mean_max vgpmil
    python benchmarks/bench_accuracy.py --elbo-trace --figure docs/figures/elbo_h1e12.png   # convergence with H = 1e12
    python benchmarks/bench_accuracy.py --reference /tmp/vgpmil   # adds the public 2017 code as a method
    python benchmarks/bench_accuracy.py --datasets cancer fox --methods vgpmil_2017 vgpmil --reference /tmp/vgpmil \
        --cv-seeds 0 1 2 --paired-to vgpmil_2017   # 3 CV seeds; paired Δ to the 2017 code ± s.e.
    python benchmarks/bench_accuracy.py --datasets digits text --label-noise 0.2   # a fifth of the training labels wrong
    python benchmarks/bench_accuracy.py --datasets musk1 cancer --raw-features   # features in their own units

``--reference`` points at a checkout of github.com/manuelhaussmann/vgpmil (never copied into this
repository) and adds the method ``vgpmil_2017``: that code with its own defaults (50 inducing points by
its OpenCV k-means, 10 iterations, H = 1e12, its normalisation) and the RBF kernel of the paper
(v = 1, ℓ = √D); bag score = the max of its instance predictions (the paper's MIL rule). Without
OpenCV importable, it gets our k-means inducing points (the table says which).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy.stats import spearmanr
from sklearn.datasets import (load_breast_cancer, load_diabetes, load_digits, load_wine, make_classification, make_hastie_10_2,
                              make_moons, make_multilabel_classification)
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_embedded import EMBEDDED_METHODS  # noqa: E402
from bench_logistic import digits_bags, load_musk  # noqa: E402  (one home for the small sets)
from bench_reference_vgpmil import load_reference  # noqa: E402

from mil_core import GVGPMIL, RBF, VGPMIL, VGPMILPR, VWSGP, VGPMILPRGibbs  # noqa: E402
from mil_core.bags import BAG_RULES, BagIndex, bag_score  # noqa: E402
from mil_core.engine import BagBlock, SerialExecutor  # noqa: E402
from mil_core.inducing import kmeans_inducing_points  # noqa: E402
from mil_core.models.probit import PROBIT_BAG_RULES  # noqa: E402
from mil_core.validation import standardisation, standardise as standardise_with  # noqa: E402

@dataclass(frozen=True)
class Fold:
    """Standardised instances of whole bags; ``instance_labels`` only where known (never used to fit)."""

    X: np.ndarray
    bags: np.ndarray
    y: np.ndarray
    instance_labels: np.ndarray | None = None

    def bag_labels(self) -> np.ndarray:
        """Each bag's label, in ``np.unique(bags)`` order (the order of every bag score)."""
        index = BagIndex.from_ids(self.bags)
        return self.y[index.order][index.offsets[:-1]]


@dataclass
class Prediction:
    """Bag scores (``np.unique(bags)`` order) per bag rule, and instance scores when the model has them."""

    bag: dict[str, np.ndarray]
    instance: np.ndarray | None = None
    extra: dict[str, float] = field(default_factory=dict)
    instance_rules: dict[str, np.ndarray] = field(default_factory=dict)  # other instance scores of the same fit


# ---------------------------------------------------------------------------------- data
def large_bags(seed: int, n_bags: int = 40, size_range=(1000, 10000), fraction_range=(0.001, 0.05), positive_digit: int = 9):
    """Digits drawn with replacement plus N(0, 2²) pixel noise; bag sizes log-uniform in
    ``size_range``; a positive bag holds a log-uniform fraction (≥ 1 instance) of the digit
    ``positive_digit``. Labels alternate, so bag size carries no label information."""
    rng = np.random.default_rng(seed)
    digits = load_digits()
    positive, negative = np.flatnonzero(digits.target == positive_digit), np.flatnonzero(digits.target != positive_digit)
    X, bags, y, inst = [], [], [], []
    for b in range(n_bags):
        n = int(np.exp(rng.uniform(*np.log(size_range))))
        label = b % 2
        k = max(1, int(round(n * np.exp(rng.uniform(*np.log(fraction_range)))))) if label else 0
        rows = np.r_[rng.choice(positive, k), rng.choice(negative, n - k)]
        X.append(digits.data[rows] + 2.0 * rng.standard_normal((n, digits.data.shape[1])))
        bags.append(np.full(n, b))
        y.append(np.full(n, label))
        inst.append(np.r_[np.ones(k, int), np.zeros(n - k, int)])
    return np.concatenate(X), np.concatenate(bags), np.concatenate(y), np.concatenate(inst)


def pool_bags(X: np.ndarray, witness: np.ndarray, seed: int, n_bags: int, size_range: tuple[int, int],
              max_witness_fraction: float, negative_size_range: tuple[int, int] | None = None,
              min_witness_fraction: float = 0.0, positive_fraction: float | None = None,
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Bags drawn without replacement from a pool of instances with known labels ``witness``: sizes
    uniform in ``size_range`` (a negative bag's in ``negative_size_range`` if given), labels
    alternating (or ``positive_fraction`` of the bags positive, at random positions); a positive bag
    of n holds ``max(1, ⌊min_witness_fraction·n⌋)`` to ``max(1, ⌊max_witness_fraction·n⌋)``
    witnesses, a negative bag none."""
    rng = np.random.default_rng(seed)
    pos, neg = list(rng.permutation(np.flatnonzero(witness))), list(rng.permutation(np.flatnonzero(~witness)))
    labels = np.arange(n_bags) % 2
    if positive_fraction is not None:
        labels = np.zeros(n_bags, dtype=int)
        labels[rng.permutation(n_bags)[: round(positive_fraction * n_bags)]] = 1
    rows, bags, y = [], [], []
    for b in range(n_bags):
        low, high = negative_size_range if negative_size_range is not None and not labels[b] else size_range
        n = int(rng.integers(low, high + 1))
        k = 0
        if labels[b]:
            k = int(rng.integers(max(1, int(min_witness_fraction * n)), max(1, int(max_witness_fraction * n)) + 1))
        if len(pos) < k or len(neg) < n - k:
            raise ValueError(f"pool too small for {n_bags} bags of {size_range} instances")
        rows += [pos.pop() for _ in range(k)] + [neg.pop() for _ in range(n - k)]
        bags += [b] * n
        y += [int(labels[b])] * n
    rows = np.asarray(rows)
    return X[rows].astype(np.float64), np.asarray(bags), np.asarray(y), witness[rows].astype(int)


def robustness_set(name: str):
    """Sets built offline that the defaults were not chosen on (checks against tuning to MUSK):

    * ``cancer``: sklearn's breast-cancer table (30 features) in bags of 2–10, a positive bag holding
      1 to half its instances malignant (Elephant/Fox/Tiger-like bag sizes);
    * ``text``: log(1 + bag-of-words counts) (``make_multilabel_classification``, 300 words, 4
      topics) in bags of 8–30 passages; a witness is a passage about topic 0, 1–4 per positive bag
      (5 % of all instances), the sparse low-witness regime of text MIL;
    * ``fox``: 230 dense features of which 10 are informative, 10 % label noise (Fox-like: hard,
      noisy) in bags of 2–13, up to half witnesses;
    * ``hastie`` (held out, :data:`HELD_OUT_SETS`): ``make_hastie_10_2`` (a witness lies outside a
      10-d sphere, no linear direction separates it) plus 20 noise features, bags of 5–25 with up to
      a fifth witnesses;
    * ``wine`` (held out): sklearn's wine table (13 features), a witness is a cultivar-3 wine, bags
      of 2–6 with up to half witnesses; 36 bags (the table is small), the small-sample regime;
    * ``sizes`` (held out, added in session 14): bag size *anti*-predictive — digits with N(0, 4²)
      pixel noise, a witness is a 9; positive bags of 4–12 instances with up to a fifth witnesses,
      negative bags of 16–24 (every negative bag larger than every positive one): a bag score that
      grows with the bag's size ranks the negatives first;
    * three held out, added in session 16 and run once on the code of that day: ``imbalanced`` — a
      quarter of 120 bags positive (5–30 instances, both classes alike), up to 30 % witnesses of a
      5-informative ``make_classification`` (20 features); ``highdim`` — 768 features with the
      signal in 8 (a foundation-model embedding's regime), bags of 10–40, up to a fifth witnesses;
      ``dense`` — positive bags of 10–30 that are 30–100 % witnesses (a bleed across many CT
      slices), 30 features, 5 % label noise;
    * two held out, added in session 21 and run once, with no model change after: ``diabetes`` —
      sklearn's diabetes table (10 features, 442 patients), a witness is a patient whose disease
      progression is in the top quarter, bags of 2–8 with up to half witnesses (a weak signal in a
      small real table); ``moons`` — two interleaved half-moons (``make_moons``, noise 0.3) plus 18
      noise features, a witness is on the second moon, bags of 5–20 with up to a fifth witnesses;
    * four held out, generated by :func:`generated_set`, added in session 30 and run once.
    """
    if name in GENERATED_SETS:
        return generated_set(name)
    if name == "cancer":
        data = load_breast_cancer()
        return pool_bags(data.data, data.target == 0, 0, 60, (2, 10), 0.5)
    if name == "text":
        X, Y = make_multilabel_classification(4000, n_features=300, n_classes=4, n_labels=1, length=100,
                                              allow_unlabeled=True, random_state=0)
        return pool_bags(np.log1p(X), Y[:, 0] == 1, 0, 100, (8, 30), 0.15)
    if name == "fox":
        X, t = make_classification(2000, n_features=230, n_informative=10, n_redundant=10, flip_y=0.1,
                                   class_sep=0.8, weights=[0.7], random_state=0)
        return pool_bags(X, t == 1, 0, 200, (2, 13), 0.5)
    if name == "hastie":
        X, t = make_hastie_10_2(6000, random_state=0)  # t = 1 iff Σx² > 9.34: a shell, no linear witness
        X = np.hstack([X, np.random.default_rng(0).standard_normal((X.shape[0], 20))])  # 20 pure-noise features
        return pool_bags(X, t == 1, 0, 150, (5, 25), 0.2)
    if name == "wine":
        data = load_wine()
        return pool_bags(data.data, data.target == 2, 0, 36, (2, 6), 0.5)
    if name == "sizes":
        data = load_digits()
        noisy = data.data + 4.0 * np.random.default_rng(0).standard_normal(data.data.shape)
        return pool_bags(noisy, data.target == 9, 0, 90, (4, 12), 0.2, negative_size_range=(16, 24))
    if name == "imbalanced":
        X, t = make_classification(5000, n_features=20, n_informative=5, class_sep=1.0, weights=[0.8], random_state=1)
        return pool_bags(X, t == 1, 1, 120, (5, 30), 0.3, positive_fraction=0.25)
    if name == "highdim":
        X, t = make_classification(4000, n_features=768, n_informative=8, n_redundant=0, class_sep=1.5, weights=[0.8],
                                   random_state=2)
        return pool_bags(X, t == 1, 2, 100, (10, 40), 0.2, positive_fraction=0.5)
    if name == "dense":
        X, t = make_classification(5000, n_features=30, n_informative=6, class_sep=0.6, flip_y=0.05, weights=[0.6],
                                   random_state=3)
        return pool_bags(X, t == 1, 3, 100, (10, 30), 1.0, min_witness_fraction=0.3, positive_fraction=0.5)
    if name == "diabetes":
        data = load_diabetes()
        return pool_bags(data.data, data.target >= np.quantile(data.target, 0.75), 4, 60, (2, 8), 0.5)
    if name == "moons":
        X, t = make_moons(4000, noise=0.3, random_state=5)
        X = np.hstack([X, np.random.default_rng(5).standard_normal((X.shape[0], 18))])
        return pool_bags(X, t == 1, 5, 150, (5, 20), 0.2)
    raise ValueError(f"unknown data set {name!r}")


def _generated_bags(rng: np.random.Generator, n_bags: int, size_range: tuple[int, int], witness_range: tuple[float, float],
                    positive_fraction: float, make: Callable[[np.ndarray, int], np.ndarray]):
    """Bags of a size uniform in ``size_range``, positive with probability ``positive_fraction`` (the
    first two bags negative and positive); a positive bag of n holds ``max(1, round(n·u))`` witnesses,
    u uniform in ``witness_range``; ``make(witness, label)`` draws the bag's instances."""
    X, bags, y, inst = [], [], [], []
    labels = (rng.random(n_bags) < positive_fraction).astype(int)
    labels[:2] = [0, 1]
    for b, label in enumerate(labels):
        n = int(rng.integers(*size_range))
        k = max(1, int(round(n * rng.uniform(*witness_range)))) if label else 0
        witness = np.r_[np.ones(k, int), np.zeros(n - k, int)]
        X.append(make(witness, label))
        bags.append(np.full(n, b))
        y.append(np.full(n, label))
        inst.append(witness)
    return np.concatenate(X), np.concatenate(bags), np.concatenate(y), np.concatenate(inst)


def generated_set(name: str):
    """Held-out sets from generators (session 30), for regimes the other sets leave out:

    * ``lowrank``: 256 correlated features from 8 factors plus noise (a foundation-model embedding's
      regime); a witness has its first factor above 1.5, every other instance at most 1.5; 100 bags
      of 20–59, 2–20 % witnesses;
    * ``heavytail``: 20 log-normal raw features whose logs carry the signal (+1.5 on 3 of them),
      standardised as they are, so outliers dominate a distance; 100 bags of 5–24, 5–30 % witnesses;
    * ``collective``: no witnesses — every instance of a positive bag is shifted by 0.4 in 5 of 30
      dimensions (the standard MIL assumption does not hold; no instance labels); 100 bags of 10–29;
    * ``rare``: digits with N(0, 2²) pixel noise, a witness is a 3; 150 bags of 50–199, each positive
      with probability ⅕ (28 are), 1–3 % witnesses (rare witnesses in rare positive bags).
    """
    rng = np.random.default_rng(0)
    if name == "lowrank":
        W = rng.standard_normal((8, 256))

        def make(w, label):
            z = rng.standard_normal((w.size, 8))
            z[w == 1, 0] = 1.5 + np.abs(rng.standard_normal((w == 1).sum()))
            z[w == 0, 0] = np.minimum(z[w == 0, 0], 1.5)
            return z @ W + 0.3 * rng.standard_normal((w.size, 256))
        return _generated_bags(rng, 100, (20, 60), (0.02, 0.2), 0.5, make)
    if name == "heavytail":
        def make(w, label):
            z = rng.standard_normal((w.size, 20))
            z[w == 1, :3] += 1.5
            return np.exp(z)
        return _generated_bags(rng, 100, (5, 25), (0.05, 0.3), 0.5, make)
    if name == "collective":
        def make(w, label):
            x = rng.standard_normal((w.size, 30))
            x[:, :5] += 0.4 * label
            return x
        X, bags, y, _ = _generated_bags(rng, 100, (10, 30), (0, 0), 0.5, make)
        return X, bags, y, None
    if name == "rare":
        digits = load_digits()
        positive, negative = np.flatnonzero(digits.target == 3), np.flatnonzero(digits.target != 3)

        def make(w, label):
            rows = np.where(w == 1, rng.choice(positive, w.size), rng.choice(negative, w.size))
            return digits.data[rows] + 2.0 * rng.standard_normal((w.size, 64))
        return _generated_bags(rng, 150, (50, 200), (0.01, 0.03), 0.2, make)
    raise ValueError(f"unknown data set {name!r}")


GENERATED_SETS = ("lowrank", "heavytail", "collective", "rare")
ROBUSTNESS_SETS = ("cancer", "text", "fox", "hastie", "wine", "sizes", "imbalanced", "highdim", "dense", "diabetes", "moons",
                   *GENERATED_SETS)
HELD_OUT_SETS = ("hastie", "wine", "sizes", "imbalanced", "highdim", "dense", "diabetes", "moons", *GENERATED_SETS)
"""Added in session 8 and not looked at while the defaults' choice rule was chosen (reported once,
at the end): ``hastie`` (a non-linear witness among noise features) and ``wine`` (a very small real
table); ``sizes`` (bag size anti-predictive) added in session 14 and run once before any model change;
``imbalanced``, ``highdim``, ``dense`` added in session 16 and run once, with no model change after;
``diabetes`` and ``moons`` added in session 21 and run once; the four of :func:`generated_set` added in
session 30 and run once, with no model change after."""


def standardise(train: np.ndarray, test: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean, scale = standardisation(train)
    return standardise_with(train, mean, scale), standardise_with(test, mean, scale)


def folds(dataset: str, n_splits: int, draws: int, cv_seed: int = 0, standardize: bool = True) -> Iterator[tuple[str, Fold, Fold]]:
    """``(fold name, train, test)``, identical for every method; ``cv_seed`` shuffles the stratified
    split (the large-bag set's repetitions are its ``draws``, so it ignores the seed); without
    ``standardize`` the features stay in their own units (``--raw-features``)."""
    if dataset == "large":
        for seed in range(draws):
            X, bags, y, inst = large_bags(seed)
            train = bags < bags.max() // 2 + 1
            yield from [(f"draw {seed}", *_pair(X, bags, y, inst, train, ~train, standardize))]
        return
    if dataset in ROBUSTNESS_SETS:
        X, bags, y, inst = robustness_set(dataset)
    else:
        X, bags, y, inst = digits_bags() if dataset == "digits" else load_musk(dataset)
    yield from stratified_folds(X, bags, y, inst, n_splits, cv_seed, standardize)


def stratified_folds(X: np.ndarray, bags: np.ndarray, y: np.ndarray, inst: np.ndarray | None, n_splits: int,
                     cv_seed: int, standardize: bool = True) -> Iterator[tuple[str, Fold, Fold]]:
    """``(fold name, train, test)`` of a stratified ``n_splits``-fold CV over the bags of any set."""
    keys, first = np.unique(bags, return_index=True)
    splitter = StratifiedKFold(n_splits, shuffle=True, random_state=cv_seed)
    for i, (tr, te) in enumerate(splitter.split(keys, y[first])):
        yield f"fold {i}", *_pair(X, bags, y, inst, np.isin(bags, keys[tr]), np.isin(bags, keys[te]), standardize)


def _pair(X, bags, y, inst, train, test, standardize: bool = True) -> tuple[Fold, Fold]:
    X_train, X_test = standardise(X[train], X[test]) if standardize else (X[train], X[test])
    labels = (lambda rows: None) if inst is None else (lambda rows: inst[rows])
    return Fold(X_train, bags[train], y[train], labels(train)), Fold(X_test, bags[test], y[test], labels(test))


# ------------------------------------------------------------------------------- methods
def fit_predict_lr_mean_max(train: Fold, test: Fold) -> Prediction:
    """Logistic regression on per-bag [mean, max] embeddings (standardised on the training bags)."""

    def embed(fold: Fold) -> np.ndarray:
        index = BagIndex.from_ids(fold.bags)
        X = fold.X[index.order]
        sizes = index.sizes[:, None]
        return np.hstack([np.add.reduceat(X, index.offsets[:-1]) / sizes, np.maximum.reduceat(X, index.offsets[:-1])])

    E_train, E_test = standardise(embed(train), embed(test))
    model = LogisticRegression(max_iter=5000).fit(E_train, train.bag_labels())
    return Prediction({"own": model.predict_proba(E_test)[:, 1]})


def _report_rule(model) -> None:
    """Which rule ``bag_rule="auto"`` (and which H ``H="auto"``) chose, on stderr (the tables
    report every rule)."""
    if model.bag_rule == "auto":
        print(f"# {type(model).__name__}(bag_rule='auto') chose {model.bag_rule_}", file=sys.stderr, flush=True)
    if getattr(model, "H", None) == "auto":
        print(f"# {type(model).__name__}(H='auto') chose {model.H_:g}", file=sys.stderr, flush=True)


def _logistic_gp(model) -> Callable[[Fold, Fold], Prediction]:
    def fit_predict(train: Fold, test: Fold) -> Prediction:
        model.fit(train.X, train.bags, train.y)
        _report_rule(model)
        scores = {"default": model.predict_bag_proba(test.X, test.bags, method="probit")[1]}
        for rule in BAG_RULES:
            scores[rule] = model.predict_bag_proba(test.X, test.bags, method="probit", rule=rule)[1]
        extra = {"v": model.kernel_.variance, "sweeps": model.n_iter_}
        return Prediction(scores, model.predict_instance_proba(test.X, method="probit"), extra)

    return fit_predict


def fit_predict_vgpmil(train: Fold, test: Fold) -> Prediction:
    """Default ``VGPMIL()``."""
    return _logistic_gp(VGPMIL(random_state=0))(train, test)


def fit_predict_vgpmil_ard(train: Fold, test: Fold) -> Prediction:
    """``VGPMIL`` with one length scale per feature learnt by the ELBO (``learn_kernel``; ℓ_d from
    √D, v from 4): the recipe for many features of which few carry the signal."""
    return _logistic_gp(VGPMIL(kernel=RBF(variance=4.0, length_scale="ard"), learn_kernel=True, random_state=0))(train, test)


def fit_predict_gvgpmil(train: Fold, test: Fold) -> Prediction:
    """Default ``GVGPMIL()``."""
    return _logistic_gp(GVGPMIL(random_state=0))(train, test)


def fit_predict_gvgpmil_h100(train: Fold, test: Fold) -> Prediction:
    """``GVGPMIL(H=100)``: the default until session 18 (``docs/BENCHMARKS.md``, "The bag likelihood's H")."""
    return _logistic_gp(GVGPMIL(H=100.0, random_state=0))(train, test)


def fit_predict_vgpmil_h100(train: Fold, test: Fold) -> Prediction:
    """``VGPMIL(H=100)``: the default until session 19, when ``H="auto"`` replaced it
    (``docs/BENCHMARKS.md``, "The bag likelihood's H")."""
    return _logistic_gp(VGPMIL(H=100.0, random_state=0))(train, test)


def fit_predict_vgpmil_h1e12(train: Fold, test: Fold) -> Prediction:
    """``VGPMIL(H=1e12)``: the paper's H, measured against H = 100 and not adopted alone."""
    return _logistic_gp(VGPMIL(H=1e12, random_state=0))(train, test)


def fit_predict_vgpmil_top_fraction(train: Fold, test: Fold) -> Prediction:
    """``VGPMIL(bag_rule="top_fraction")``: the default until session 14, without the rule guard."""
    return _logistic_gp(VGPMIL(bag_rule="top_fraction", random_state=0))(train, test)


def fit_predict_gvgpmil_top_fraction(train: Fold, test: Fold) -> Prediction:
    """``GVGPMIL(bag_rule="top_fraction")``: the default until session 14."""
    return _logistic_gp(GVGPMIL(bag_rule="top_fraction", random_state=0))(train, test)


def fit_predict_vgpmil_v1(train: Fold, test: Fold) -> Prediction:
    """The previous default: ``VGPMIL(kernel=RBF(1), damping=0)``, 200 sweeps (reference only)."""
    return _logistic_gp(VGPMIL(kernel=RBF(1.0), damping=0.0, random_state=0))(train, test)


def _probit_gp(model) -> Callable[[Fold, Fold], Prediction]:
    def fit_predict(train: Fold, test: Fold) -> Prediction:
        model.fit(train.X, train.bags, train.y)
        _report_rule(model)
        scores = {"default": model.predict_bag_proba(test.X, test.bags)[1]}
        for rule in PROBIT_BAG_RULES:
            scores[rule] = model.predict_bag_proba(test.X, test.bags, rule=rule)[1]
        return Prediction(scores, model.predict_instance_proba(test.X), {"v": model.kernel_.variance, "sweeps": model.n_iter_})

    return fit_predict


def fit_predict_vgpmilpr(train: Fold, test: Fold) -> Prediction:
    """Default ``VGPMILPR()``; every bag rule on the same fit ("orthant" is the paper's Eq. 26)."""
    return _probit_gp(VGPMILPR(random_state=0))(train, test)


def fit_predict_vgpmilpr_top_fraction(train: Fold, test: Fold) -> Prediction:
    """``VGPMILPR(bag_rule="top_fraction")``: the default until session 15, without the rule guard."""
    return _probit_gp(VGPMILPR(bag_rule="top_fraction", random_state=0))(train, test)


def fit_predict_vgpmilpr_v1(train: Fold, test: Fold) -> Prediction:
    """The previous default: ``VGPMILPR(kernel=RBF(4), bag_rule="orthant")`` (reference only)."""
    return _probit_gp(VGPMILPR(kernel=RBF(4.0), bag_rule="orthant", random_state=0))(train, test)


def fit_predict_gibbs(train: Fold, test: Fold) -> Prediction:
    """Default ``VGPMILPRGibbs()`` (the exact sampler of the zero-mean VGPMIL-PR model: 500 burn-in + 2,000
    kept sweeps, thinned by 10); every bag rule on the same chain. Only when named: its 20,500 sweeps cost
    tens of variational fits."""
    model = VGPMILPRGibbs(random_state=0)
    prediction = _probit_gp(model)(train, test)
    prediction.extra["rhat"] = model.rhat_
    return prediction


def fit_predict_vwsgp(train: Fold, test: Fold) -> Prediction:
    """Default ``VWSGP()``: σ(Σ evidence); instance scores are evidences (a ranking)."""
    model = VWSGP(random_state=0).fit(train.X, train.bags, train.y)
    return Prediction({"own": model.predict_bag_proba(test.X, test.bags, method="probit")[1]},
                      model.predict_instance_evidence(test.X), {"v": model.kernel_.variance, "sweeps": model.n_iter_})


def reference_method(folder: Path, max_iter: int = 10) -> Callable[[Fold, Fold], Prediction]:
    """The public 2017 VGPMIL code (``folder``/vgpmil.py) with its defaults and the paper's kernel;
    ``max_iter`` other than its 10 shows what its undamped, H = 1e12 iteration's parity does (it
    can cycle with period 2: ``docs/MODELS.md``)."""
    try:  # its k-means; load_reference keeps a real cv2 and stands in only for a missing one
        import cv2
    except ImportError:
        cv2 = None
    reference, helpers = load_reference(folder)

    def fit_predict(train: Fold, test: Fold) -> Prediction:
        np.random.seed(0)  # its q(u), π and ξ start at random
        Z = None
        if cv2 is not None:
            cv2.setRNGSeed(0)
        else:
            Z = kmeans_inducing_points(train.X, train.y, 50, random_state=0)
        model = reference.vgpmil(helpers.RBF(lengthscale=float(np.sqrt(train.X.shape[1])), variance=1.0), max_iter=max_iter)
        index = BagIndex.from_ids(train.bags)
        model.train(train.X[index.order], train.y[index.order].astype(np.float64), train.bags[index.order], Z=Z)
        test_index = BagIndex.from_ids(test.bags)
        p = np.empty(test.X.shape[0])
        p[test_index.order] = np.ravel(model.predict(test.X[test_index.order]))
        return Prediction({"max": bag_score(p[test_index.order], test_index.offsets, "max")}, p,
                          {"opencv_kmeans": float(cv2 is not None)})

    return fit_predict


METHODS: dict[str, Callable[[Fold, Fold], Prediction]] = {
    "lr_mean_max": fit_predict_lr_mean_max,
    "vgpmil": fit_predict_vgpmil,
    "vgpmil_ard": fit_predict_vgpmil_ard,
    "gvgpmil": fit_predict_gvgpmil,
    "gvgpmil_h100": fit_predict_gvgpmil_h100,
    "vgpmil_h100": fit_predict_vgpmil_h100,
    "vgpmil_h1e12": fit_predict_vgpmil_h1e12,
    "vgpmil_top_fraction": fit_predict_vgpmil_top_fraction,
    "gvgpmil_top_fraction": fit_predict_gvgpmil_top_fraction,
    "vgpmilpr": fit_predict_vgpmilpr,
    "vgpmilpr_top_fraction": fit_predict_vgpmilpr_top_fraction,
    "vwsgp": fit_predict_vwsgp,
    "vgpmil_v1": fit_predict_vgpmil_v1,
    "vgpmilpr_v1": fit_predict_vgpmilpr_v1,
    "gibbs": fit_predict_gibbs,
}
# ABMIL and EmbeddedGPMIL (issue 15; they need the extra torch), defined in bench_embedded.py
METHODS |= {name: EMBEDDED_METHODS[name] for name in ("abmil", "embedded_gpmil")}


# ------------------------------------------------------------------------------- scoring
def within_class_size_correlation(scores: np.ndarray, labels: np.ndarray, sizes: np.ndarray) -> float:
    values = [spearmanr(scores[labels == c], sizes[labels == c])[0] for c in (0, 1)
              if np.unique(sizes[labels == c]).size > 1 and np.unique(scores[labels == c]).size > 1]
    return float(np.mean(values)) if values else float("nan")


def label_noise_rate(value: float | str) -> float:
    """A probability of flipping a bag's label, in [0, ½) (at ½ the labels say nothing); also
    ``--label-noise``'s argparse type."""
    rate = float(value)
    if not 0.0 <= rate < 0.5:
        raise ValueError(f"label noise must be in [0, 0.5), got {rate}")
    return rate


def with_label_noise(train: Fold, rate: float, seed: int) -> Fold:
    """``train`` with the label of each bag flipped with probability ``rate`` (independently, drawn
    in ``np.unique`` order of the bag ids from ``seed``): slide or scan labels read from reports are
    sometimes wrong. Every instance of a flipped bag gets the flipped label; the test fold is never
    touched, so the AUCs measure the true labels."""
    rate = label_noise_rate(rate)
    keys = np.unique(train.bags)
    flipped = keys[np.random.default_rng(seed).random(keys.size) < rate]
    rows = np.isin(train.bags, flipped)
    return replace(train, y=np.where(rows, 1 - train.y, train.y))


def _splits(dataset: str, n_splits: int, draws: int, cv_seeds: tuple[int, ...],
            label_noise: float = 0.0, standardize: bool = True) -> Iterator[tuple[str, Fold, Fold]]:
    """The folds of every CV seed in turn (the large-bag set: its draws once), in one fixed order;
    ``label_noise``: the training bags' labels through :func:`with_label_noise`, seeded by the CV
    seed and the fold, so every method sees the same wrong labels."""
    for seed in cv_seeds[:1] if dataset == "large" else cv_seeds:
        for i, (name, train, test) in enumerate(folds(dataset, n_splits, draws, seed, standardize)):
            yield name, with_label_noise(train, label_noise, 1000 * seed + i) if label_noise else train, test


def evaluate(method: str, dataset: str, n_splits: int, draws: int,
             cv_seeds: tuple[int, ...] = (0,), label_noise: float = 0.0, standardize: bool = True) -> dict[str, dict[str, list[float]]]:
    """Per bag rule: lists (one entry per fold, seed by seed in ``cv_seeds`` order, so entries of two
    methods pair up) of bag AUC, size correlation, instance AUC, fit time."""
    rows: dict[str, dict[str, list[float]]] = {}
    for _, train, test in _splits(dataset, n_splits, draws, tuple(cv_seeds), label_noise, standardize):
        start = time.perf_counter()
        prediction = METHODS[method](train, test)
        seconds = time.perf_counter() - start
        labels, sizes = test.bag_labels(), BagIndex.from_ids(test.bags).sizes
        instance_auc = float("nan")
        if prediction.instance is not None and test.instance_labels is not None:
            instance_auc = float(roc_auc_score(test.instance_labels, prediction.instance))
        for rule, scores in prediction.bag.items():
            row = rows.setdefault(rule, {})
            for key, value in (("bag_auc", roc_auc_score(labels, scores)), ("size_rho", within_class_size_correlation(scores, labels, sizes)),
                               ("instance_auc", instance_auc), ("fit_s", seconds), *prediction.extra.items()):
                row.setdefault(key, []).append(float(value))
    return rows


def elbo_traces(n_iter: int = 150, figure: Path | None = None) -> None:
    """MUSK1 fold 0, VGPMIL with H = 1e12, v = 4: the ELBO (monitor) and the largest change of a
    held-out bag score between consecutive sweeps, damped (0.5) and undamped, both E[max] rules;
    ``figure``: also both traces, sweep by sweep, as a PNG."""
    _, train, test = next(folds("musk1", 5, 1))
    traces = {}
    print("| E[max] | damping | ELBO @10 | @50 | @100 | @150 | max Δ bag score, last 10 sweeps |\n|---|---|---|---|---|---|---|")
    for emax in ("max", "exact"):
        for damping in (0.0, 0.5):
            model = VGPMIL(kernel=RBF(4.0), H=1e12, emax=emax, damping=damping, random_state=0)
            index = BagIndex.from_ids(train.bags)
            labels = train.y[index.order][index.offsets[:-1]]
            X = train.X[index.order]
            updates = model._start_fit(X, np.repeat(labels, index.sizes))
            executor = SerialExecutor(updates, [BagBlock(X=X, offsets=index.offsets, labels=labels)])
            test_index = BagIndex.from_ids(test.bags)
            X_test = test.X[test_index.order]
            q, elbo, changes, previous = updates.init_global(), [], [], None
            for _ in range(n_iter):
                q, objective = updates.global_update(executor.sweep(q), q)
                scores = model._bag_proba_from_state(model.gp_, q, X_test, test_index.offsets)
                if previous is not None:
                    changes.append(np.abs(scores - previous).max())
                elbo.append(objective)
                previous = scores
            cells = " | ".join(f"{elbo[i - 1]:.1f}" for i in (10, 50, 100, 150) if i <= n_iter)
            print(f"| {emax} | {damping} | {cells} | {max(changes[-10:]):.2e} |", flush=True)
            traces[f"E[max] {emax}, damping {damping}"] = (elbo, changes)
    if figure is not None:
        plot_traces(traces, figure)


def plot_traces(traces: dict[str, tuple[list[float], list[float]]], path: Path) -> None:
    """ELBO and the largest consecutive change of a held-out bag score, per sweep, one line per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 6), sharex=True)
    for label, (elbo, changes) in traces.items():
        line, = top.plot(np.arange(1, len(elbo) + 1), elbo, label=label, linewidth=1)
        bottom.semilogy(np.arange(2, len(changes) + 2), np.maximum(changes, 1e-16), color=line.get_color(), linewidth=1)
    top.set_ylabel("ELBO (E[max]=max: a monitor)")
    top.legend(fontsize=8)
    bottom.set_ylabel("max |Δ bag score|, consecutive sweeps")
    bottom.set_xlabel("sweep")
    fig.suptitle("VGPMIL, MUSK1 fold 0, H = 1e12, v = 4")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def primary_rule(rows: Mapping[str, Any]) -> str:
    """The rule a method is compared by (``rows``: keyed by rule): the estimator's own
    (``default``), else its only one."""
    return "default" if "default" in rows else next(iter(rows))


def primary_bag_auc(prediction: Prediction, test: Fold) -> float:
    """Held-out bag AUC of a method's :func:`primary_rule` scores on ``test``."""
    return float(roc_auc_score(test.bag_labels(), prediction.bag[primary_rule(prediction.bag)]))


def paired_difference(auc: list[float], reference: list[float]) -> tuple[float, float]:
    """Mean and standard error of the per-fold AUC difference ``auc - reference`` on identical folds.
    The folds of different CV seeds share bags, so the standard error is a lower bound."""
    d = np.asarray(auc) - np.asarray(reference)
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(d.size)) if d.size > 1 else float("nan")


def print_table(methods: list[str], datasets: list[str], n_splits: int, draws: int,
                cv_seeds: tuple[int, ...] = (0,), paired_to: str | None = None, label_noise: float = 0.0,
                standardize: bool = True) -> None:
    """One Markdown row per data set × method × bag rule, on identical folds; bag AUC is the mean over
    CV seeds × folds. ``paired_to``: also the paired difference of each method's own rule to that
    method's own rule, fold by fold (± its standard error), and a summary table per method."""
    paired = paired_to is not None
    print(f"CV seeds: {' '.join(map(str, cv_seeds))}" + (f"; Δ: paired bag-AUC difference to {paired_to}" if paired else "")
          + (f"; training bag labels flipped with probability {label_noise:g} (test labels true)" if label_noise else "")
          + ("" if standardize else "; features in their own units (not standardised)"))
    head = "| data | method | bag rule | bag AUC | size ρ (within class) | instance AUC | fit+predict s (mean / max) | chosen v | sweeps |"
    print(head + (f" Δ vs {paired_to} ± s.e. |" if paired else ""))
    print("|---|---|---|---|---|---|---|---|---|" + ("---|" if paired else ""))
    summary: dict[str, dict[str, tuple[float, float, float]]] = {}
    for dataset in datasets:
        results = {method: evaluate(method, dataset, n_splits, draws, cv_seeds, label_noise, standardize)
                   for method in ([paired_to] if paired else []) + [m for m in methods if m != paired_to]}
        reference = results[paired_to][primary_rule(results[paired_to])]["bag_auc"] if paired else None
        for method in methods:
            for rule, row in results[method].items():
                auc = np.array(row["bag_auc"])
                v = f"{np.median(row['v']):g}" if "v" in row else "—"
                sweeps = f"{np.mean(row['sweeps']):.0f}" if "sweeps" in row else "—"
                inst = "—" if np.all(np.isnan(row["instance_auc"])) else f"{np.nanmean(row['instance_auc']):.3f}"
                cell = ""
                if paired:
                    mean, se = paired_difference(row["bag_auc"], reference)
                    cell = f" {mean:+.3f} ± {se:.3f} |"
                    if rule == primary_rule(results[method]):
                        summary.setdefault(method, {})[dataset] = (auc.mean(), mean, se)
                print(f"| {dataset} | {method} | {rule} | {auc.mean():.3f} ± {auc.std():.3f} | {np.nanmean(row['size_rho']):+.2f} | {inst} | "
                      f"{np.mean(row['fit_s']):.1f} / {np.max(row['fit_s']):.1f} | {v} | {sweeps} |{cell}", flush=True)
    if paired:
        print(f"\nOwn rule, bag AUC (Δ vs {paired_to} ± s.e.), mean over CV seeds {' '.join(map(str, cv_seeds))} × folds\n")
        print("| method | " + " | ".join(datasets) + " | mean |\n|---|" + "---|" * (len(datasets) + 1))
        for method, cells in summary.items():
            mean = np.mean([cells[d][0] for d in datasets])
            print(f"| {method} | " + " | ".join(f"{a:.3f} ({m:+.3f} ± {e:.3f})" for a, m, e in (cells[d] for d in datasets))
                  + f" | {mean:.3f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--datasets", nargs="+", default=["musk1", "musk2", "digits", "large"])
    parser.add_argument("--methods", nargs="+", default=None, choices=[*METHODS, "vgpmil_2017"],
                        help="default: all but the *_v1 references, the *_top_fraction and *_ard variants and gibbs (and vgpmil_2017 only with --reference)")
    parser.add_argument("--reference", type=Path, help="folder with the public 2017 vgpmil.py (adds vgpmil_2017)")
    parser.add_argument("--reference-iterations", type=int, default=10, help="iterations of vgpmil_2017 (its default: 10)")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--draws", type=int, default=3, help="draws of the large-bag set")
    parser.add_argument("--cv-seeds", nargs="+", type=int, default=[0],
                        help="repeat the stratified CV with these shuffle seeds (same folds for every method within a seed)")
    parser.add_argument("--paired-to", metavar="METHOD",
                        help="also report each method's paired bag-AUC difference to METHOD, fold by fold, ± its standard error")
    parser.add_argument("--label-noise", type=label_noise_rate, default=0.0, metavar="RATE",
                        help="flip each training bag's label with this probability (the test labels stay true)")
    parser.add_argument("--raw-features", action="store_true",
                        help="give every method the features in their own units, not standardised on the training fold")
    parser.add_argument("--elbo-trace", action="store_true", help="only the convergence table (MUSK1, H = 1e12)")
    parser.add_argument("--figure", type=Path, help="with --elbo-trace: also plot the traces, sweep by sweep, to this PNG")
    args = parser.parse_args()
    if args.reference is not None:
        METHODS["vgpmil_2017"] = reference_method(args.reference, args.reference_iterations)
    methods = args.methods or [m for m in METHODS if not m.endswith(("_v1", "_top_fraction", "_ard")) and m != "gibbs"]
    if "vgpmil_2017" in methods and "vgpmil_2017" not in METHODS:
        parser.error("vgpmil_2017 needs --reference PATH (a checkout of the public 2017 code)")
    threads = os.environ.get("OMP_NUM_THREADS", "unset")
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}, OMP_NUM_THREADS={threads}, "
          f"python {platform.python_version()}")
    if args.elbo_trace:
        elbo_traces(figure=args.figure)
        return
    if args.paired_to is not None and args.paired_to not in methods:
        parser.error(f"--paired-to {args.paired_to} must be one of --methods")
    print_table(methods, args.datasets, args.folds, args.draws, tuple(args.cv_seeds), args.paired_to, args.label_noise,
                not args.raw_features)


if __name__ == "__main__":
    main()
