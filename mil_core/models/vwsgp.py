"""VWSGP: the variational weakly supervised GP (seed 001, Sec. 3).

Model: instance evidences ``fₙ`` follow a sparse (FITC) GP; a bag's label depends on their sum,
``T_b ~ Bernoulli(σ(s_b))`` with ``s_b = Σ_{n∈b} fₙ``. With the Jaakkola bound and one
parameter ξ_b per bag every update is closed form. In the whitened parametrisation
(DESIGN §1, ``ā'_b = Σ_{n∈b} a'ₙ``):

* ``E s_b = ā'_bᵀm'``, ``E s_b² = (E s_b)² + ā'_bᵀS'ā'_b + Σ_{n∈b}(k(xₙ,xₙ) − ‖a'ₙ‖²)``
* ``ξ_b = sqrt(E s_b²)``                                         (the ξ_b² update of Sec. 3)
* ``G' += Σ_b 2λ(ξ_b) ā'_bā'_bᵀ``, ``r' += Σ_b (T_b − ½) ā'_b``
* client: ``S' = (I + G')⁻¹``, ``m' = S' r'``                     (the S and m updates of Sec. 3)

Only bag sums of the whitened features enter, so a partition reduces its instances to one
M-vector per bag once (in :meth:`VWSGPUpdates.prepare`); an iteration then costs O(B·M²).

The evidences are *not* instance labels: the likelihood accumulates them, so an instance's
evidence says how much it pushes its bag towards the positive class, on a scale that depends
on the bag's size (seed 001, Sec. 3 and Sec. 5). The model predicts bag labels only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from scipy.special import expit

from .._backend import array_namespace, like, take_rows, to_numpy
from ..bags import segment_sum
from ..engine import BagBlock, GaussianQ, SparseGP, Summable, gaussian_update
from ..kernels import RBF
from ..likelihoods import HyperbolicSecant
from ..predictive import bag_generators, probit_scale, sample_latent_bags
from .base import SparseGPMILBase, store_params

__all__ = ["BagEvidence", "EvidenceStats", "VWSGPUpdates", "VWSGP"]

_JAAKKOLA = HyperbolicSecant()  # θ(ξ) = tanh(ξ/2)/(2ξ) = 2λ(ξ); log ψ(ξ) = log σ(ξ) − ξ/2


def _bag_sums(values: Any, offsets: np.ndarray) -> np.ndarray:
    """Per-bag sums of the rows of ``values`` as host float64.

    NumPy: :func:`~mil_core.bags.segment_sum` (each bag summed on its own, so a bag's sum does
    not depend on the block it is in). Other namespaces: differences of a cumulative sum.
    """
    if isinstance(values, np.ndarray):
        return segment_sum(np.asarray(values, dtype=np.float64), offsets)
    xp = array_namespace(values)
    cumulative = xp.cumulative_sum(xp.astype(values, xp.float64), axis=0, include_initial=True)
    idx = like(np.asarray(offsets, dtype=np.int64), values)
    return to_numpy(xp.take(cumulative, idx[1:], axis=0) - xp.take(cumulative, idx[:-1], axis=0))


@dataclass(frozen=True)
class BagEvidence:
    """A prepared block: per-bag sums of whitened features ``ā'_b`` (B, M), of FITC residual
    variances (B,), and the bag labels (B,), all host float64."""

    features: np.ndarray
    residual: np.ndarray
    labels: np.ndarray

    def evidence_moments(self, q: GaussianQ) -> tuple[np.ndarray, np.ndarray]:
        """``E s_b`` and ``Var s_b = ā'ᵀS'ā' + Σ residuals`` under q (the exact bag-sum moments)."""
        mean = self.features @ q.mean
        var = np.sum((self.features @ q.cov) * self.features, axis=1) + self.residual
        return mean, np.maximum(var, 0.0)


@dataclass(frozen=True)
class EvidenceStats(Summable):
    """A partition's contribution: ``G' = Σ_b 2λ(ξ_b) ā'ā'ᵀ``, ``r' = Σ_b (T_b − ½) ā'``, the
    Jaakkola data term of the ELBO, and the number of bags."""

    precision: np.ndarray
    shift: np.ndarray
    elbo: float
    n_bags: int


