"""VGPMIL, ψ-VGPMIL and G-VGPMIL (seed 000): logistic GP-MIL with closed-form updates.

Model (000, Eq. 1–4, 15–22): ``p(T_b | y_b) = H^{G_b}/(H + 1)``, logistic instance likelihood
written with a Gaussian-scale-mixture ψ, sparse GP prior with inducing points. In the whitened
parametrisation (DESIGN §1) the updates Eq. 25–28 become, per partition of whole bags,

* ``cₙ = sqrt(E fₙ²)``, ``θₙ = θ(cₙ)``                                    (Eq. 28)
* ``πₙ = σ(E fₙ + log H (2T_b − 1)(1 − E[max y_{b∖n}]))``                 (Eq. 25)
* ``G' += Σ θₙ a'ₙa'ₙᵀ``, ``r' += Σ a'ₙ(πₙ − ½)``
* client: ``S' = (I + G')⁻¹``, ``m' = S' r'``                              (Eq. 26–27)

which is the reference order Θ → S → m → π shifted by half an iteration.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from scipy.special import expit
from sklearn.utils import check_random_state

from .._backend import take_rows
from ..bags import EmaxRule, expected_max_of_others, log_prob_all_negative, segment_sum
from ..engine import BagBlock, FitTrace, GaussianQ, SparseGP, Summable, WhitenedBags, gaussian_update
from ..kernels import RBF
from ..likelihoods import GammaMixture, HyperbolicSecant, Psi, as_psi
from ..predictive import probit_scale, sample_latent
from .base import SparseGPMILBase, store_params
from .hyper import HyperMILUpdates, HyperState, LogNormaliserName, hyper_updates, unwrap_hyper_state

__all__ = ["PsiMILUpdates", "PsiStats", "PsiVGPMIL", "VGPMIL", "GVGPMIL"]


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


@dataclass(frozen=True)
class PsiStats(Summable):
    """A partition's contribution: ``G' = Σ θ a'a'ᵀ``, ``r' = Σ a'(π − ½)``, ELBO data terms."""

    precision: np.ndarray
    shift: np.ndarray
    elbo: float
    n_instances: int


@dataclass(frozen=True)
class PsiMILUpdates:
    """Partition step and global update of ψ-VGPMIL. The local state of a block is the logit
    of π for each of its instances (host float64)."""

    gp: SparseGP
    psi: Psi
    log_h: float
    emax: EmaxRule

    def prepare(self, block: BagBlock) -> WhitenedBags:
        return WhitenedBags.from_block(self.gp, block)

    def init_local(self, block: WhitenedBags) -> np.ndarray:
        """π = 1/(H+1) for every instance (logit −log H); the first sweep moves the positive bags'."""
        return np.full(block.instance_labels.shape, -self.log_h)

    def init_global(self) -> GaussianQ:
        return GaussianQ.prior(self.gp.n_inducing)

    def partition_step(self, block: WhitenedBags, logits: np.ndarray, q: GaussianQ) -> tuple[PsiStats, np.ndarray]:
        mean, var = block.features.latent_moments(q)
        c = np.sqrt(mean**2 + var)
        theta = self.psi.theta(c)
        sign = 2.0 * block.instance_labels - 1.0
        emax = expected_max_of_others(expit(logits), -_softplus(logits), block.offsets, self.emax)
        logits = mean + self.log_h * sign * (1.0 - emax)
        pi, log1m_pi, log_pi = expit(logits), -_softplus(logits), -_softplus(-logits)

        p_all_negative = np.exp(log_prob_all_negative(log1m_pi, block.offsets))
        expected_g = np.where(block.labels == 1, 1.0 - p_all_negative, p_all_negative)
        elbo = (
            np.sum((pi - 0.5) * mean + self.psi.log_psi(c))  # tangent term vanishes at c = sqrt(E f²)
            + np.sum(self.log_h * expected_g - np.log1p(np.exp(self.log_h)))
            - np.sum(pi * log_pi + (1.0 - pi) * log1m_pi)  # entropy of q(y)
        )
        stats = PsiStats(
            precision=block.features.weighted_gram(theta),
            shift=block.features.project(pi - 0.5),
            elbo=float(elbo),
            n_instances=int(mean.shape[0]),
        )
        return stats, logits

    def global_update(self, stats: PsiStats, q: GaussianQ) -> tuple[GaussianQ, float]:
        """New q(v) (Eq. 26–27, whitened) and the ELBO of the state the statistics came from."""
        return gaussian_update(stats.precision, stats.shift), stats.elbo - q.kl_to_prior()


