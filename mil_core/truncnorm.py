"""Truncated-Gaussian moments and the positive-bag normaliser of the probit MIL models, in log space.

For ``m ~ N(μ, σ²)`` truncated to ``m < 0`` (a negative bag, seed 002 Eq. 19) write ``α = μ/σ`` and
the inverse Mills ratio ``r(α) = φ(α) / Φ(−α)``, computed as ``exp(log φ(α) − log Φ(−α))`` with
``scipy.special.log_ndtr``: nothing overflows or divides by zero at ``α = ±40`` (or ±10⁴).

For a positive bag the factorised Gaussian is truncated to "not all negative" (Eq. 20):
``Z = 1 − Π_i Φ(−α_i)``. With ``log p₀ = Σ_i log Φ(−α_i) = −t`` we evaluate
``log Z = log(1 − e^{−t})`` from ``log t`` (a segment log-sum-exp of ``log(−log Φ(−α_i))``), so a bag
whose instances are all far below zero (``Z`` below the smallest double) still gets a finite,
accurate ``log Z``, and Eq. 20 is rewritten without cancellation as
``E[m_i] = μ_i + σ_i r(α_i) · p₀ / Z = μ_i + σ_i exp(log r_i + log p₀ − log Z)``.
"""

from __future__ import annotations

import numpy as np
from scipy.special import log_ndtr, ndtri_exp

from .bags import segment_logsumexp

__all__ = [
    "log1mexp",
    "log_inverse_mills",
    "log_neg_log_ndtr",
    "positive_bag_log_normaliser",
    "positive_bag_means",
    "sample_upper_truncated",
    "upper_truncated_entropy",
    "upper_truncated_moments",
    "upper_truncated_quantile",
]

_LOG_SQRT_2PI = 0.5 * np.log(2.0 * np.pi)


def log_inverse_mills(alpha: np.ndarray, log_q: np.ndarray | None = None) -> np.ndarray:
    """``log r(α) = log φ(α) − log Φ(−α)``: finite for every finite α. ``log_q``: ``log Φ(−α)``
    where the caller has it already (``log_ndtr`` is most of the host time of a probit sweep:
    this module's functions take it so that a sweep computes it once)."""
    alpha = np.asarray(alpha, dtype=np.float64)
    return -0.5 * alpha**2 - _LOG_SQRT_2PI - (log_ndtr(-alpha) if log_q is None else log_q)


