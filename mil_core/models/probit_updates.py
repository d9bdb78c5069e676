"""VGPMIL-PR and VGPMIL-PR-I: probit GP-MIL with augmented variables and the Ising/CAR coupling.

Model (seed 002, Sec. 2.2.2–2.3): ``m_b | f_b ~ N(Σ_b f_b, Σ_b)``, ``Σ_b = (λC_b + I)⁻¹`` (Eq. 12;
``Σ_b = I`` is VGPMIL-PR, Eq. 6), ``h_i = 1[m_i > 0]``, hard MIL bag likelihood (Eq. 1, 7).
Mean-field ``q(v) q(m)`` (Eq. 13–18), whitened (DESIGN §1):

* ``G' = Σ_b A'_bᵀ Σ_b A'_b`` — constant, computed once per partition in :meth:`prepare` (Eq. 16);
* per iteration ``μ^{m_b} = Σ_b A'_b m'`` (one sparse solve per partition, Eq. 18), ``E[m_b]`` from
  the truncated Gaussian ``q(m_b) ∝ N(m_b; μ^{m_b}, Σ_b) p(y_b | m_b)`` (Eq. 15), and
  ``r' = Σ_b A'_bᵀ E[m_b]`` (Eq. 17);
* client: ``S' = (I + G')⁻¹``, ``m' = S' r'``.

``E[m_b]`` (``moments=``):

* ``"diagonal"`` (the paper's choice, Eq. 19–20): ``N(μ, diag Σ_b)`` instead of ``N(μ, Σ_b)``,
  univariate truncated moments and the positive-bag normaliser ``Z = 1 − Π Φ(−μ_i/σ_i)``;
* ``"mean_field"``: the optimal *factorised* ``q(m_b) = Π q(m_i)`` for the exact truncated
  ``N(μ, Σ_b)`` on the negative orthant (coordinate ascent: ``q(m_i)`` is ``N(μ_i + (λ/P_ii)
  Σ_{j~i}(E m_j − μ_j), 1/P_ii)`` truncated to ``m_i < 0``, run to a fixed point over the parity
  colour classes), with ``log p₀`` (orthant probability) by its mean-field lower bound plus the
  bound's gap in the certain limit (:func:`~mil_core.orthant.mean_field_gap`), so that a clearly
  negative bag gets ``p₀ → 1`` rather than the bound's ``e^{−gap}``. A
  positive bag's ``q`` is ``N(μ, Σ_b)`` restricted to "not all negative", whose mean is exactly
  ``(μ − p₀ E_neg[m]) / (1 − p₀)``; it is evaluated with those two approximations. It keeps the
  correlation between neighbours that the diagonal approximation drops (``docs/BENCHMARKS.md``,
  "Probit family", measures both against the exact moments).

For λ = 0 (or a bag without contiguous instances) both are exact and identical. The tracked
objective is the ELBO ``Σ_b log Z_b − ½ tr(S'G') − ½ Σ_i (Σ_b)_ii Var_FITC,i − KL(q(v) ‖ p(v))``
with ``log Z_b`` the log normaliser of ``q(m_b)`` under the chosen moment approximation; for
λ = 0 it is the exact ELBO and never decreases.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np
from scipy.special import log_ndtr

from .._backend import array_namespace, to_numpy
from ..bags import segment_sum
from ..engine import BagBlock, GaussianQ, SparseGP, Summable, WhitenedBlock, gaussian_update, transposed_product
from ..ising import CARCoupling, Neighbourhood
from ..orthant import mean_field_gap, mean_field_negative_orthant
from ..truncnorm import log1mexp, positive_bag_means, upper_truncated_moments

__all__ = ["Moments", "CouplingForm", "ProbitBags", "ProbitStats", "ProbitMILUpdates"]

Moments = Literal["diagonal", "mean_field"]
CouplingForm = Literal["ising", "smoother"]


@dataclass(frozen=True)
class ProbitBags:
    """A prepared partition: whitened features, bag structure, the coupling ``Σ`` and what does
    not change across iterations (``diag Σ``, ``log det P_b``, the mean-field gap, ``G'_p``)."""

    features: WhitenedBlock
    offsets: np.ndarray
    labels: np.ndarray
    coupling: CARCoupling
    marginal_var: np.ndarray
    logdet_precision: np.ndarray
    mean_field_gap: np.ndarray
    gram: np.ndarray
    fitc_trace: float

    @property
    def instance_labels(self) -> np.ndarray:
        return np.repeat(self.labels, np.diff(self.offsets))


@dataclass(frozen=True)
class ProbitStats(Summable):
    """A partition's contribution: ``G'_p`` (constant), ``r'_p = Σ A'ᵀE[m]``, ELBO data terms."""

    precision: np.ndarray
    shift: np.ndarray
    elbo: float
    n_instances: int


@dataclass(frozen=True)
class ProbitMILUpdates:
    """Partition step and global update of VGPMIL-PR(-I). The local state of a partition is the
    mean-field ``E[m]`` on the negative orthant (the warm start of ``moments="mean_field"``)."""

    gp: SparseGP
    lam: float = 0.0
    neighbourhood: Neighbourhood = 4
    moments: Moments = "diagonal"
    exact_diag_max: int = 2000
    diag_tol: float = 1e-6
    mean_field_tol: float = 1e-12
    mean_field_max_sweeps: int = 500
    coupling_form: CouplingForm = "ising"

    def prepare(self, block: BagBlock) -> ProbitBags:
        if self.lam > 0 and block.coords is None:
            raise ValueError("VGPMIL-PR-I with lam > 0 needs instance coords (fit(X, bag_ids, y, coords=...))")
        features = self.gp.whiten(block.X)
        coupling = CARCoupling.from_coords(block.coords, np.asarray(block.offsets), self.lam, self.neighbourhood)
        if coupling.identity:
            ones = np.ones(block.n_instances)
            return self.assemble(features, block, coupling, ones, np.zeros(len(block.offsets) - 1), features.weighted_gram(ones), ones)
        xp = array_namespace(features.A)
        A = xp.astype(features.A, xp.float64)  # the one-off G'_p in float64 also for float32 A'
        smoothed = coupling.solve(A)  # Σ A' where A' lives (N × M never leaves the device)
        if self.coupling_form == "smoother":  # noise I; Var f weighted by diag Σ²; G' = (ΣA')ᵀ(ΣA')
            ones = np.ones(block.n_instances)
            return self.assemble(features, block, coupling, ones, np.zeros(len(block.offsets) - 1), transposed_product(smoothed, smoothed),
                                 coupling.squared_diagonal(self.exact_diag_max))
        marginal_var, _, logdet = coupling.diagonal(self.exact_diag_max, self.diag_tol)
        return self.assemble(features, block, coupling, marginal_var, logdet, transposed_product(A, smoothed), marginal_var)

    def assemble(
        self, features: WhitenedBlock, block: BagBlock, coupling: CARCoupling, noise_var: np.ndarray,
        logdet_precision: np.ndarray, gram: np.ndarray, fitc_weight: np.ndarray,
    ) -> ProbitBags:
        """A prepared partition from its parts: ``noise_var`` = ``diag Cov(m | f)`` (``diag Σ_b``,
        or 1 for the smoother form), ``log det`` of the noise precision per bag, ``G'_p`` and the
        weights of the FITC residual in the ELBO (``diag Σ_b``, or ``diag Σ_b²``)."""
        return ProbitBags(
            features=features,
            offsets=np.asarray(block.offsets),
            labels=np.asarray(block.labels),
            coupling=coupling,
            marginal_var=noise_var,
            logdet_precision=logdet_precision,
            mean_field_gap=mean_field_gap(coupling, logdet_precision),
            gram=0.5 * (gram + gram.T),
            fitc_trace=float(np.sum(fitc_weight * to_numpy(features.resid))),
        )

    def init_local(self, block: ProbitBags) -> np.ndarray:
        return np.zeros(int(block.offsets[-1]))

    def init_global(self) -> GaussianQ:
        return GaussianQ.prior(self.gp.n_inducing)

    def partition_step(self, block: ProbitBags, warm: np.ndarray, q: GaussianQ) -> tuple[ProbitStats, np.ndarray]:
        mu = block.coupling.solve(block.features.latent_mean(q.mean))  # Eq. 18
        expected_m, log_z, warm = self.truncated_means(block, mu, warm)
        elbo = np.sum(log_z) - 0.5 * float(np.sum(q.cov * block.gram)) - 0.5 * block.fitc_trace
        if self.coupling_form == "smoother":  # E[mᵀΣf] = (ΣE[m])ᵀA'v
            expected_m = block.coupling.solve(expected_m)
        stats = ProbitStats(
            precision=block.gram,
            shift=block.features.project(expected_m),
            elbo=float(elbo),
            n_instances=int(mu.shape[0]),
        )
        return stats, warm

    def truncated_means(self, block: ProbitBags, mu: np.ndarray, warm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``E[m]`` of ``q(m_b)`` (Eq. 15, 19–20), ``log Z_b`` per bag and the new warm start."""
        offsets, labels = block.offsets, block.labels
        positive = np.repeat(labels == 1, np.diff(offsets))
        if self.moments == "diagonal" or self.coupling_form == "smoother" or block.coupling.identity:
            sd = np.sqrt(block.marginal_var)
            neg_mean, _ = upper_truncated_moments(mu, sd)
            pos_mean, log_z_pos = positive_bag_means(mu, sd, offsets)
            log_z_neg = segment_sum(log_ndtr(-mu / sd), offsets)
            return np.where(positive, pos_mean, neg_mean), np.where(labels == 1, log_z_pos, log_z_neg), neg_mean
        neg_mean, log_p0_bound = mean_field_negative_orthant(
            block.coupling, mu, warm, block.logdet_precision, self.mean_field_tol, self.mean_field_max_sweeps
        )
        log_p0 = np.minimum(log_p0_bound + block.mean_field_gap, 0.0)
        log_z_pos = log1mexp(np.log(np.maximum(-log_p0, 1e-300)))
        ratio = np.repeat(np.exp(log_p0 - log_z_pos), np.diff(offsets))
        pos_mean = mu + ratio * (mu - neg_mean)
        return np.where(positive, pos_mean, neg_mean), np.where(labels == 1, log_z_pos, log_p0), neg_mean

    def global_update(self, stats: ProbitStats, q: GaussianQ) -> tuple[GaussianQ, float]:
        """New q(v) (Eq. 16–17, whitened) and the ELBO of the state the statistics came from."""
        return gaussian_update(stats.precision, stats.shift), stats.elbo - q.kl_to_prior()
