"""Multivariate-normal orthant probabilities ``P(m < 0)`` for the bag prediction of VGPMIL-PR-I
(seed 002 Eq. 23–26).

* :func:`log_orthant_probability_exact` — small bags: scipy's ``multivariate_normal.cdf``
  (Genz's quasi-Monte-Carlo integration, absolute error ≤ ``abseps``) on the dense covariance.
* :func:`orthant_probability_importance` — any bag size, cost linear in the nonzeros of a sparse
  Cholesky factor. The predictive ``m* = Σ f* + η`` with ``f* ~ N(μ_f, diag σ_f²)`` and
  ``η ~ N(0, Σ)``, so ``P(m* < 0) = E_f[P(m* < 0 | f*)]`` where ``m* | f* ~ N(Σ f*, Σ)`` has the
  *sparse* precision ``P = I + λC = L Lᵀ``. For each draw ``f_l``, ``P(m* < 0 | f_l)`` is
  estimated by the GHK simulator (Geweke–Hajivassiliou–Keane) run on ``Lᵀ``: instances are drawn
  one at a time, each from its conditional truncated to ``m_i < 0``, and the weight is the product
  of the conditional probabilities ``Φ(c_i)``. The weight is unbiased for ``P(m* < 0)`` (``n_inner``
  weights per draw); its standard error comes from the spread of the per-draw means, and the
  variance decomposition ``Var(w̄_l) − E[Var_k(w)]/n_inner`` estimates the posterior spread of
  ``P(m* < 0 | f*)``. All products are in log space. (An earlier version used the mean-field fit
  as an importance proposal; on a 30×30 grid with λ = 1 it was wrong by ~25 nats, GHK by < 10⁻³.)
* :func:`mean_field_negative_orthant` — the factorised fit used during training, with its lower
  bound on ``log P(m < 0)``; :func:`mean_field_gap` is the bound's error in the certain limit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
from scipy.special import log_ndtr
from scipy.stats import multivariate_normal

from .bags import segment_sum
from .ising import CARCoupling, sparse_lu
from .predictive import sample_latent
from .truncnorm import sample_upper_truncated, upper_truncated_entropy, upper_truncated_moments

__all__ = [
    "log_orthant_probability_exact",
    "mean_field_gap",
    "mean_field_negative_orthant",
    "OrthantEstimate",
    "orthant_probability_importance",
]

_LOG_2PI = np.log(2.0 * np.pi)


def log_orthant_probability_exact(
    mean: np.ndarray, cov: np.ndarray, rng: np.random.Generator | None = None, abseps: float = 1e-7
) -> float:
    """``log P(m < 0)`` for ``m ~ N(mean, cov)`` by scipy (Genz), for small dimensions.

    Genz's algorithm is a randomised quasi-Monte Carlo rule: ``rng`` seeds it, so a seeded
    estimator gives the same probabilities on every call (error ≤ ``abseps`` either way)."""
    mean = np.asarray(mean, dtype=np.float64)
    if mean.shape[0] == 1:
        return float(log_ndtr(-mean[0] / np.sqrt(cov[0, 0])))
    p = multivariate_normal.cdf(
        np.zeros_like(mean), mean=mean, cov=cov, abseps=abseps, releps=1e-6, maxpts=20000 * mean.shape[0], rng=rng
    )
    return float(np.log(max(p, 1e-300)))


def mean_field_negative_orthant(
    coupling: CARCoupling,
    mu: np.ndarray,
    start: np.ndarray,
    logdet_precision: np.ndarray,
    tol: float = 1e-12,
    max_sweeps: int = 500,
) -> tuple[np.ndarray, np.ndarray]:
    """Factorised ``q(m) = Π q(m_i)`` closest (KL(q‖p)) to ``N(μ, P⁻¹)`` truncated to ``m < 0``.

    Coordinate ascent on ``q(m_i) = N(μ_i + (λ/P_ii)Σ_{j~i}(E m_j − μ_j), 1/P_ii)`` truncated,
    a whole parity colour class at a time (an independent set, so this is exact coordinate
    ascent), until the largest change is ≤ ``tol``. ``mu`` is (n,) or (n, L) (L problems at once).

    Returns ``E_q[m]`` and, per bag, the lower bound
    ``log p₀ ≥ E_q[log N(m; μ, P⁻¹)] + H[q]`` on the log orthant probability.
    """
    P = coupling.precision
    pdiag = P.diagonal()
    sd = 1.0 / np.sqrt(pdiag)
    shape = (-1,) + (1,) * (mu.ndim - 1)
    off_diagonal = (sp.diags(pdiag) - P).tocsr()  # λ·adjacency
    classes = [(rows, off_diagonal[rows]) for rows in coupling.colour_classes()]
    e = np.array(start, dtype=np.float64, copy=True)
    if e.shape != mu.shape:
        e = np.broadcast_to(e.reshape(shape), mu.shape).copy()
    cond = mu.copy()
    for _ in range(max_sweeps):
        change = 0.0
        for rows, coupling_rows in classes:
            cond[rows] = mu[rows] + (coupling_rows @ (e - mu)) / pdiag[rows].reshape(shape)
            new, _ = upper_truncated_moments(cond[rows], sd[rows].reshape(shape))
            change = max(change, float(np.max(np.abs(new - e[rows]))) if new.size else 0.0)
            e[rows] = new
        if change <= tol:
            break
    _, var = upper_truncated_moments(cond, sd.reshape(shape))
    d = e - mu
    quad = d * (P @ d) + pdiag.reshape(shape) * var
    entropy = upper_truncated_entropy(cond, sd.reshape(shape))
    per_instance = -0.5 * quad - 0.5 * _LOG_2PI + entropy
    offsets = coupling.offsets
    return e, segment_sum(per_instance, offsets) + 0.5 * logdet_precision.reshape(shape)


def mean_field_gap(coupling: CARCoupling, logdet_precision: np.ndarray) -> np.ndarray:
    """Per bag ``½(Σ_i log P_ii − log det P) ≥ 0`` (Hadamard): ``KL(Π_i N(μ_i, 1/P_ii) ‖ N(μ, P⁻¹))``.

    When the orthant is certain (``μ → −∞``) the truncation vanishes, the mean-field fit becomes
    that untruncated product and its bound tends to ``log p₀ = −gap`` instead of 0. Adding the gap
    back (and clipping at 0) is exact in that limit and no longer a bound elsewhere; on a 4×4 grid
    at λ = 3 it cut the largest error in ``p₀`` from 0.82 to 0.20 (``tests/test_probit_numerics.py``).
    """
    log_pdiag = np.log(coupling.precision.diagonal())
    return 0.5 * (segment_sum(log_pdiag, coupling.offsets) - np.asarray(logdet_precision))


@dataclass(frozen=True)
class OrthantEstimate:
    """``log_p`` (the estimate of ``log P(m < 0)``), ``std_error`` of ``P``, ``spread`` (posterior
    sd of ``P(m < 0 | f)`` over ``f``), ``ess`` (effective sample size of the weights)."""

    log_p: float
    std_error: float
    spread: float
    ess: float


def sparse_cholesky(precision: sp.spmatrix) -> tuple[sp.csc_matrix, np.ndarray]:
    """``(L, order)`` with ``P[order][:, order] = L Lᵀ``, ``L`` sparse lower triangular, from the
    SuperLU factor of the SPD ``P`` (symmetric ordering, no pivoting: ``U = D L̂ᵀ``, ``L = L̂ D^½``)."""
    lu = sparse_lu(precision)
    return (lu.L @ sp.diags(np.sqrt(lu.U.diagonal()))).tocsc(), np.argsort(lu.perm_c)


def orthant_probability_importance(
    mean_f: np.ndarray,
    var_f: np.ndarray,
    coupling: CARCoupling,
    *,
    n_draws: int = 256,
    n_inner: int = 4,
    rng: np.random.Generator,
) -> OrthantEstimate:
    """GHK estimate of ``P(m* < 0)`` for one bag whose coupling is ``coupling`` (module docstring)."""
    chol, order = sparse_cholesky(coupling.precision)
    f = sample_latent(mean_f, var_f, n_draws, rng)
    mu = np.repeat(coupling.solve(f)[order], n_inner, axis=1)
    log_w = _ghk_log_weights(chol, mu, rng).reshape(n_draws, n_inner)
    top = float(np.max(log_w))
    w = np.exp(log_w - top)
    per_draw = w.mean(axis=1)
    log_p = top + float(np.log(per_draw.mean()))
    scale = np.exp(top)
    std_error = float(scale * per_draw.std(ddof=1) / np.sqrt(n_draws))
    within = w.var(axis=1, ddof=1).mean() / n_inner if n_inner > 1 else 0.0
    spread = float(scale * np.sqrt(max(per_draw.var(ddof=1) - within, 0.0)))
    ess = float(w.sum() ** 2 / np.sum(w**2))
    return OrthantEstimate(log_p=min(log_p, 0.0), std_error=std_error, spread=spread, ess=ess)


def _ghk_log_weights(chol: sp.csc_matrix, mu: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Log GHK weights of ``P(m < 0)``, ``m ~ N(μ, (L Lᵀ)⁻¹)``, one per column of ``mu`` (n, K).

    ``m − μ = L⁻ᵀz``, ``z ~ N(0, I)``: back-substitution from the last row gives
    ``d_i = (z_i − s_i)/L_ii`` with ``s_i = Σ_{j>i} L_ji d_j``, so ``m_i < 0`` ⇔
    ``z_i < c_i = s_i − L_ii μ_i``; draw ``z_i`` from ``N(0, 1)`` truncated there and multiply the
    weight by ``Φ(c_i)``. Cost: one pass over the nonzeros of ``L`` per column.
    """
    n, k = mu.shape
    indptr, indices, data = chol.indptr, chol.indices, chol.data
    d = np.zeros((n, k))
    log_w = np.zeros(k)
    for i in range(n - 1, -1, -1):
        lo, hi = indptr[i], indptr[i + 1]
        rows, vals = indices[lo:hi], data[lo:hi]
        below = rows > i
        diag = vals[~below][0]
        s = vals[below] @ d[rows[below]] if np.any(below) else np.zeros(k)
        c = s - diag * mu[i]
        log_w += log_ndtr(c)
        z = c + sample_upper_truncated(-c, np.ones(k), rng)  # N(0, 1) truncated to z < c
        d[i] = (z - s) / diag
    return log_w
