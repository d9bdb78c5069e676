"""Bag-aware model selection: folds hold whole bags, stratified by bag label (seed 000, Sec. 6).

:class:`StratifiedBagKFold` and :func:`cross_validate_bags` for direct use; :class:`BagwiseClassifier`,
:func:`with_bag_ids` and :func:`bag_scorers` to drive the estimators from scikit-learn's
``GridSearchCV`` / ``cross_validate`` (with ``groups``); :func:`grid_search_bags` for the papers'
protocol (grid, CV, selection by bag accuracy).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, ClassifierMixin, MetaEstimatorMixin, clone
from sklearn.metrics import accuracy_score, f1_score, roc_auc_score
from sklearn.model_selection import ParameterGrid, StratifiedKFold

from .validation import check_mil_data, standardisation, standardise

__all__ = [
    "StratifiedBagKFold",
    "cross_validate_bags",
    "BagwiseClassifier",
    "with_bag_ids",
    "bag_scorers",
    "grid_search_bags",
]


class StratifiedBagKFold:
    """K-fold over bags, stratified by bag label; yields instance indices (whole bags).

    ``split(X, y, groups)`` follows scikit-learn's group-splitter signature, with ``groups``
    the bag id of each instance and ``y`` its bag label.
    """

    def __init__(self, n_splits: int = 5, *, shuffle: bool = True, random_state: int | None = None):
        self.n_splits = n_splits
        self.shuffle = shuffle
        self.random_state = random_state

    def get_n_splits(self, X: Any = None, y: Any = None, groups: Any = None) -> int:
        return self.n_splits

    def split(self, X: Any, y: Any, groups: Any) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        _, bags, labels = check_mil_data(X, groups, y)
        bag_of_instance = np.empty(bags.order.shape[0], dtype=np.int64)
        bag_of_instance[bags.order] = bags.instance_bag()
        folds = StratifiedKFold(self.n_splits, shuffle=self.shuffle, random_state=self.random_state if self.shuffle else None)
        for train_bags, test_bags in folds.split(np.zeros(labels.shape[0]), labels):
            yield np.flatnonzero(np.isin(bag_of_instance, train_bags)), np.flatnonzero(np.isin(bag_of_instance, test_bags))


def _binary_metrics(prefix: str, truth: np.ndarray, proba: np.ndarray) -> dict[str, float]:
    predicted = (proba >= 0.5).astype(int)
    return {
        f"{prefix}_auc": float(roc_auc_score(truth, proba)) if np.unique(truth).size == 2 else float("nan"),
        f"{prefix}_accuracy": float(accuracy_score(truth, predicted)),
        f"{prefix}_f1": float(f1_score(truth, predicted, zero_division=0.0)),
    }


def _bag_scores(model: Any, X: np.ndarray, bag_ids: np.ndarray, y: np.ndarray, predict_kwargs: dict[str, Any]) -> dict[str, float]:
    """Bag AUC/accuracy/F1 of a fitted MIL estimator on the bags in ``X``."""
    _, p = model.predict_bag_proba(X, bag_ids, **predict_kwargs)
    return _binary_metrics("bag", check_mil_data(X, bag_ids, y)[2], p)


def cross_validate_bags(
    estimator: Any,
    X: np.ndarray,
    bag_ids: np.ndarray,
    y: np.ndarray,
    *,
    instance_labels: np.ndarray | None = None,
    n_splits: int = 5,
    standardize: bool = True,
    random_state: int | None = 0,
    predict_kwargs: dict[str, Any] | None = None,
    return_train_score: bool = False,
) -> list[dict[str, float]]:
    """Fit a clone per fold and score it on the held-out bags.

    Features are standardised with the training fold's statistics when ``standardize`` (a column
    whose std is below 1e-12 is left unscaled: :func:`~mil_core.validation.standardisation`).
    Returns one dict per fold: bag AUC/accuracy/F1 (threshold 0.5), instance metrics when
    ``instance_labels`` are given, and ``fit_time`` in seconds. ``return_train_score`` adds the
    same bag metrics on the fold's training bags, as ``train_bag_<metric>`` (a measure of fit, not
    of generalisation; what a protocol that scores its training bags reports).
    """
    predict_kwargs = predict_kwargs or {}
    results = []
    for train, test in StratifiedBagKFold(n_splits, random_state=random_state).split(X, y, bag_ids):
        X_train, X_test = X[train], X[test]
        if standardize:
            mean, scale = standardisation(X_train)
            X_train, X_test = standardise(X_train, mean, scale), standardise(X_test, mean, scale)
        model = clone(estimator)
        start = time.perf_counter()
        model.fit(X_train, bag_ids[train], y[train])
        fold = {"fit_time": time.perf_counter() - start, **_bag_scores(model, X_test, bag_ids[test], y[test], predict_kwargs)}
        if return_train_score:
            train_scores = _bag_scores(model, X_train, bag_ids[train], y[train], predict_kwargs)
            fold.update({f"train_{k}": v for k, v in train_scores.items()})
        if instance_labels is not None:
            method = {"method": predict_kwargs["method"]} if "method" in predict_kwargs else {}
            fold.update(_binary_metrics("instance", instance_labels[test], model.predict_instance_proba(X_test, **method)))
        results.append(fold)
    return results


# ------------------------------------------------------------------ scikit-learn search tools
class BagwiseClassifier(ClassifierMixin, MetaEstimatorMixin, BaseEstimator):
    """Adapter that lets scikit-learn's ``GridSearchCV`` / ``cross_validate`` drive an MIL estimator.

    scikit-learn's ``fit(X, y)`` has no room for bag ids, so the adapter's ``X`` carries them in its
    first column: build it with :func:`with_bag_ids`. Pass the same ids as ``groups`` so that
    :class:`StratifiedBagKFold` keeps bags whole, and score with :func:`bag_scorers` (metrics per
    bag, not per instance). With ``standardize`` the features are standardised with the training
    rows' statistics inside ``fit`` (the first column excluded; ``mean_``/``scale_``, a column whose
    std is below 1e-12 left unscaled). Parameters of the wrapped model are
    searched as ``estimator__<name>``.
    """

    def __init__(self, estimator: Any, *, standardize: bool = True, predict_kwargs: dict[str, Any] | None = None):
        self.estimator = estimator
        self.standardize = standardize
        self.predict_kwargs = predict_kwargs

    @staticmethod
    def _columns(X: Any) -> tuple[np.ndarray, np.ndarray]:
        X = np.asarray(X, dtype=np.float64)
        if X.ndim != 2 or X.shape[1] < 2:
            raise ValueError("BagwiseClassifier expects X = with_bag_ids(features, bag_ids): bag ids in column 0")
        return X[:, 1:], X[:, 0]

    def _split(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        features, bag_ids = self._columns(X)
        return (standardise(features, self.mean_, self.scale_) if self.standardize else features), bag_ids

    def fit(self, X: Any, y: Any) -> BagwiseClassifier:
        if self.standardize:
            self.mean_, self.scale_ = standardisation(self._columns(X)[0])
        features, bag_ids = self._split(X)
        self.estimator_ = clone(self.estimator).fit(features, bag_ids, y)
        self.classes_ = np.unique(y)  # as given: 0/1 or -1/1 (the estimator's are 0/1)
        return self

    def predict_bag_proba(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        """``keys, p``: the wrapped model's bag probabilities for the bags in ``X``."""
        features, bag_ids = self._split(X)
        return self.estimator_.predict_bag_proba(features, bag_ids, **(self.predict_kwargs or {}))

    def predict_proba(self, X: Any) -> np.ndarray:
        """Each row gets its bag's probability (so row-wise tools see bag-level predictions)."""
        keys, p = self.predict_bag_proba(X)
        p_row = p[np.searchsorted(keys, self._split(X)[1])]
        return np.column_stack([1.0 - p_row, p_row])

    def predict(self, X: Any) -> np.ndarray:
        return self.classes_[(self.predict_proba(X)[:, 1] >= 0.5).astype(int)]


