"""How much each feature's bag-level summaries tell the bag labels apart, and the per-feature RBF
length scales that weigh the features by it (a candidate of the automatic kernel choice)."""

from __future__ import annotations

import numpy as np
from ._backend import to_numpy
from .metrics import both_classes, chance_auc_std, ranked_aucs, tie_aware_ranks

__all__ = ["RELEVANCE_FORMS", "feature_evidence", "relevance_length_scales", "relevance_weightings"]

RELEVANCE_FORMS: tuple[str, ...] = ("proportional", "sharpened")
"""The weightings :func:`relevance_length_scales` offers; the kernel choice tries each
(``VGPMIL._refined_candidates``), the first winning ties: where no feature stands out in any
split's training half the two coincide there, and the proportional weights are the ones the
splits scored, even if the sharpening test passes on all the choice's bags."""

_FLOOR = 1e-3
"""Smallest relative weight a feature keeps (a feature with no evidence: ℓ = 1000 √D)."""

_PERMUTATIONS = 99
"""Label permutations that give the no-effect distribution of the top feature's excess evidence."""

_SIGNIFICANCE = 0.05
"""Largest permutation p-value, ``(1 + #{permutations whose top excess reaches the observed}) / 100``,
at which the top feature counts as standing out."""


def _evidence(X_sorted: np.ndarray, offsets: np.ndarray, labellings: np.ndarray) -> np.ndarray:
    """``z`` of :func:`feature_evidence` under each 0/1 column of ``labellings`` (B, P): (P, D).
    Each bag summary is ranked once for all P (:func:`~mil_core.metrics.ranked_aucs`), summaries
    equal but for rounding as ties (:func:`~mil_core.metrics.tie_aware_ranks`): the weights are
    the same whichever way the features were standardised."""
    X_sorted, labellings = np.asarray(X_sorted), np.asarray(labellings, dtype=np.float64)
    starts, sizes = offsets[:-1], np.diff(offsets)[:, None]
    spread = chance_auc_std(labellings[:, 0])
    z = np.zeros((labellings.shape[1], X_sorted.shape[1]))
    # the (B, D) summaries in float64; the (N, D) rows stay in their own dtype (no float64 copy of them)
    for summary in (np.maximum.reduceat(X_sorted, starts, axis=0), np.minimum.reduceat(X_sorted, starts, axis=0),
                    np.add.reduceat(X_sorted, starts, axis=0, dtype=np.float64) / sizes):
        np.maximum(z, np.abs(ranked_aucs(tie_aware_ranks(summary), labellings) - 0.5) / spread, out=z)
    return z


def feature_evidence(X_sorted: np.ndarray, offsets: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """``z_d`` (D,): the largest of ``|AUC − ½| / SE₀`` over three bag summaries of feature d — its
    maximum, minimum and mean in each bag — as scores of the bag ``labels`` (SE₀: the AUC's standard
    error under no effect, :func:`~mil_core.metrics.chance_auc_std`). ``X_sorted``: the rows of whole
    bags in CSR order (``offsets``). The maximum and minimum see a witness that pushes one feature
    out in either direction, the mean a shift of many instances; none needs the instance labels."""
    labels = both_classes(labels)
    return _evidence(X_sorted, offsets, labels[:, None])[0]


def relevance_length_scales(X_sorted: np.ndarray, offsets: np.ndarray, labels: np.ndarray,
                            form: str = "sharpened") -> tuple[float, ...]:
    """ARD length scales ``ℓ_d = √D / w_d`` (each ``w_d`` at least 10⁻³) from the evidence ``z``
    (:func:`feature_evidence`), scaled so that the mean of ``w_d²`` is 1 and ``√D`` keeps its meaning
    for standardised features. One informative feature among D is 1/D of every distance under the
    isotropic kernel; here it can carry the distance.

    When the top feature stands out — its excess ``max_d (z_d − median z)`` above that of all but
    5 % of 99 label permutations — ``w = (z − median z)₊ / rms``: the median is the no-effect level
    (most features carry no concept, and evidence that follows bag size lifts every feature's
    maximum and minimum alike), and the features at or below it get no weight. Otherwise
    ``w = z / rms(z)``: no feature is singled out, and each is weighed in proportion. Equal evidence
    everywhere: the isotropic ``ℓ = √D``.

    ``form="proportional"``: ``w = z / rms(z)`` always — what the default form gives where no
    feature stands out. The kernel choice tries both forms (:func:`relevance_weightings`;
    ``docs/BENCHMARKS.md``, session 39)."""
    if form not in RELEVANCE_FORMS:
        raise ValueError(f"form must be one of {', '.join(RELEVANCE_FORMS)}, got {form!r}")
    return relevance_weightings(X_sorted, offsets, labels)[form]


def relevance_weightings(X_sorted: np.ndarray, offsets: np.ndarray, labels: np.ndarray) -> dict[str, tuple[float, ...]]:
    """:func:`relevance_length_scales` in each of :data:`RELEVANCE_FORMS`, from one pass over the
    bags (the observed labels' evidence is the first of the permutation test's labellings); the
    two are the same tuple where no feature stands out. Ranks are a host computation: rows on a
    device are copied once (the kernel choice's halves: thousands of rows)."""
    X_sorted, labels = to_numpy(X_sorted), both_classes(labels)
    rng = np.random.default_rng(0)  # the weights are a function of the bags alone
    z_all = _evidence(X_sorted, offsets, np.column_stack([labels] + [rng.permutation(labels) for _ in range(_PERMUTATIONS)]))
    excess = z_all - np.median(z_all, axis=1, keepdims=True)  # over each labelling's own median
    top_excess = excess.max(axis=1)
    proportional = _length_scales(z_all[0])
    stands_out = (1 + np.sum(top_excess[1:] >= top_excess[0])) / (1 + _PERMUTATIONS) <= _SIGNIFICANCE
    return {"proportional": proportional, "sharpened": _length_scales(np.maximum(excess[0], 0.0)) if stands_out else proportional}


def _length_scales(weights: np.ndarray) -> tuple[float, ...]:
    """``ℓ_d = √D / w_d`` of ``weights`` scaled to mean square 1 (each at least :data:`_FLOOR`);
    all zero: the isotropic ``ℓ = √D``."""
    rms = float(np.sqrt(np.mean(weights**2)))
    weights = weights / rms if rms > 0 else np.ones_like(weights)
    return tuple(float(ell) for ell in np.sqrt(weights.shape[0]) / np.maximum(weights, _FLOOR))