@dataclass(frozen=True)
class VWSGPUpdates:
    """Partition step and global update of VWSGP. The local state of a block is ξ_b per bag
    (recomputed from q in every step; kept for inspection)."""

    gp: SparseGP

    def prepare(self, block: BagBlock) -> BagEvidence:
        whitened = self.gp.whiten(block.X)
        return BagEvidence(
            features=_bag_sums(whitened.A, block.offsets),
            residual=_bag_sums(whitened.resid, block.offsets),
            labels=np.asarray(block.labels, dtype=np.float64),
        )

    def init_local(self, block: BagEvidence) -> np.ndarray:
        return np.zeros(block.labels.shape[0])

    def init_global(self) -> GaussianQ:
        return GaussianQ.prior(self.gp.n_inducing)

    def partition_step(self, block: BagEvidence, xi: np.ndarray, q: GaussianQ) -> tuple[EvidenceStats, np.ndarray]:
        """ξ_b for the current q, then the statistics of the S, m updates (Sec. 3).

        The ELBO term per bag is the Jaakkola bound at its optimal ξ_b:
        ``(T_b − ½) E s_b + log σ(ξ_b) − ξ_b/2`` (the quadratic term vanishes at ξ_b² = E s_b²).
        """
        mean, var = block.evidence_moments(q)
        xi = np.sqrt(mean**2 + var)
        shift_weights = block.labels - 0.5
        stats = EvidenceStats(
            precision=block.features.T @ (block.features * _JAAKKOLA.theta(xi)[:, None]),
            shift=block.features.T @ shift_weights,
            elbo=float(np.sum(shift_weights * mean + _JAAKKOLA.log_psi(xi))),
            n_bags=int(xi.shape[0]),
        )
        return stats, xi

    def global_update(self, stats: EvidenceStats, q: GaussianQ) -> tuple[GaussianQ, float]:
        """New q(v) (whitened S and m updates) and the ELBO of the state the statistics came from.

        Both the ξ step and the q step maximise the bound exactly, so the ELBO never decreases.
        """
        return gaussian_update(stats.precision, stats.shift), stats.elbo - q.kl_to_prior()