def upper_truncated_moments(mean: np.ndarray, sd: np.ndarray, log_q: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of ``N(mean, sd²)`` truncated to ``(−∞, 0)`` (seed 002 Eq. 19).

    ``E = μ − σ r(α)``, ``Var = σ²(1 − r(α)(r(α) − α))`` with ``α = μ/σ``. For ``α → +∞``,
    ``r − α → 1/α`` and the variance → σ²/α² (computed, not cancelled to a negative number).
    ``log_q``: ``log Φ(−α)``, if known (:func:`log_inverse_mills`).
    """
    mean, sd = np.asarray(mean, dtype=np.float64), np.asarray(sd, dtype=np.float64)
    alpha = mean / sd
    r = np.exp(log_inverse_mills(alpha, log_q))
    var = sd**2 * np.clip(1.0 - r * (r - alpha), 0.0, 1.0)
    return mean - sd * r, var


def upper_truncated_entropy(mean: np.ndarray, sd: np.ndarray) -> np.ndarray:
    """Differential entropy of ``N(mean, sd²)`` truncated to ``(−∞, 0)``:
    ``½ log(2πe σ²) + log Φ(β) − β φ(β) / (2Φ(β))`` with ``β = −μ/σ``."""
    beta = -np.asarray(mean, dtype=np.float64) / sd
    r = np.exp(log_inverse_mills(-beta))  # φ(β)/Φ(β)
    return 0.5 * np.log(2.0 * np.pi * np.e * sd**2) + log_ndtr(beta) - 0.5 * beta * r


def upper_truncated_quantile(mean: np.ndarray, sd: np.ndarray, u: np.ndarray) -> np.ndarray:
    """The ``u``-quantile (``0 < u < 1``) of ``N(mean, sd²)`` truncated to ``(−∞, 0)``, by the inverse CDF
    in log space (``Φ⁻¹`` of ``log u + log Φ(β)`` via ``ndtri_exp``), valid for any finite mean/sd: an
    exact draw for a uniform ``u`` (the Gibbs sampler keys its uniforms, :mod:`mil_core.models.gibbs`)."""
    z = ndtri_exp(np.log(u) + log_ndtr(-mean / sd))
    return np.minimum(mean + sd * z, 0.0)


def sample_upper_truncated(mean: np.ndarray, sd: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Exact draws from ``N(mean, sd²)`` truncated to ``(−∞, 0)`` (:func:`upper_truncated_quantile` of uniforms)."""
    mean, sd = np.broadcast_arrays(np.asarray(mean, dtype=np.float64), np.asarray(sd, dtype=np.float64))
    return upper_truncated_quantile(mean, sd, rng.uniform(size=mean.shape))


def log_neg_log_ndtr(alpha: np.ndarray, log_q: np.ndarray | None = None) -> np.ndarray:
    """``log(−log Φ(−α))`` for every finite α (``log_q``: ``log Φ(−α)``, if known).

    For ``Φ(α)`` tiny, ``−log Φ(−α) = −log1p(−Φ(α)) = Φ(α)(1 + Φ(α)/2 + …)`` underflows where its
    logarithm does not: use ``log Φ(α) + log1p(Φ(α)/2)`` there. ``Φ(α) < 10⁻⁸`` only for
    ``α < −5.6``, so ``log Φ(α)`` is evaluated only below ``α = −5``.
    """
    alpha = np.asarray(alpha, dtype=np.float64)
    log_p = np.zeros_like(alpha)  # log Φ(α) where it can be tiny; 0 stands for "not tiny"
    below = alpha < -5.0
    log_p[below] = log_ndtr(alpha[below])
    neg_log_q = -(log_ndtr(-alpha) if log_q is None else log_q)  # −log Φ(−α) ≥ 0
    tiny = log_p < np.log(1e-8)
    with np.errstate(divide="ignore"):
        direct = np.log(np.where(tiny, 1.0, neg_log_q))
    return np.where(tiny, log_p + np.log1p(0.5 * np.exp(log_p)), direct)


def log1mexp(log_t: np.ndarray) -> np.ndarray:
    """``log(1 − e^{−t})`` from ``log t`` (``t > 0``), accurate for ``t`` from 10⁻³⁰⁰ to ∞."""
    log_t = np.asarray(log_t, dtype=np.float64)
    t = np.exp(log_t)
    small = t < 1e-8
    mid = (~small) & (t < np.log(2.0))
    out = np.empty_like(t)
    out[small] = log_t[small] - 0.5 * t[small]
    out[mid] = np.log(-np.expm1(-t[mid]))
    big = ~(small | mid)
    out[big] = np.log1p(-np.exp(-t[big]))
    return out


def positive_bag_log_normaliser(alpha: np.ndarray, offsets: np.ndarray,
                                log_q: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``(log p₀, log Z)`` per bag for independent ``m_i ~ N(μ_i, σ_i²)``, ``α = μ/σ``:
    ``p₀ = Π Φ(−α_i)`` (all negative) and ``Z = 1 − p₀`` (Eq. 20), both in log space
    (``log_q``: ``log Φ(−α)``, if known)."""
    log_t = segment_logsumexp(log_neg_log_ndtr(alpha, log_q), offsets)
    return -np.exp(log_t), log1mexp(log_t)


def positive_bag_means(mean: np.ndarray, sd: np.ndarray, offsets: np.ndarray,
                       log_q: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``E[m_i]`` under the factorised Gaussian truncated to "not all negative" (Eq. 20) and
    ``log Z`` per bag: ``E[m_i] = μ_i + σ_i exp(log r(α_i) + log p₀ − log Z)`` (``log_q``:
    ``log Φ(−α)``, if known)."""
    alpha = mean / sd
    log_q = log_ndtr(-alpha) if log_q is None else log_q
    log_p0, log_z = positive_bag_log_normaliser(alpha, offsets, log_q)
    sizes = np.diff(offsets)
    shift = np.exp(log_inverse_mills(alpha, log_q) + np.repeat(log_p0 - log_z, sizes))
    return mean + sd * shift, log_z
