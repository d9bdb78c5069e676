"""Post-hoc calibration of bag scores: Platt scaling and the calibration error that measures it.

Platt (1999) maps a real score ``s`` to ``p = σ(a s + c)``, with ``(a, c)`` minimising the
cross-entropy on held-out bags against his smoothed targets ``t₊ = (N₊ + 1)/(N₊ + 2)`` and
``t₋ = 1/(N₋ + 2)`` (Platt 1999, §2.2; Lin, Lin & Weng 2007). The smoothing is a prior of one
extra bag per class: it keeps ``a`` finite when a small held-out set is separable, which is the
usual case for the 10–30 inner validation bags of a MIL data set. The objective is convex in
``(a, c)``; it is minimised by Newton's method on its 2 × 2 Hessian with a backtracking line search.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.special import expit

__all__ = ["expected_calibration_error", "fit_platt", "platt_proba", "reliability_bins"]

_MAX_NEWTON = 100
_TOL = 1e-10


def _platt_objective(w: np.ndarray, s: np.ndarray, t: np.ndarray) -> float:
    z = w[0] * s + w[1]
    return float(np.sum(np.logaddexp(0.0, z) - t * z))


def fit_platt(scores: Any, labels: Any) -> tuple[float, float]:
    """Slope ``a`` and intercept ``c`` of Platt scaling ``p = σ(a s + c)`` fitted on held-out
    ``scores`` with binary ``labels`` (at least one of each class)."""
    s = np.asarray(scores, dtype=np.float64).ravel()
    y = np.asarray(labels).ravel()
    if s.shape != y.shape:
        raise ValueError(f"scores and labels differ in length: {s.shape[0]} vs {y.shape[0]}")
    if not np.all(np.isfinite(s)):
        raise ValueError("Platt scaling needs finite scores; got NaN or infinite values")
    if not np.all((y == 0) | (y == 1)) or np.unique(y).size < 2:
        raise ValueError(f"Platt scaling needs 0/1 labels of both classes, got {np.unique(y).tolist()}")
    n_pos, n_neg = int(y.sum()), int((1 - y).sum())
    t = np.where(y == 1, (n_pos + 1.0) / (n_pos + 2.0), 1.0 / (n_neg + 2.0))
    w = np.array([1.0, 0.0])
    value = _platt_objective(w, s, t)
    for _ in range(_MAX_NEWTON):
        p = expit(w[0] * s + w[1])
        g = p - t
        grad = np.array([g @ s, g.sum()])
        h = p * (1.0 - p)
        hess = np.array([[h @ (s * s), h @ s], [h @ s, h.sum()]])
        # Levenberg–Marquardt ridge: positive definite even when h → 0 (saturated scores)
        step = np.linalg.solve(hess + 1e-12 * (1.0 + np.trace(hess)) * np.eye(2), grad)
        scale = 1.0
        while scale > 1e-10:
            candidate = w - scale * step
            new = _platt_objective(candidate, s, t)
            if new <= value:
                break
            scale *= 0.5
        else:
            break
        converged = value - new <= _TOL * (1.0 + abs(value))
        w, value = candidate, new
        if converged:
            break
    return float(w[0]), float(w[1])


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