class _LogisticGPMIL(SparseGPMILBase):
    """Predictions for the logistic family (000, Eq. 30–37)."""

    @abstractmethod
    def _psi(self) -> Psi: ...

    def _make_updates(self, gp: SparseGP) -> PsiMILUpdates | HyperMILUpdates:
        if self.H <= 1:
            raise ValueError(f"H must be > 1 (the bag-likelihood odds), got {self.H}")
        if self.emax not in ("exact", "max"):
            raise ValueError(f"emax must be 'exact' or 'max', got {self.emax!r}")
        updates = PsiMILUpdates(gp=gp, psi=self._psi(), log_h=float(np.log(self.H)), emax=self.emax)
        return hyper_updates(self, updates)

    def _bag_proba_from_state(self, gp: SparseGP, glob: GaussianQ | HyperState, X_sorted: Any, offsets: np.ndarray) -> np.ndarray:
        if isinstance(glob, HyperState):
            gp, glob = glob.gp, glob.q
        mean, var = gp.whiten(X_sorted).latent_moments(glob)
        return -np.expm1(log_prob_all_negative(-_softplus(probit_scale(mean, var)), offsets))

    def _finish_fit(self, trace: FitTrace, monitor: Any = None) -> None:
        super()._finish_fit(trace, monitor)
        unwrap_hyper_state(self)

    def _instance_moments(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        return self.gp_.whiten(X).latent_moments(self.q_)

    def _sample_latent(self, mean: np.ndarray, var: np.ndarray, rng: np.random.RandomState):
        """Yield (row slice, samples (rows, L)) of f* ~ N(mean, var), in chunks of ≤ 2²² draws."""
        L = self.n_mc_samples
        chunk = max(1, (1 << 22) // L)
        for start in range(0, mean.shape[0], chunk):
            rows = slice(start, start + chunk)
            yield rows, sample_latent(mean[rows], var[rows], L, rng)

    def predict_instance_proba(
        self, X: Any, *, return_std: bool = False, method: Literal["mc", "probit"] = "mc"
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Instance probability ``p(y* = 1) = E[σ(f*)]`` (Eq. 31).

        ``method="mc"``: ``n_mc_samples`` draws, seeded by ``random_state`` (Eq. 32; std by
        Eq. 33). ``method="probit"``: the closed form ``σ(μ / sqrt(1 + πσ²/8))``; its std, when
        asked for, still comes from Monte Carlo.
        """
        X, _ = self._check_predict_input(X)
        mean, var = self._instance_moments(X)
        need_mc = method == "mc" or return_std
        if method not in ("mc", "probit"):
            raise ValueError(f"method must be 'mc' or 'probit', got {method!r}")
        p = expit(probit_scale(mean, var))
        sd = np.zeros_like(p)
        if need_mc:
            rng = check_random_state(self.random_state)
            for rows, f in self._sample_latent(mean, var, rng):
                s = expit(f)
                if method == "mc":
                    p[rows] = s.mean(axis=1)
                sd[rows] = s.std(axis=1)
        return (p, sd) if return_std else p

    def predict_bag_proba(
        self,
        X: Any,
        bag_ids: Any,
        *,
        return_std: bool = False,
        method: Literal["mc", "probit"] = "mc",
        rule: Literal["noisy_or", "max"] = "noisy_or",
    ):
        """Bag probability by the MIL rule: ``keys, p`` or ``keys, p, std``; ``keys = np.unique(bag_ids)``.

        ``rule="noisy_or"`` (Eq. 34–35): ``1 − Π(1 − pₙ)`` for independent f*, evaluated as
        ``−expm1(Σ log(1 − pₙ))`` so that bags of 10⁵ instances do not underflow; std from the
        Monte Carlo spread of the same quantity (Eq. 37). ``rule="max"``: ``max pₙ`` with the
        Monte Carlo spread of ``max σ(f*ₙ)``.
        """
        if rule not in ("noisy_or", "max"):
            raise ValueError(f"rule must be 'noisy_or' or 'max', got {rule!r}")
        X, bags = self._check_predict_input(X, bag_ids)
        p_inst = self.predict_instance_proba(X, method=method)[bags.order]
        offsets = bags.offsets
        if rule == "noisy_or":
            p = -np.expm1(log_prob_all_negative(np.log1p(-p_inst), offsets))
        else:
            p = np.maximum.reduceat(p_inst, offsets[:-1])
        if not return_std:
            return bags.keys, p
        mean, var = self._instance_moments(take_rows(X, bags.order))
        per_bag = np.zeros((bags.n_bags, self.n_mc_samples)) if rule == "noisy_or" else None
        rng = check_random_state(self.random_state)
        bag_of_row = bags.instance_bag()
        for rows, f in self._sample_latent(mean, var, rng):
            r = np.arange(mean.shape[0])[rows]
            first, last = bag_of_row[r[0]], bag_of_row[r[-1]]
            local = offsets[first : last + 2] - r[0]
            local = np.clip(local, 0, r.shape[0])
            if rule == "noisy_or":
                per_bag[first : last + 1] += segment_sum(-_softplus(f), local)
            else:
                chunk_max = np.maximum.reduceat(expit(f), local[:-1], axis=0)
                per_bag = chunk_max if per_bag is None else _merge_max(per_bag, chunk_max, first)
        values = -np.expm1(per_bag) if rule == "noisy_or" else per_bag
        return bags.keys, p, values.std(axis=1)


def _merge_max(acc: np.ndarray, chunk: np.ndarray, first: int) -> np.ndarray:
    """Running per-bag maximum over row chunks (a bag may straddle two chunks)."""
    n = first + chunk.shape[0]
    if acc.shape[0] < n:
        acc = np.concatenate([acc, np.full((n - acc.shape[0], acc.shape[1]), -np.inf)])
    acc[first:n] = np.maximum(acc[first:n], chunk)
    return acc


_COMMON_PARAMS = """
    n_inducing : int, default=100
        Number of inducing points M (k-means, half from each bag class).
    kernel : RBF or None
        Kernel; ``None`` is ``RBF(variance=1, length_scale=√D)`` (see :mod:`mil_core.kernels`).
    H : float, default=100
        Bag-likelihood odds ``H^{G_b}/(H+1)`` (Eq. 4).
    emax : {"max", "exact"}, default="max"
        ``E[max y_{b∖n}]`` rule: the reference codes' max of the others' π, or the mean-field
        ``1 − Π_{j≠n}(1 − π_j)`` (whose ELBO is a true bound). ``"max"`` is the default because
        it gave the higher CV bag AUC in 5 of 6 model × dataset pairs (``docs/MODELS.md``).
    max_iter, tol
        Closed-form sweeps and relative ELBO tolerance.
    early_stopping, validation_fraction, n_iter_no_change
        Validation bag-AUC early stopping with patience; the best iterate is kept.
    block_size
        Instances per partition of whole bags (results do not depend on it).
    n_mc_samples
        Monte Carlo draws for predictions (Eq. 32–37).
    random_state
        Seed for k-means, the validation split and Monte Carlo.
    learn_kernel, learn_inducing, hyper_every, hyper_steps
        Learn the RBF variance and length-scale (ARD when ``kernel.length_scale`` is a vector),
        and the inducing points, by maximising the ELBO (Eq. 29; Algorithm 1, step 8): after every
        ``hyper_every``-th sweep, ``hyper_steps`` L-BFGS evaluations (one sweep each); J never
        decreases across a step. Defaults: off (fixed kernel). See :mod:`mil_core.models.hyper`.

    Attributes
    ----------
    gp_ : SparseGP
        Kernel, inducing points ``gp_.Z`` and ``chol(Kzz)``.
    q_ : GaussianQ
        Whitened q(v) = N(m', S'); u = L v.
    elbo_ : ndarray
        ELBO per iteration (with ``emax="max"`` a monitor, not a bound).
    n_iter_, converged_, kernel_, n_features_in_, classes_
    validation_auc_, best_iteration_
        When ``early_stopping``.
    hyper_objective_, psi_
        With hyper-parameter learning: ``(J before, J after)`` of each hyper-parameter step
        (n_steps, 2), and the ψ used at the end (learnt α, β for G-VGPMIL with ``learn_psi``).
"""


class PsiVGPMIL(_LogisticGPMIL):
    __doc__ = (
        """ψ-VGPMIL (seed 000, Sec. 4, Algorithm 1) with a pluggable ψ.

    Parameters
    ----------
    psi : Psi, callable or None
        A :class:`~mil_core.likelihoods.Psi` or a bare ``θ(c)`` callable; ``None`` is the
        hyperbolic secant, which makes this model VGPMIL.
    log_normaliser : {"quadrature", "mc_rff"}
        ``log Z`` of Eq. 29 when learning the kernel (:mod:`mil_core.models.hyper`)."""
        + _COMMON_PARAMS
    )

    def __init__(
        self,
        psi: Psi | Callable[[np.ndarray], np.ndarray] | None = None,
        *,
        n_inducing: int = 100,
        kernel: RBF | None = None,
        H: float = 100.0,
        emax: EmaxRule = "max",
        max_iter: int = 200,
        tol: float = 1e-6,
        early_stopping: bool = False,
        validation_fraction: float = 0.2,
        n_iter_no_change: int = 10,
        block_size: int = 65536,
        n_mc_samples: int = 500,
        random_state: int | None = None,
        learn_kernel: bool = False,
        learn_inducing: bool = False,
        hyper_every: int = 1,
        hyper_steps: int = 5,
        log_normaliser: LogNormaliserName = "quadrature",
    ):
        store_params(self, locals())

    def _psi(self) -> Psi:
        return as_psi(self.psi)


class VGPMIL(_LogisticGPMIL):
    __doc__ = (
        """VGPMIL: logistic GP-MIL with the Jaakkola bound, equivalently the Pólya-Gamma
    augmentation, ``θ(c) = tanh(c/2)/(2c)`` (seed 000, Sec. 2–3, Eq. 8–14).

    Parameters
    ----------"""
        + _COMMON_PARAMS
    )

    def __init__(
        self,
        *,
        n_inducing: int = 100,
        kernel: RBF | None = None,
        H: float = 100.0,
        emax: EmaxRule = "max",
        max_iter: int = 200,
        tol: float = 1e-6,
        early_stopping: bool = False,
        validation_fraction: float = 0.2,
        n_iter_no_change: int = 10,
        block_size: int = 65536,
        n_mc_samples: int = 500,
        random_state: int | None = None,
        learn_kernel: bool = False,
        learn_inducing: bool = False,
        hyper_every: int = 1,
        hyper_steps: int = 5,
    ):
        store_params(self, locals())

    def _psi(self) -> Psi:
        return HyperbolicSecant()


class GVGPMIL(_LogisticGPMIL):
    __doc__ = (
        """G-VGPMIL: ψ-VGPMIL with a Gamma(α, β) mixing density, ``θ(c) = α/(β + c²/2)``
    (seed 000, Sec. 5, Eq. 38).

    Parameters
    ----------
    alpha, beta : float, default=1.0, 2.5
        The Gamma parameters (the paper's grid: α ∈ {0.5, 1}, β ∈ {1, 2.5, 4}); initial values
        when ``learn_psi``.
    learn_psi : bool, default=False
        Learn α, β by maximising the same bound as the kernel (needs ``learn_kernel``-style steps;
        they run whenever ``learn_psi`` or ``learn_kernel`` is set). The fallback is validation-based
        selection over the grid (:func:`mil_core.model_selection.grid_search_bags`).
    log_normaliser : {"quadrature", "mc_rff"}
        ``log Z`` of Eq. 29 (:mod:`mil_core.models.hyper`); it is what keeps v, α, β finite.

    Notes
    -----
    ``exp((y − ½) f) ψ(f)`` with a polynomially decaying ψ is not bounded in f: the data term
    keeps pushing the latent f of confidently negative instances down, and only the GP prior
    holds it (there is a local optimum near 0 only when α/√(2β) > ½). With large bags or a large
    kernel variance the fit can run away; early stopping is the paper's remedy
    (``docs/MODELS.md`` has the measurement)."""
        + _COMMON_PARAMS
    )

    def __init__(
        self,
        *,
        n_inducing: int = 100,
        alpha: float = 1.0,
        beta: float = 2.5,
        kernel: RBF | None = None,
        H: float = 100.0,
        emax: EmaxRule = "max",
        max_iter: int = 200,
        tol: float = 1e-6,
        early_stopping: bool = False,
        validation_fraction: float = 0.2,
        n_iter_no_change: int = 10,
        block_size: int = 65536,
        n_mc_samples: int = 500,
        random_state: int | None = None,
        learn_kernel: bool = False,
        learn_inducing: bool = False,
        hyper_every: int = 1,
        hyper_steps: int = 5,
        learn_psi: bool = False,
        log_normaliser: LogNormaliserName = "quadrature",
    ):
        store_params(self, locals())

    def _psi(self) -> Psi:
        return GammaMixture(alpha=self.alpha, beta=self.beta)
