"""VGPMIL-PR and VGPMIL-PR-I estimators: fit plumbing and predictions (seed 002 Sec. 2.5, Eq. 21–26).

The model, its mean-field updates and the tracked objective are in :mod:`mil_core.models.probit_updates`;
learning the Ising strength λ is in :mod:`mil_core.models.ising_hyper`.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from scipy.special import log_ndtr, ndtr, owens_t

from .._backend import take_rows
from ..bags import BAG_RULES, BagIndex, bag_score, log_prob_all_negative, segment_sum
from ..engine import GaussianQ, SparseGP
from ..ising import CARCoupling, Neighbourhood, check_coords, smoothed_field_log_p0
from ..kernels import RBF
from ..orthant import log_orthant_probability_exact, orthant_probability_importance
from ..predictive import bag_generators, probit_link_scale, sample_latent_bags
from .base import BagRuleChoice, SparseGPMILBase, store_params, take_bags
from .ising_hyper import IsingLamUpdates, LamObjective, LamState, ising_lam_updates, unwrap_lam_state
from .probit_updates import CouplingForm, Moments, ProbitMILUpdates, prior_mean_of

__all__ = ["PROBIT_BAG_RULES", "VGPMILPR", "VGPMILPRI"]

PROBIT_BAG_RULES: tuple[str, ...] = (*BAG_RULES, "orthant")
"""Bag rules of the probit family: the instance-probability rules of :func:`mil_core.bags.bag_score`
and ``"orthant"``, the paper's ``1 − P(m* < 0)`` (seed 002 Eq. 26)."""