class VWSGP(SparseGPMILBase):
    """Variational weakly supervised GP (seed 001, Sec. 3): the bag label is Bernoulli with
    probability σ(Σ fₙ) over the bag's instance evidences fₙ (sparse FITC GP prior), fitted by
    the closed-form updates of S, m and ξ_b.

    Parameters
    ----------
    n_inducing : int, default=100
        Number of inducing points M (k-means, half from each bag class). A training set with
        fewer instances makes every instance one (the exact GP); a warning says so when
        ``n_inducing`` is not the default.
    kernel : RBF or None
        Kernel; ``None`` chooses the variance of ``RBF(v, length_scale=√D)`` (the paper's ℓ = √D) and
        the number of sweeps on the training bags (:meth:`~mil_core.models.base.SparseGPMILBase._select_kernel`).
    standardize : bool, default=True
        Fit and predict on features standardised with the training instances' mean and scale,
        ``feature_mean_`` / ``feature_scale_`` (:class:`~mil_core.models.base.FeatureStandardisation`).
    max_iter, tol
        Closed-form sweeps (the paper uses 10–50) and relative ELBO tolerance.
    early_stopping, validation_fraction, n_iter_no_change
        Validation bag-AUC early stopping with patience; the best iterate is kept.
    block_size
        Instances per partition of whole bags (results do not depend on it).
    n_mc_samples
        Monte Carlo draws for predictions (the paper: "a small sample set (e.g. 100) suffices").
    random_state
        Seed for k-means, the validation split and Monte Carlo.

    Attributes
    ----------
    gp_ : SparseGP
    q_ : GaussianQ
        Whitened q(v) = N(m', S'); u = L v.
    elbo_ : ndarray
        The Jaakkola ELBO per iteration (a lower bound on log p(T | X); never decreases).
    n_iter_, converged_, kernel_, n_features_in_, classes_, feature_mean_, feature_scale_
    validation_auc_, best_iteration_
        When ``early_stopping``.

    Notes
    -----
    There is no ``predict_instance_proba``: the per-instance quantities are evidences (additive
    contributions to the bag logit), not instance labels; see :meth:`predict_instance_evidence`.
    """

    def __init__(
        self,
        *,
        n_inducing: int = 100,
        kernel: RBF | None = None,
        standardize: bool = True,
        max_iter: int = 50,
        tol: float = 1e-6,
        early_stopping: bool = False,
        validation_fraction: float = 0.2,
        n_iter_no_change: int = 10,
        block_size: int = 65536,
        n_mc_samples: int = 500,
        random_state: int | None = None,
    ):
        store_params(self, locals())

    def _make_updates(self, gp: SparseGP) -> VWSGPUpdates:
        return VWSGPUpdates(gp=gp)

    def _evidence_moments(self, gp: SparseGP, glob: GaussianQ, X_sorted: Any, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Bag-evidence mean and variance under the paper's diagonal predictive
        ``N(f* | A*m, diag(Λ* + A*SA*ᵀ))``: ``Σ μₙ`` and ``Σ σₙ²``."""
        mean, var = gp.whiten(X_sorted).latent_moments(glob)
        return segment_sum(mean, offsets), segment_sum(var, offsets)

    def _bag_proba_from_state(self, gp: SparseGP, glob: GaussianQ, X_sorted: Any, offsets: np.ndarray) -> np.ndarray:
        mean, var = self._evidence_moments(gp, glob, X_sorted, offsets)
        return expit(probit_scale(mean, var))

    def predict_instance_evidence(self, X: Any, *, return_std: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Each instance's evidence ``E f*ₙ = a*ₙᵀm`` (its mean contribution to the bag logit),
        and its predictive std ``sqrt(Λ*ₙ + a*ₙᵀSa*ₙ)`` when ``return_std``.

        Evidences are not instance labels (seed 001, Sec. 3): they add up within a bag, so
        their scale depends on the bag size and only their sum is calibrated.
        """
        mean, var = self.predict_latent(X)
        return (mean, np.sqrt(var)) if return_std else mean

    def predict_bag_proba(
        self, X: Any, bag_ids: Any, *, return_std: bool = False, method: Literal["mc", "probit"] = "probit"
    ) -> tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Bag probability ``p(T* = 1) = E[σ(Σₙ f*ₙ)]``: ``keys, p`` or ``keys, p, std``, with
        ``keys = np.unique(bag_ids)``.

        f* follows the paper's diagonal predictive ``N(A*m, diag(Λ* + A*SA*ᵀ))`` (Sec. 3), so
        the bag evidence is ``N(Σ μₙ, Σ σₙ²)``; drawing it directly equals summing independent
        per-instance draws. ``method="probit"`` (default, as the pipeline and the kernel choice):
        ``σ(μ / sqrt(1 + πσ²/8))``; ``method="mc"``: ``n_mc_samples`` draws seeded by
        ``random_state``. The std is always the Monte Carlo
        spread of σ(s*).
        """
        if method not in ("mc", "probit"):
            raise ValueError(f"method must be 'mc' or 'probit', got {method!r}")
        X, bags = self._check_predict_input(X, bag_ids)
        mean, var = self._evidence_moments(self.gp_, self.q_, take_rows(X, bags.order), bags.offsets)
        p = expit(probit_scale(mean, var))
        if method == "probit" and not return_std:
            return bags.keys, p
        one_row_bags = np.arange(bags.n_bags + 1)  # s*_b is one latent per bag: a bag's draws its own
        samples = expit(sample_latent_bags(mean, var, one_row_bags, self.n_mc_samples, bag_generators(self.random_state, bags.keys)))
        if method == "mc":
            p = samples.mean(axis=1)
        return (bags.keys, p, samples.std(axis=1)) if return_std else (bags.keys, p)
