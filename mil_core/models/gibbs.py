"""The exact-posterior Gibbs sampler of the probit GP-MIL model (seed 003, §2), with the Ising/CAR
coupling of seed 002 (Eq. 12) when λ > 0: a slow gold standard for VGPMIL-PR(-I) on small data.

Target: ``p(v, m | y)`` for ``v ~ N(0, I)`` (whitened ``u = Lv``), ``m_b | v ~ N(Σ_b A'_b v, Σ_b)``
and the hard MIL bag likelihood — the model whose mean-field posterior the variational fit
approximates (the FITC residual only adds a constant to its ELBO). Alternating exact conditionals:

* ``v | m ~ N((I + G')⁻¹ A'ᵀm, (I + G')⁻¹)``, ``G' = Σ_b A'_bᵀΣ_bA'_b`` (seed 003 Eq. 7–9 with
  ``q(m)`` a point mass);
* ``m_i | m_{−i}, v, y``: the Gaussian conditional ``N(μ_i + (λ/P_ii)Σ_{j~i}(m_j − μ_j), 1/P_ii)``
  (``μ = Σ_b A'_b v``, ``P = I + λC``), truncated to ``m_i < 0`` in a negative bag; in a positive
  bag truncated to ``m_i ≥ 0`` when all other instances of the bag are negative, else
  unconstrained (seed 003 Eq. 13–14). Instance ``k`` of every bag is updated at once (bags are
  conditionally independent given ``v``), instances of a bag one after another.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.linalg
import scipy.sparse

from .._backend import take_rows
from ..bags import segment_sum
from ..engine import BagBlock, GaussianQ
from ..ising import Neighbourhood
from ..kernels import RBF
from ..truncnorm import sample_upper_truncated
from ..validation import check_mil_data
from .base import store_params
from .probit import VGPMILPRI

__all__ = ["VGPMILPRGibbs"]


class VGPMILPRGibbs(VGPMILPRI):
    """Gibbs sampler for probit GP-MIL (λ = 0: the model of VGPMIL-PR; λ > 0: VGPMIL-PR-I).

    Same inducing points as the variational estimators with the same ``n_inducing`` and
    ``random_state`` (k-means on the training instances), and the same prediction methods,
    applied to the Gaussian ``q_`` moment-matched to the posterior samples of ``v``.

    Parameters
    ----------
    lam, neighbourhood, n_inducing, kernel, exact_diag_max, diag_tol, exact_orthant_max, n_mc_samples
        As in :class:`~mil_core.models.probit.VGPMILPRI` (``lam=0`` by default here).
    n_samples : int, default=2000
        Kept samples.
    burn_in : int, default=500
        Sweeps discarded first.
    thin : int, default=1
        Keep every ``thin``-th sweep after burn-in.
    random_state : int or None
        Seed of k-means and of the sampler.

    Attributes
    ----------
    v_samples_ : ndarray (n_samples, M)
        Posterior samples of the whitened inducing values.
    q_ : GaussianQ
        Their mean and covariance.
    m_mean_ : ndarray (N,)
        Posterior mean of ``m`` for each training instance, in the input row order.
    gp_, kernel_, n_features_in_, classes_
    """

    def __init__(
        self,
        *,
        lam: float = 0.0,
        neighbourhood: Neighbourhood = 4,
        n_inducing: int = 100,
        kernel: RBF | None = None,
        n_samples: int = 2000,
        burn_in: int = 500,
        thin: int = 1,
        exact_diag_max: int = 2000,
        diag_tol: float = 1e-6,
        exact_orthant_max: int = 12,
        n_mc_samples: int = 500,
        random_state: int | None = None,
    ):
        store_params(self, locals())

    # the shared parameter checks of the base class read these
    max_iter, tol, early_stopping, moments = 1, 0.0, False, "diagonal"
    learn_lam, coupling_form = False, "ising"

    def fit(self, X: Any, bag_ids: Any, y: Any, coords: Any | None = None) -> VGPMILPRGibbs:
        """Sample the posterior given instances, bag ids, per-instance bag labels (and coords)."""
        if not (self.n_samples >= 1 and self.burn_in >= 0 and self.thin >= 1):
            raise ValueError(f"need n_samples >= 1, burn_in >= 0, thin >= 1; got {self.n_samples}, {self.burn_in}, {self.thin}")
        X, bags, labels = check_mil_data(X, bag_ids, y)
        self._check_common_params(X.shape[0])
        coords_sorted = self._check_coords(coords, bags)
        X_sorted = take_rows(X, bags.order)
        offsets = bags.offsets
        updates = self._start_fit(X_sorted, np.repeat(labels, np.diff(offsets)))
        block = updates.prepare(BagBlock(X=X_sorted, offsets=offsets, labels=labels, coords=coords_sorted))
        samples, m_mean = _run_sampler(block, self.n_samples, self.burn_in, self.thin, np.random.default_rng(self.random_state))
        self.v_samples_ = samples
        self.q_ = GaussianQ(mean=samples.mean(axis=0), cov=np.atleast_2d(np.cov(samples, rowvar=False)))
        self.m_mean_ = np.empty_like(m_mean)
        self.m_mean_[bags.order] = m_mean
        return self


def _run_sampler(block, n_samples: int, burn_in: int, thin: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The Gibbs chain on one prepared block (module docstring); returns kept ``v`` samples and
    the posterior mean of ``m`` (block row order)."""
    features = block.features  # A' stays where it is; A'v and A'ᵀm are its only products
    M = features.A.shape[1]
    offsets, labels = block.offsets, block.labels
    sizes = np.diff(offsets)
    coupling = block.coupling
    P = coupling.precision
    pdiag = P.diagonal()
    cond_sd = 1.0 / np.sqrt(pdiag)
    off_diagonal = (scipy.sparse.diags(pdiag) - P).tocsr()
    steps = []
    for k in range(int(sizes.max())):
        has = sizes > k
        rows = offsets[:-1][has] + k
        steps.append((rows, np.flatnonzero(has), off_diagonal[rows]))
    chol = np.linalg.cholesky(np.eye(M) + block.gram)
    positive_bag = labels == 1
    # a valid start: negatives below zero, one instance of each positive bag above
    m = np.full(int(offsets[-1]), -0.5)
    m[offsets[:-1][positive_bag]] = 0.5
    n_nonneg = segment_sum((m >= 0).astype(np.int64), offsets)
    v = np.zeros(M)
    kept, m_sum = [], np.zeros_like(m)
    for sweep in range(burn_in + n_samples * thin):
        mu = coupling.solve(features.latent_mean(v))
        for rows, bag, coupling_rows in steps:
            mean = mu[rows] + (coupling_rows @ (m - mu)) / pdiag[rows]
            sd = cond_sd[rows]
            was_nonneg = m[rows] >= 0
            others_nonneg = n_nonneg[bag] - was_nonneg
            pos = positive_bag[bag]
            must_be_positive = pos & (others_nonneg == 0)
            free = pos & (others_nonneg > 0)
            draw = sample_upper_truncated(mean, sd, rng)  # negative bags
            flipped = -sample_upper_truncated(-mean, sd, rng)  # m ≥ 0
            normal = mean + sd * rng.standard_normal(mean.shape)
            new = np.where(must_be_positive, flipped, np.where(free, normal, draw))
            n_nonneg[bag] += (new >= 0).astype(np.int64) - was_nonneg
            m[rows] = new
        shift = features.project(m)
        mean_v = scipy.linalg.cho_solve((chol, True), shift)
        v = mean_v + scipy.linalg.solve_triangular(chol.T, rng.standard_normal(M), lower=False)
        if sweep >= burn_in and (sweep - burn_in) % thin == 0:
            kept.append(v.copy())
            m_sum += m
    return np.asarray(kept), m_sum / len(kept)