def _phi_and_spread(mean: np.ndarray, var: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``E[Φ(X)]`` and ``sd[Φ(X)]`` for ``X ~ N(mean, var)`` in closed form:
    ``E Φ(X) = Φ(h)``, ``E Φ(X)² = Φ₂(h, h; ρ) = Φ(h) − 2T(h, 1/√(1 + 2var))`` (Owen's T),
    ``h = mean/√(1 + var)``."""
    h = probit_link_scale(mean, var)
    p = ndtr(h)
    second = p - 2.0 * owens_t(h, 1.0 / np.sqrt(1.0 + 2.0 * var))
    return p, np.sqrt(np.clip(second - p**2, 0.0, None))


class _ProbitGPMIL(BagRuleChoice, SparseGPMILBase):
    """Fit plumbing and predictions (seed 002 Sec. 2.5, Eq. 21–26) of the probit family."""

    bag_rules = PROBIT_BAG_RULES

    def _lam(self) -> float:
        return 0.0

    def _updates_options(self) -> dict[str, Any]:
        return {}

    def _make_updates(self, gp: SparseGP) -> ProbitMILUpdates:
        return ProbitMILUpdates(gp=gp, lam=self._lam(), **self._updates_options(), **self._prior_mean_options())

    def _prior_mean_options(self) -> dict[str, Any]:
        """``prior_mean=None``: ``b`` learnt from 0 (empirical Bayes); a number: ``b`` fixed there."""
        if self.prior_mean is None:
            return {"learn_prior_mean": True}
        if isinstance(self.prior_mean, (bool, np.bool_)) or not isinstance(self.prior_mean, (int, float, np.number)) \
                or not np.isfinite(self.prior_mean):
            raise ValueError(f"prior_mean must be None (learnt) or a finite number, got {self.prior_mean!r}")
        return {"prior_mean": float(self.prior_mean)}

    def _latent(self, gp: SparseGP, q: Any, X: Any) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance of the latent ``f* = b + a'*ᵀv`` (Eq. 30, FITC diagonal) under the state ``q``."""
        mean, var = gp.whiten(X).latent_moments(q)
        return mean + prior_mean_of(q), var

    def predict_latent(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance of the latent f* (Eq. 30, FITC diagonal), the prior mean ``b`` included."""
        X, _ = self._check_predict_input(X)
        return self._latent(self.gp_, self.q_, X)

    def _fitted_lam(self) -> float:
        """λ of the fitted coupling (the parameter; VGPMIL-PR-I: the learnt ``lam_`` when learnt)."""
        return self._lam()

    def _coupling(self, offsets: np.ndarray, coords: np.ndarray | None, lam: float) -> CARCoupling:
        return CARCoupling.from_coords(coords, offsets, 0.0 if coords is None else lam, self._neighbourhood())

    def _neighbourhood(self) -> Neighbourhood:
        return 4

    def _bag_proba_from_state(
        self, gp: SparseGP, glob: GaussianQ | LamState, X_sorted: Any, offsets: np.ndarray, coords: np.ndarray | None = None,
        coupling: CARCoupling | None = None,
    ) -> np.ndarray:
        return self._bag_probas_from_state(gp, glob, X_sorted, offsets, (None,), coords=coords, coupling=coupling)[None]

    def _held_out_context(self, offsets: np.ndarray, coords: np.ndarray | None = None) -> dict[str, Any]:
        """The held-out bags' coords and their coupling at this model's λ, built once and keeping its
        per-bag covariances (:meth:`~mil_core.ising.CARCoupling.keeping_bag_terms`): the in-context
        instance probabilities of every checkpoint reuse them (measured on the tissue grids:
        ``docs/BENCHMARKS.md``, "The held-out bags' coupling, built once")."""
        if coords is None:
            return {}
        return {"coords": coords, "coupling": self._coupling(offsets, coords, self._lam()).keeping_bag_terms()}

    def _bag_probas_from_state(
        self, gp: SparseGP, glob: GaussianQ | LamState, X_sorted: Any, offsets: np.ndarray, rules: tuple[str | None, ...],
        coords: np.ndarray | None = None, coupling: CARCoupling | None = None,
    ) -> dict[str | None, np.ndarray]:
        """Bag scores of a fit state under each of ``rules`` (``None``: ``bag_rule_``); the latent
        and the instance probabilities in context are computed once for every rule. ``coupling``:
        the bags' coupling prepared by :meth:`_held_out_context` (used where the state's λ is its λ)."""
        lam = self._fitted_lam()
        if isinstance(glob, LamState):  # validation during a fit that learns λ: the state's λ
            lam, glob = glob.lam, glob.q
        if coupling is None or coupling.lam != (0.0 if coords is None else lam):
            coupling = self._coupling(offsets, coords, lam)
        mean, var = self._latent(gp, glob, X_sorted)
        names = {rule: self._rule(rule) for rule in rules}
        rngs = bag_generators(self.random_state, range(offsets.shape[0] - 1))  # a bag's draws its own
        scores = self._rule_scores(mean, var, offsets, coords, coupling, set(names.values()), rngs)
        return {rule: scores[name] for rule, name in names.items()}

    def _rule(self, rule: str | None) -> str:
        """The bag rule of a prediction: ``rule``, or the fitted ``bag_rule_``."""
        rule = self.bag_rule_ if rule is None else rule
        if rule not in PROBIT_BAG_RULES:
            raise ValueError(f"bag rule must be one of {', '.join(PROBIT_BAG_RULES)}, got {rule!r}")
        return rule

    def predict_instance_proba(self, X: Any, *, return_std: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Instance probability ``p(h* = 1) = p(m* > 0) = Φ(μ*/√(1 + σ*²))`` (Eq. 25 with
        ``Σ* = 1``: a single instance has no neighbours); ``return_std``: the posterior spread of
        ``Φ(f*)``, in closed form (Owen's T)."""
        X, _ = self._check_predict_input(X)
        mean, var = self._latent(self.gp_, self.q_, X)
        p, sd = _phi_and_spread(mean, var)
        return (p, sd) if return_std else p

    def predict_bag_proba(
        self, X: Any, bag_ids: Any, *, return_std: bool = False, coords: Any | None = None, return_orthant_error: bool = False,
        rule: str | None = None,
    ) -> tuple[np.ndarray, ...]:
        """Bag score by the bag ``rule`` (default: the fitted ``bag_rule_``): ``keys, p``, then
        ``std`` when ``return_std`` and ``orthant_error`` when ``return_orthant_error``.

        ``rule="orthant"`` is the paper's bag probability ``p(y* = 1) = 1 − P(m* < 0)`` (Eq. 26).
        As in the logistic family (DESIGN §3), the latent ``f*`` are taken independent across
        instances (FITC-diagonal predictive), so ``m* ~ N(Σ*μ*, Σ* + Σ* diag(σ*²) Σ*)``.
        Without coupling (VGPMIL-PR, or no coords) that is ``1 − Π Φ(−μ*/√(1 + σ*²))``, exact,
        in log space: the noisy-OR of the instance probabilities, which grows with the bag size
        and saturates in bags of 10³+ instances. With coupling (``coords`` given to VGPMIL-PR-I) the
        orthant probability is computed exactly (scipy) for bags of ≤ ``exact_orthant_max``
        instances and by the GHK sampler on the sparse Cholesky factor, with a standard error, for
        larger bags (:mod:`mil_core.orthant`): ``orthant_error`` is that standard error per bag (0
        where the probability is exact, and for the other rules).

        The other rules (:data:`PROBIT_BAG_RULES`) apply :func:`mil_core.bags.bag_score` to the
        instance probabilities ``p(m*_i > 0)`` (Eq. 25; VGPMIL-PR-I with ``coords``: in the context
        of their bag, Eq. 24, as :meth:`VGPMILPRI.predict_instance_proba`).

        ``std`` is the posterior spread of the bag score over ``f*`` (Monte Carlo,
        ``n_mc_samples`` draws, seeded by ``random_state`` and the bag's key: a bag's draws, and
        its probes and GHK draws, do not depend on the other bags of the call).
        """
        X, bags = self._check_predict_input(X, bag_ids)
        rule = self._rule(rule)
        coords_sorted = None if coords is None else check_coords(coords, bags)
        mean, var = self._latent(self.gp_, self.q_, take_rows(X, bags.order))
        p, std, orthant_error = self._bag_proba(mean, var, bags.offsets, coords_sorted, self._fitted_lam(), rule,
                                                bag_generators(self.random_state, bags.keys), return_std=return_std)
        return (bags.keys, p) + ((std,) if return_std else ()) + ((orthant_error,) if return_orthant_error else ())

    def _bag_proba(
        self, mean: np.ndarray, var: np.ndarray, offsets: np.ndarray, coords: np.ndarray | None, lam: float, rule: str,
        rngs: Sequence[np.random.Generator], *, return_std: bool,
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """Bag scores by ``rule``, their spread over ``f*`` (``None`` unless ``return_std``) and
        the standard errors of the sampled orthant probabilities (0 where exact or not asked);
        bag b's random numbers from ``rngs[b]``."""
        coupling = self._coupling(offsets, coords, lam)
        if rule == "orthant":
            return self._orthant_bag_proba(mean, var, offsets, coords, coupling, rngs, return_std=return_std)
        p = self._rule_scores(mean, var, offsets, coords, coupling, {rule}, rngs)[rule]
        std = self._rule_spread(mean, var, offsets, coupling, rule, rngs) if return_std else None
        return p, std, np.zeros(offsets.shape[0] - 1)

    def _rule_scores(
        self, mean: np.ndarray, var: np.ndarray, offsets: np.ndarray, coords: np.ndarray | None, coupling: CARCoupling,
        rules: set[str], rngs: Sequence[np.random.Generator],
    ) -> dict[str, np.ndarray]:
        """Bag scores under each of ``rules``: ``"orthant"`` the paper's ``1 − P(m* < 0)`` (Eq. 26),
        the others :func:`~mil_core.bags.bag_score` of the instance probabilities in context,
        computed once for all of them (Eq. 24–25)."""
        scores = {}
        if "orthant" in rules:
            scores["orthant"] = self._orthant_bag_proba(mean, var, offsets, coords, coupling, rngs, return_std=False)[0]
        if rules - {"orthant"}:
            p = self._instance_proba_in_context(mean, var, coupling, rngs)[0]
            scores |= {rule: bag_score(p, offsets, rule) for rule in rules - {"orthant"}}
        return scores

    def _instance_proba_in_context(
        self, mean: np.ndarray, var: np.ndarray, coupling: CARCoupling, rngs: Sequence[np.random.Generator]
    ) -> tuple[np.ndarray, np.ndarray]:
        """``p(m*_i > 0)`` and its spread over ``f*`` (bag order): ``Φ(μ*/√(1 + σ*²))`` without
        coupling (Eq. 25, ``Σ* = 1``), the marginals of Eq. 24 with it (bag b's probes from ``rngs[b]``)."""
        return _phi_and_spread(mean, var)

    def _given_latent(self, coupling: CARCoupling) -> Callable[[np.ndarray], np.ndarray]:
        """``f ↦ p(m*_i > 0 | f*)`` for draws ``f`` (n, k) of the latent: ``Φ(f*)`` without coupling."""
        return ndtr

    def _rule_spread(
        self, mean: np.ndarray, var: np.ndarray, offsets: np.ndarray, coupling: CARCoupling, rule: str,
        rngs: Sequence[np.random.Generator],
    ) -> np.ndarray:
        """Monte Carlo spread of the ``rule`` score over ``f* ~ N(mean, var)``."""
        given_latent = self._given_latent(coupling)
        return self._latent_spread(mean, var, offsets, lambda f: bag_score(given_latent(f), offsets, rule), rngs)

    def _latent_spread(
        self, mean: np.ndarray, var: np.ndarray, offsets: np.ndarray, score: Callable[[np.ndarray], np.ndarray],
        rngs: Sequence[np.random.Generator],
    ) -> np.ndarray:
        """Spread of the bag scores ``score(f)`` (B, k) over ``n_mc_samples`` draws ``f`` (n, k) of
        ``f* ~ N(mean, var)``, bag b's from ``rngs[b]`` (:func:`~mil_core.predictive.sample_latent_bags`),
        ≤ 2²² values at a time (the draws are columns, independent)."""
        L, n = self.n_mc_samples, max(mean.shape[0], 1)
        chunk = max(1, (1 << 22) // n)
        draws = [score(sample_latent_bags(mean, var, offsets, min(chunk, L - start), rngs)) for start in range(0, L, chunk)]
        return np.concatenate(draws, axis=1).std(axis=1)

    def _orthant_bag_proba(
        self, mean: np.ndarray, var: np.ndarray, offsets: np.ndarray, coords: np.ndarray | None, coupling: CARCoupling,
        rngs: Sequence[np.random.Generator], *, return_std: bool,
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """The paper's ``1 − P(m* < 0)`` (Eq. 26), its spread and the GHK standard errors (bag b's
        draws from ``rngs[b]``)."""
        n_bags = offsets.shape[0] - 1
        sizes = np.diff(offsets)
        independent = coupling.edge_count == 0
        log_p0 = segment_sum(log_ndtr(-probit_link_scale(mean, var)), offsets)
        std = np.zeros(n_bags) if return_std else None
        orthant_error = np.zeros(n_bags)
        if return_std and np.any(independent):  # 1 − Π Φ(−f*_i), in log space
            alone = np.flatnonzero(independent)
            (mean_alone, alone_offsets), var_alone = take_bags(mean, offsets, alone), take_bags(var, offsets, alone)[0]
            std[alone] = self._latent_spread(mean_alone, var_alone, alone_offsets,
                                             lambda f: -np.expm1(log_prob_all_negative(log_ndtr(-f), alone_offsets)), [rngs[b] for b in alone])
        for b in np.flatnonzero(~independent):
            rows = slice(offsets[b], offsets[b + 1])
            exact = sizes[b] <= self.exact_orthant_max
            if exact:
                Sigma = coupling.bag_covariance(b)
                cov = self._noise_covariance(Sigma) + Sigma @ np.diag(var[rows]) @ Sigma
                log_p0[b] = log_orthant_probability_exact(Sigma @ mean[rows], cov, rngs[b])
            if return_std or not exact:
                log_p, std_error, spread = self._sampled_log_p0(mean[rows], var[rows], coupling, b, coords[rows], rngs[b])
                if not exact:
                    log_p0[b], orthant_error[b] = log_p, std_error
                if return_std:
                    std[b] = spread
        return -np.expm1(log_p0), std, orthant_error

    def _noise_covariance(self, Sigma: np.ndarray) -> np.ndarray:
        """``Cov(m_b | f_b)`` of a coupled bag: ``Σ_b`` in the paper's form (Eq. 12)."""
        return Sigma

    def _sampled_log_p0(
        self, mean: np.ndarray, var: np.ndarray, coupling: CARCoupling, b: int, coords: np.ndarray, rng: np.random.Generator
    ) -> tuple[float, float, float]:
        """``log P(m_b < 0)``, its standard error and its spread over ``f*`` for one coupled bag
        (GHK, :func:`~mil_core.orthant.orthant_probability_importance`)."""
        bag_coupling = self._coupling(np.array([0, mean.shape[0]]), coords, coupling.lam)
        estimate = orthant_probability_importance(mean, var, bag_coupling, n_draws=self.n_mc_samples, rng=rng)
        return estimate.log_p, estimate.std_error, estimate.spread


_COMMON_PARAMS = """
    n_inducing : int, default=100
        Number of inducing points M (k-means, half from each bag class). A training set with
        fewer instances makes every instance one (the exact GP); a warning says so when
        ``n_inducing`` is not the default.
    kernel : RBF or None
        Kernel; ``None`` chooses the variance (and the number of sweeps) on the training bags
        (:meth:`~mil_core.models.base.SparseGPMILBase._select_kernel`).
    standardize : bool, default=True
        Fit and predict on features standardised with the training instances' mean and scale,
        ``feature_mean_`` / ``feature_scale_`` (:class:`~mil_core.models.base.FeatureStandardisation`).
    max_iter, tol
        Closed-form sweeps and relative ELBO tolerance (relative to the ELBO without the FITC
        residual's term, which no sweep changes: :func:`~mil_core.engine.optimise`).
    early_stopping, validation_fraction, n_iter_no_change
        Validation bag-AUC early stopping with patience; the best iterate is kept.
    block_size
        Instances per partition of whole bags (results do not depend on it).
    prior_mean : float or None, default=None
        Constant prior mean ``b`` of the latent, ``f = b + GP``. ``None`` learns it by empirical
        Bayes (Newton steps on the ELBO between sweeps, from 0); a number fixes it. With a zero
        mean a bag of thousands of instances is "surely positive" and its label says nothing
        (:mod:`mil_core.models.probit_updates`, ``docs/MODELS.md`` "Probit family"). The fitted
        value is ``q_.prior_mean``. VGPMIL-PR-I with ``learn_lam=True`` keeps it at its start.
    bag_rule : {"auto", "top_fraction", "max", "mean", "noisy_or", "orthant"}, default="auto"
        How a bag is scored, in ``predict_bag_proba``, in validation (early stopping, kernel
        choice) and in the pipeline: a rule of :func:`mil_core.bags.bag_score` on the instance
        probabilities, or ``"orthant"``, the paper's ``1 − P(m* < 0)`` (Eq. 26), which follows the
        bag size (``docs/MODELS.md``, "Probit family"). ``"auto"``: ``top_fraction`` unless the
        kernel choice finds ``mean`` or ``max`` clearly better on the training bags
        (:class:`~mil_core.models.base.BagRuleChoice`); with a fixed kernel ``top_fraction``. The
        rule used is ``bag_rule_``.
    n_mc_samples
        Monte Carlo draws for prediction spreads (and orthant importance sampling).
    random_state
        Seed for k-means, the validation split and Monte Carlo.

    Attributes
    ----------
    gp_ : SparseGP
        Kernel, inducing points ``gp_.Z`` (in standardised units with ``standardize``) and ``chol(Kzz)``.
    q_ : GaussianQ
        Whitened q(v) = N(m', S'); u = L v.
    elbo_ : ndarray
        Objective per iteration (module docstring of :mod:`mil_core.models.probit_updates`).
    n_iter_, converged_, kernel_, n_features_in_, classes_, bag_rule_, feature_mean_, feature_scale_
    validation_auc_, best_iteration_
        When ``early_stopping``.
"""


class VGPMILPR(_ProbitGPMIL):
    __doc__ = (
        """VGPMIL-PR: probit GP-MIL with augmented ``m_i ~ N(f_i, 1)`` and the hard MIL bag
    likelihood; closed-form ``q(v)``, ``q(m)`` updates (seed 002 Sec. 2.2.2; seed 003 Eq. 7–12).

    Parameters
    ----------"""
        + _COMMON_PARAMS
    )

    exact_orthant_max = 0

    def __init__(
        self,
        *,
        n_inducing: int = 100,
        kernel: RBF | None = None,
        standardize: bool = True,
        max_iter: int = 200,
        tol: float = 1e-6,
        early_stopping: bool = False,
        validation_fraction: float = 0.2,
        n_iter_no_change: int = 10,
        block_size: int = 65536,
        prior_mean: float | None = None,
        bag_rule: str = "auto",
        n_mc_samples: int = 500,
        random_state: int | None = None,
    ):
        store_params(self, locals())


class VGPMILPRI(_ProbitGPMIL):
    __doc__ = (
        """VGPMIL-PR-I: VGPMIL-PR with the Ising/CAR coupling of contiguous instances,
    ``p(m_b | f_b) = N(Σ_b f_b, Σ_b)``, ``Σ_b = (λC_b + I)⁻¹`` (seed 002 Sec. 2.3–2.5, Algorithm 1).

    ``fit(X, bag_ids, y, coords)``: ``coords`` are integer grid positions of the instances,
    (N, 2) ``(row, col)`` for tiles or (N,) slice indices (a chain); see :mod:`mil_core.ising`.
    λ → 0 gives VGPMIL-PR.

    Parameters
    ----------
    lam : float, default=0.5
        Coupling strength λ ≥ 0 (the paper's best on SICAPv2 is 0.5).
    neighbourhood : {4, 8}, default=4
        Grid neighbourhood for 2-D coords (4 reproduces the paper's Eq. 9–10).
    moments : {"diagonal", "mean_field"}, default="diagonal"
        ``E[m_b]`` under the paper's diagonal approximation or the within-bag mean-field
        approximation of the exact truncated ``N(μ, Σ_b)`` (:mod:`mil_core.models.probit_updates`).
    exact_diag_max, diag_tol
        ``diag(Σ_b)`` exactly for bags up to this size, by probing with error ≤ ``diag_tol``
        above (:mod:`mil_core.ising`).
    exact_orthant_max : int, default=12
        Bags up to this size get the exact (scipy) orthant probability at prediction; larger
        ones the GHK simulator (:mod:`mil_core.orthant`).
    learn_lam, lam_objective, hyper_every, hyper_steps
        Learn λ (``lam`` is then the starting value) between sweeps: after every
        ``hyper_every``-th sweep, ``hyper_steps`` L-BFGS evaluations in ``log λ`` (one sweep each);
        the learnt value is ``lam_`` (:mod:`mil_core.models.ising_hyper`). ``lam_objective="field"``
        (default) maximises the CAR likelihood of the coupling on the inferred latent field
        ``E[f]`` (type-II ML; measured to grow with the lesions' spatial correlation);
        ``"bound"`` maximises the ELBO (measured: it does not track the correlation). The
        validation-grid fallback is ``select_lam_by_validation``.
    coupling_form : {"ising", "smoother"}, default="ising"
        ``"ising"`` is the paper's ``m_b | f_b ~ N(Σ_b f_b, Σ_b)``. ``"smoother"`` keeps the
        paper's smoothed mean and makes the noise independent, ``m_b | f_b ~ N(Σ_b f_b, I)``: λ
        then only averages ``f`` over neighbours and no longer shrinks the noise variance (a λ
        learnt by the ELBO still does not track the spatial correlation of the labels;
        :mod:`mil_core.models.ising_hyper`, ``docs/BENCHMARKS.md`` "Ising strength λ"). ``q(m_b)`` is
        then exact (``moments`` has no effect) and λ → 0 is VGPMIL-PR again."""
        + _COMMON_PARAMS
    )

    def __init__(
        self,
        *,
        lam: float = 0.5,
        neighbourhood: Neighbourhood = 4,
        moments: Moments = "diagonal",
        n_inducing: int = 100,
        kernel: RBF | None = None,
        standardize: bool = True,
        max_iter: int = 200,
        tol: float = 1e-6,
        early_stopping: bool = False,
        validation_fraction: float = 0.2,
        n_iter_no_change: int = 10,
        block_size: int = 65536,
        exact_diag_max: int = 2000,
        diag_tol: float = 1e-6,
        exact_orthant_max: int = 12,
        prior_mean: float | None = None,
        bag_rule: str = "auto",
        n_mc_samples: int = 500,
        random_state: int | None = None,
        learn_lam: bool = False,
        lam_objective: LamObjective = "field",
        hyper_every: int = 1,
        hyper_steps: int = 5,
        coupling_form: CouplingForm = "ising",
    ):
        store_params(self, locals())

    def _make_updates(self, gp: SparseGP) -> ProbitMILUpdates | IsingLamUpdates:
        return ising_lam_updates(self, super()._make_updates(gp))

    def _prior_mean_options(self) -> dict[str, Any]:
        """As VGPMIL-PR; with ``learn_lam`` the λ steps own the fit's hyper-step, so ``b`` stays at
        its start (0 for ``prior_mean=None``)."""
        if self.learn_lam and self.prior_mean is None:
            return {"prior_mean": 0.0}
        return super()._prior_mean_options()

    def _fitted_lam(self) -> float:
        return self.lam_ if self.learn_lam and hasattr(self, "lam_") else self._lam()

    def _finish_fit(self, trace: Any, monitor: Any = None) -> None:
        super()._finish_fit(trace, monitor)
        unwrap_lam_state(self)

    def _check_common_params(self, n_instances: int | None) -> None:
        for name in ("exact_diag_max", "exact_orthant_max"):
            value = getattr(self, name)
            if not (isinstance(value, (int, np.integer)) and value >= 0):
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not (isinstance(self.diag_tol, (int, float, np.number)) and np.isfinite(self.diag_tol) and self.diag_tol > 0):
            # the probing period grows until its error bound is below diag_tol: a bound ≤ 0 is never reached
            raise ValueError(f"diag_tol must be a finite number > 0, got {self.diag_tol!r}")
        super()._check_common_params(n_instances)

    def _lam(self) -> float:
        if not (np.isfinite(self.lam) and self.lam >= 0):
            raise ValueError(f"lam must be a finite number >= 0, got {self.lam!r}")
        return float(self.lam)

    def _neighbourhood(self) -> Neighbourhood:
        if self.neighbourhood not in (4, 8):
            raise ValueError(f"neighbourhood must be 4 or 8, got {self.neighbourhood!r}")
        return self.neighbourhood

    def _updates_options(self) -> dict[str, Any]:
        if self.moments not in ("diagonal", "mean_field"):
            raise ValueError(f"moments must be 'diagonal' or 'mean_field', got {self.moments!r}")
        if self.coupling_form not in ("ising", "smoother"):
            raise ValueError(f"coupling_form must be 'ising' or 'smoother', got {self.coupling_form!r}")
        return dict(
            neighbourhood=self._neighbourhood(),
            moments=self.moments,
            exact_diag_max=self.exact_diag_max,
            diag_tol=self.diag_tol,
            coupling_form=self.coupling_form,
        )

    def predict_instance_proba(
        self, X: Any, *, return_std: bool = False, bag_ids: Any | None = None, coords: Any | None = None
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Instance probability ``p(h*_i = 1) = Φ((μ*_m)_i / √(S*_m)_ii)`` (Eq. 24–25).

        Without ``bag_ids`` and ``coords`` each instance is alone (``Σ* = 1``). With both, each
        instance is predicted in the context of its test bag, ``m* ~ N(Σ*μ*, N* + Σ* diag(σ*²) Σ*)``
        with ``N* = Σ*`` (the paper's form; ``I`` for the smoother form): neighbours' evidence is
        pooled. ``diag(Σ*)`` is exact or probed to ``diag_tol`` and ``diag(Σ* diag(σ*²) Σ*)``
        exact up to ``exact_diag_max`` instances per bag, Monte Carlo (``n_mc_samples`` probes)
        above (:meth:`~mil_core.ising.CARCoupling.smoothed_variance`). ``return_std``: the spread
        of ``p(m*_i > 0 | f*)`` over ``f*`` (Owen's T). Rows are in the order of ``X``.
        """
        if bag_ids is None and coords is None:
            return super().predict_instance_proba(X, return_std=return_std)
        if bag_ids is None or coords is None:
            raise ValueError("instance predictions in bag context need both bag_ids and coords")
        X, bags = self._check_predict_input(X, bag_ids)
        coupling = self._coupling(bags.offsets, check_coords(coords, bags), self._fitted_lam())
        mean, var = self._latent(self.gp_, self.q_, take_rows(X, bags.order))
        p_sorted, sd_sorted = self._instance_proba_in_context(mean, var, coupling, bag_generators(self.random_state, bags.keys))
        p, sd = np.empty_like(p_sorted), np.empty_like(sd_sorted)
        p[bags.order], sd[bags.order] = p_sorted, sd_sorted
        return (p, sd) if return_std else p

    def _instance_proba_in_context(
        self, mean: np.ndarray, var: np.ndarray, coupling: CARCoupling, rngs: Sequence[np.random.Generator]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The marginals of Eq. 24: ``Φ((Σ*μ*)_i / √(N* + Σ* diag(σ*²) Σ*)_ii)``, ``N* = diag Σ*`` (``1``
        for the smoother form); ``diag`` by :meth:`~mil_core.ising.CARCoupling.smoothed_variance`."""
        if coupling.identity:
            return super()._instance_proba_in_context(mean, var, coupling, rngs)
        noise = self._noise_diagonal(coupling)
        smoothed_var, _ = coupling.smoothed_variance(var, self.exact_diag_max, n_probes=self.n_mc_samples, rngs=rngs)
        return _phi_and_spread(coupling.solve(mean) / np.sqrt(noise), smoothed_var / noise)

    def _noise_diagonal(self, coupling: CARCoupling) -> np.ndarray:
        """``diag Cov(m* | f*)``: ``diag Σ*`` (the paper's form) or ``1`` (the smoother form)."""
        if self.coupling_form == "smoother":
            return np.ones(int(coupling.offsets[-1]))
        return coupling.diagonal(self.exact_diag_max, self.diag_tol)[0]

    def _given_latent(self, coupling: CARCoupling) -> Callable[[np.ndarray], np.ndarray]:
        """``f ↦ p(m*_i > 0 | f*) = Φ((Σ*f*)_i / √N*_ii)`` for draws ``f`` (n, k)."""
        if coupling.identity:
            return super()._given_latent(coupling)
        scale = 1.0 / np.sqrt(self._noise_diagonal(coupling))[:, None]
        return lambda f: ndtr(coupling.solve(f) * scale)

    def _noise_covariance(self, Sigma: np.ndarray) -> np.ndarray:
        """The smoother form's noise is ``I`` (``m* = Σ*f* + ε``, ``ε ~ N(0, I)``)."""
        return np.eye(Sigma.shape[0]) if self.coupling_form == "smoother" else Sigma

    def _sampled_log_p0(
        self, mean: np.ndarray, var: np.ndarray, coupling: CARCoupling, b: int, coords: np.ndarray, rng: np.random.Generator
    ) -> tuple[float, float, float]:
        """The smoother form: Rao–Blackwellised Monte Carlo over ``f*`` (given ``f*`` the ``m*_i``
        are independent; :func:`~mil_core.ising.smoothed_field_log_p0`)."""
        if self.coupling_form != "smoother":
            return super()._sampled_log_p0(mean, var, coupling, b, coords, rng)
        return smoothed_field_log_p0(mean, var, coupling.bag_precision(b), n_draws=self.n_mc_samples, rng=rng)

    def _check_coords(self, coords: Any | None, bags: BagIndex) -> np.ndarray | None:
        if coords is None:
            if self._lam() > 0:
                raise ValueError("VGPMILPRI needs instance coords (grid positions) to build the neighbour graph; pass coords=")
            return None
        return check_coords(coords, bags)
