"""Bag-aware cross-validation: folds hold whole bags, stratified by bag label (seed 000, Sec. 6)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
from sklearn.base import clone
from sklearn.metrics import accuracy_score, f1_score, roc_auc_score
from sklearn.model_selection import StratifiedKFold
from sklearn.preprocessing import StandardScaler

from .validation import check_mil_data

__all__ = ["StratifiedBagKFold", "cross_validate_bags"]


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
) -> list[dict[str, float]]:
    """Fit a clone per fold and score it on the held-out bags.

    Features are standardised with the training fold's statistics when ``standardize``.
    Returns one dict per fold: bag AUC/accuracy/F1 (threshold 0.5), instance metrics when
    ``instance_labels`` are given, and ``fit_time`` in seconds.
    """
    predict_kwargs = predict_kwargs or {}
    results = []
    for train, test in StratifiedBagKFold(n_splits, random_state=random_state).split(X, y, bag_ids):
        X_train, X_test = X[train], X[test]
        if standardize:
            scaler = StandardScaler().fit(X_train)
            X_train, X_test = scaler.transform(X_train), scaler.transform(X_test)
        model = clone(estimator)
        start = time.perf_counter()
        model.fit(X_train, bag_ids[train], y[train])
        fold = {"fit_time": time.perf_counter() - start}
        keys, p = model.predict_bag_proba(X_test, bag_ids[test], **predict_kwargs)
        _, test_bags, bag_truth = check_mil_data(X_test, bag_ids[test], y[test])
        fold.update(_binary_metrics("bag", bag_truth, p))
        if instance_labels is not None:
            method = {"method": predict_kwargs["method"]} if "method" in predict_kwargs else {}
            fold.update(_binary_metrics("instance", instance_labels[test], model.predict_instance_proba(X_test, **method)))
        results.append(fold)
    return results
