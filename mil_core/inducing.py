"""Inducing-point initialisation by k-means, balanced between bag classes."""

from __future__ import annotations

import numpy as np
from sklearn.cluster import KMeans, MiniBatchKMeans

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
    centres and the negative half the rest; each half uses mini-batch k-means when it has more
    than ``minibatch_above`` instances. Deterministic given ``random_state``.
    """
    X = np.asarray(X, dtype=np.float64)
    positive = np.asarray(instance_bag_label) == 1
    wanted = {True: n_inducing // 2, False: n_inducing - n_inducing // 2}
    rng = np.random.RandomState(random_state) if not isinstance(random_state, np.random.RandomState) else random_state
    centres = []
    for label in (True, False):
        rows = X[positive == label]
        k = wanted[label]
        if k == 0:
            continue
        if rows.shape[0] < k:
            raise ValueError(
                f"{'positive' if label else 'negative'} bags hold {rows.shape[0]} instances, fewer than "
                f"the {k} inducing points they must provide (n_inducing={n_inducing}); lower n_inducing"
            )
        seed = rng.randint(np.iinfo(np.int32).max)
        if rows.shape[0] > minibatch_above:
            km = MiniBatchKMeans(n_clusters=k, random_state=seed, n_init=3, batch_size=4096)
        else:
            km = KMeans(n_clusters=k, random_state=seed, n_init=1)
        centres.append(km.fit(rows).cluster_centers_)
    return np.concatenate(centres, axis=0)
