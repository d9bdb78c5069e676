"""The ROC AUC of the inner model-selection loops, without scikit-learn's per-call validation, and its spread under chance."""

from __future__ import annotations

import numpy as np
from scipy.stats import rankdata


def binary_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """ROC AUC of 0/1 ``labels`` by ``scores``: the Mann–Whitney statistic
    ``(R₁ − n₁(n₁ + 1)/2) / (n₁ n₀)`` with ``R₁`` the positives' rank sum (ties share the average
    rank, so a tied pair counts ½), equal to ``sklearn.metrics.roc_auc_score``. The kernel choice
    scores hundreds of checkpoints per fit, and that function's input checks cost ~4 ms a call
    (most of a small default fit's time)."""
    return float(column_aucs(labels, np.asarray(scores, dtype=np.float64)[:, None])[0])


def column_aucs(labels: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """:func:`binary_auc` of each column of ``scores`` (rows: one per label), (C,)."""
    labels = both_classes(labels)
    return ranked_aucs(rankdata(np.asarray(scores, dtype=np.float64), axis=0), labels[:, None])[0]


TIE_TOLERANCE = 1e-9
"""Values of a column closer than this fraction of its largest magnitude (or range) are ties."""


def tie_aware_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks of each column of ``values`` (B, C), ties averaged, where values that differ by rounding
    alone — less than :data:`TIE_TOLERANCE` of the column's scale, from gaps between neighbours in
    sorted order — are ties. ``rankdata`` breaks such near-ties by their last bits: the means of
    integer features in two bags, equal in exact arithmetic, ranked one way after one
    standardisation and the other way after an equivalent one."""
    values = np.asarray(values, dtype=np.float64)
    order = np.argsort(values, axis=0, kind="stable")
    ordered = np.take_along_axis(values, order, axis=0)
    scale = np.maximum(ordered[-1] - ordered[0], np.abs(ordered).max(axis=0)) * TIE_TOLERANCE
    groups = np.concatenate([np.zeros((1,) + ordered.shape[1:]), np.cumsum(np.diff(ordered, axis=0) > scale, axis=0)])
    tied = np.empty_like(groups)
    np.put_along_axis(tied, order, groups, axis=0)
    return rankdata(tied, axis=0)


def both_classes(labels: np.ndarray) -> np.ndarray:
    """0/1 ``labels`` as booleans, refused unless both classes occur (an AUC needs both)."""
    labels = np.asarray(labels).astype(bool)
    if labels.all() or not labels.any():
        raise ValueError("the AUC needs labels of both classes")
    return labels


def ranked_aucs(ranks: np.ndarray, labellings: np.ndarray) -> np.ndarray:
    """AUC (P, C) of each column of ``ranks`` (B, C: the scores' ranks, ties averaged) under each
    0/1 column of ``labellings`` (B, P; each with the same number of positives, at least one of
    each class): the Mann–Whitney statistic of :func:`binary_auc`, one product for all P — a
    labelling's permutations reuse the ranks."""
    labellings = np.asarray(labellings, dtype=np.float64)
    n_pos = labellings[:, 0].sum()
    n_neg = labellings.shape[0] - n_pos
    return (labellings.T @ ranks - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg)


def chance_auc_std(labels: np.ndarray) -> float:
    """Standard deviation of the AUC of scores unrelated to 0/1 ``labels`` (the Mann–Whitney
    statistic under the null, no ties): ``sqrt((n₁ + n₀ + 1) / (12 n₁ n₀))``. An AUC within two of
    them of ½ is not distinguishable from chance."""
    labels = np.asarray(labels).astype(bool)
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    return float(np.sqrt((n_pos + n_neg + 1) / (12.0 * n_pos * n_neg)))
