"""Post-hoc calibration of bag scores: Platt scaling and the calibration error that measures it.

Platt (1999) maps a real score ``s`` to ``p = σ(a s + c)``, with ``(a, c)`` minimising the
cross-entropy on held-out bags against his smoothed targets ``t₊ = (N₊ + 1)/(N₊ + 2)`` and
``t₋ = 1/(N₋ + 2)`` (Platt 1999, §2.2; Lin, Lin & Weng 2007). The smoothing is a prior of one
extra bag per class: it keeps ``a`` finite when a small held-out set is separable, which is the
usual case for the 4–30 inner validation bags of a MIL data set.

Two further choices for such small sets, both measured (``docs/BENCHMARKS.md``): the slope is
``a = exp(θ)`` > 0, so calibration is monotone increasing and never reverses the ranking the model
learnt (an unconstrained fit on 4 validation bags gave ``a < 0`` and turned a bag AUC of 0.60 into
0.40); and ``θ ~ N(0, slope_prior_std²)``, a prior centred on "the score is already calibrated",
which the data overrides as the held-out set grows. The MAP ``(θ, c)`` is found by L-BFGS with the
analytic gradient.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.optimize import minimize
from scipy.special import expit

__all__ = ["expected_calibration_error", "fit_platt", "platt_proba", "reliability_bins"]


def fit_platt(scores: Any, labels: Any, *, slope_prior_std: float | None = 1.0) -> tuple[float, float]:
    """Slope ``a > 0`` and intercept ``c`` of Platt scaling ``p = σ(a s + c)`` fitted on held-out
    ``scores`` with binary ``labels`` (at least one of each class): the MAP under Platt's smoothed
    targets and ``log a ~ N(0, slope_prior_std²)`` (``None``: no prior on the slope)."""
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).ravel()
    if s.shape != y.shape:
        raise ValueError(f"scores and labels differ in length: {s.shape[0]} vs {y.shape[0]}")
    if not np.all(np.isfinite(s)):
        raise ValueError("Platt scaling needs finite scores; got NaN or infinite values")
    if not np.all((y == 0) | (y == 1)) or np.unique(y).size < 2:
        raise ValueError(f"Platt scaling needs 0/1 labels of both classes, got {np.unique(y).tolist()}")
    if slope_prior_std is not None and not slope_prior_std > 0:
        raise ValueError(f"slope_prior_std must be > 0 or None, got {slope_prior_std!r}")
    n_pos, n_neg = int(y.sum()), int((1 - y).sum())
    t = np.where(y == 1, (n_pos + 1.0) / (n_pos + 2.0), 1.0 / (n_neg + 2.0))
    precision = 0.0 if slope_prior_std is None else 1.0 / slope_prior_std**2

    def objective(w: np.ndarray) -> tuple[float, np.ndarray]:
        a = np.exp(w[0])
        z = a * s + w[1]
        g = expit(z) - t
        value = np.sum(np.logaddexp(0.0, z) - t * z) + 0.5 * precision * w[0] ** 2
        return float(value), np.array([a * (g @ s) + precision * w[0], g.sum()])

    result = minimize(objective, np.zeros(2), jac=True, method="L-BFGS-B",
                      bounds=[(-30.0, 30.0), (None, None)], options={"gtol": 1e-10, "ftol": 1e-14})
    return float(np.exp(result.x[0])), float(result.x[1])


def platt_proba(scores: Any, slope: float, intercept: float) -> np.ndarray:
    """``σ(a s + c)``."""
    return expit(slope * np.asarray(scores, dtype=np.float64) + intercept)


def reliability_bins(proba: Any, labels: Any, n_bins: int = 10) -> list[tuple[int, float, float]]:
    """The reliability diagram's non-empty equal-width bins: ``(count, mean p, positive fraction)``."""
    p, y = np.asarray(proba, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    bins = np.minimum((p * n_bins).astype(int), n_bins - 1)
    return [(int(np.sum(bins == k)), float(p[bins == k].mean()), float(y[bins == k].mean()))
            for k in range(n_bins) if np.any(bins == k)]


def expected_calibration_error(proba: Any, labels: Any, n_bins: int = 10) -> float:
    """``ECE = Σ_k n_k/n |positive fraction_k − mean p_k|`` over ``n_bins`` equal-width bins."""
    rows = reliability_bins(proba, labels, n_bins)
    n = sum(count for count, _, _ in rows)
    return float(sum(count * abs(fraction - mean) for count, mean, fraction in rows) / n)
