"""Inducing-point initialisation by k-means, balanced between bag classes."""

from __future__ import annotations

import warnings

import numpy as np
from sklearn.cluster import KMeans, MiniBatchKMeans
from sklearn.exceptions import ConvergenceWarning

__all__ = ["kmeans_inducing_points"]


def kmeans_inducing_points(
    X: np.ndarray,
    instance_bag_label: np.ndarray,
    n_inducing: int,
    *,
    random_state: int | np.random.RandomState | None = None,
    minibatch_above: int = 20_000,
) -> np.ndarray:
    """k-means centres: half from instances of positive bags, half from negative bags.

    This is how the reference VGPMIL codes place Z. The positive half gets ``n_inducing // 2``
    centres and the negative half the rest; a class with fewer instances than its half gives
    every instance and the other class makes up the difference. Each half uses mini-batch k-means
    when it has more than ``minibatch_above`` instances. Deterministic given ``random_state``.
    A class with fewer distinct rows than its centres (duplicated rows, e.g. padding or blank
    tiles) gives each distinct row once: fewer inducing points, never two equal ones (they would
    make ``Kzz`` singular).
    """
    X = np.asarray(X)  # each class's rows in float64 below, one class at a time: no float64 copy of all rows
    positive = np.asarray(instance_bag_label) == 1
    if n_inducing > X.shape[0]:
        raise ValueError(f"n_inducing={n_inducing} exceeds the {X.shape[0]} instances to place them among")
    n_positive = int(positive.sum())
    k_negative = min(n_inducing - min(n_inducing // 2, n_positive), X.shape[0] - n_positive)
    wanted = {True: n_inducing - k_negative, False: k_negative}
    rng = np.random.RandomState(random_state) if not isinstance(random_state, np.random.RandomState) else random_state
    centres = []
    for label in (True, False):
        k = wanted[label]
        if k == 0:
            continue
        rows = np.asarray(X[positive == label], dtype=np.float64)
        seed = rng.randint(np.iinfo(np.int32).max)
        if rows.shape[0] > minibatch_above:
            km = MiniBatchKMeans(n_clusters=k, random_state=seed, n_init=3, batch_size=4096)
        else:
            km = KMeans(n_clusters=k, random_state=seed, n_init=1)
        with warnings.catch_warnings():  # fewer distinct rows than k: handled below
            warnings.filterwarnings("ignore", message="Number of distinct clusters", category=ConvergenceWarning)
            km.fit(rows)
        found = km.cluster_centers_
        if np.unique(km.labels_).size < k:  # centres that own no row: fewer distinct rows than k?
            distinct = np.unique(rows, axis=0)
            if distinct.shape[0] <= k:
                found = distinct  # each distinct row once, never two equal centres
        centres.append(found)
    return np.concatenate(centres, axis=0)
