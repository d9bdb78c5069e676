"""How much each feature's bag-level summaries tell the bag labels apart, and the per-feature RBF
length scales that weigh the features by it (a candidate of the automatic kernel choice)."""

from __future__ import annotations

import numpy as np

from .metrics import chance_auc_std, column_aucs

__all__ = ["feature_evidence", "relevance_length_scales"]

_FLOOR = 1e-3
"""Smallest relative weight a feature keeps (a feature with no evidence: ℓ = 1000 √D)."""


def feature_evidence(X_sorted: np.ndarray, offsets: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """``z_d`` (D,): the largest of ``|AUC − ½| / SE₀`` over three bag summaries of feature d — its
    maximum, minimum and mean in each bag — as scores of the bag ``labels`` (SE₀: the AUC's standard
    error under no effect, :func:`~mil_core.metrics.chance_auc_std`). ``X_sorted``: the rows of whole
    bags in CSR order (``offsets``). The maximum and minimum see a witness that pushes one feature
    out in either direction, the mean a shift of many instances; none needs the instance labels."""
    X_sorted = np.asarray(X_sorted, dtype=np.float64)
    starts, sizes = offsets[:-1], np.diff(offsets)[:, None]
    summaries = (np.maximum.reduceat(X_sorted, starts, axis=0), np.minimum.reduceat(X_sorted, starts, axis=0),
                 np.add.reduceat(X_sorted, starts, axis=0) / sizes)
    spread = chance_auc_std(labels)
    return np.max([np.abs(column_aucs(labels, s) - 0.5) / spread for s in summaries], axis=0)


def relevance_length_scales(X_sorted: np.ndarray, offsets: np.ndarray, labels: np.ndarray) -> tuple[float, ...]:
    """ARD length scales ``ℓ_d = √D / w_d`` with ``w = z / rms(z)`` (:func:`feature_evidence`; each
    ``w_d`` at least 10⁻³): features weighed by the evidence the bag labels give for them, scaled so
    that the mean of ``w_d²`` is 1 and ``√D`` keeps its meaning for standardised features (equal
    evidence everywhere: the isotropic ``ℓ = √D``). One informative feature among D is 1/D of every
    distance under the isotropic kernel; here it can carry the distance."""
    z = feature_evidence(X_sorted, offsets, labels)
    rms = float(np.sqrt(np.mean(z**2)))
    weights = z / rms if rms > 0 else np.ones_like(z)
    return tuple(float(ell) for ell in np.sqrt(z.shape[0]) / np.maximum(weights, _FLOOR))