def with_bag_ids(X: Any, bag_ids: Any) -> np.ndarray:
    """``[bag_id | features]``: the ``X`` of :class:`BagwiseClassifier` (bag ids must be numeric)."""
    return np.column_stack([np.asarray(bag_ids, dtype=np.float64), np.asarray(X, dtype=np.float64)])


def _bag_metric(metric: str):
    def score(estimator: BagwiseClassifier, X: Any, y: Any) -> float:
        keys, p = estimator.predict_bag_proba(X)
        bag_ids = np.asarray(X, dtype=np.float64)[:, 0]
        truth = (np.asarray(y) == 1)[np.unique(bag_ids, return_index=True)[1]].astype(int)  # 0/1 or -1/1 as fitted
        return _binary_metrics("bag", truth, p)[f"bag_{metric}"]

    return score


def bag_scorers() -> dict[str, Any]:
    """Scorers ``bag_auc``, ``bag_accuracy``, ``bag_f1`` for ``GridSearchCV(scoring=…)`` /
    ``cross_validate``: one value per bag, threshold 0.5."""
    return {f"bag_{m}": _bag_metric(m) for m in ("auc", "accuracy", "f1")}


def grid_search_bags(
    estimator: Any,
    param_grid: dict[str, list[Any]],
    X: np.ndarray,
    bag_ids: np.ndarray,
    y: np.ndarray,
    *,
    n_splits: int = 5,
    select: str = "bag_accuracy",
    random_state: int | None = 0,
    predict_kwargs: dict[str, Any] | None = None,
    return_train_score: bool = False,
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The papers' protocol (seed 000, Sec. 6): every configuration of ``param_grid`` is scored by
    stratified ``n_splits``-fold CV over bags (:func:`cross_validate_bags`, with the estimator's own
    validation-AUC early stopping if it is switched on), and the configuration with the best mean
    ``select`` metric is reported with its CV metrics.

    The same folds serve for selection and report, as in the paper, so the reported numbers of the
    selected configuration are optimistic; for an unbiased estimate nest a ``GridSearchCV`` over
    :class:`BagwiseClassifier` inside ``cross_validate``. Returns ``(best_row, all_rows)``, each row
    the parameters plus ``mean_<metric>`` / ``std_<metric>`` (with ``return_train_score`` also of
    the training bags' ``train_bag_<metric>``; selection always uses the held-out ``select``).
    """
    rows = []
    for params in ParameterGrid(param_grid):
        folds = cross_validate_bags(
            clone(estimator).set_params(**params), X, bag_ids, y,
            n_splits=n_splits, random_state=random_state, predict_kwargs=predict_kwargs,
            return_train_score=return_train_score,
        )
        row: dict[str, Any] = dict(params)
        for key in folds[0]:
            values = np.array([f[key] for f in folds])
            row[f"mean_{key}"], row[f"std_{key}"] = float(values.mean()), float(values.std())
        rows.append(row)
    best = max(rows, key=lambda r: r[f"mean_{select}"])
    return best, rows
