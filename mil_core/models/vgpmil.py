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

import numbers
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from scipy.special import expit

from .._backend import take_rows
from ..bags import BAG_RULES, TOP_FRACTION, BagRule, EmaxRule, bag_score, expected_max_of_others, log_prob_all_negative
from ..engine import BagBlock, FitTrace, GaussianQ, SparseGP, Summable, WhitenedBags, gaussian_update
from ..kernels import RBF
from ..likelihoods import GammaMixture, HyperbolicSecant, Psi, as_psi, log_add_exp, log_sigmoids
from ..predictive import bag_generators, probit_scale, sample_latent, shared_normal_draws
from ..relevance import RELEVANCE_FORMS
from .base import AUTO_VARIANCES, BagRuleChoice, SparseGPMILBase, store_params
from .hyper import HyperMILUpdates, HyperState, LogNormaliserName, hyper_updates, learnt_hyper_parameters, unwrap_hyper_state

__all__ = ["AUTO_H", "LARGE_BAGS", "VGPMIL_VARIANCES", "PsiMILUpdates", "PsiStats", "PsiVGPMIL", "VGPMIL", "GVGPMIL"]

AUTO_H: tuple[float, ...] = (100.0, 1e12)
"""Bag-likelihood odds that ``H="auto"`` chooses from with the kernel; the first is used with a
fixed kernel (``docs/MODELS.md``, "The bag likelihood's H")."""

LARGE_BAGS: int = 100
"""Median instances per bag (of the kernel choice's bags) from which the kernel choice tries the
hard likelihood H = 1e12 only with the constant kernel b = v (VGPMIL's ``H="auto"``, G-VGPMIL's
fixed 1e12): in bags of thousands its q(y) update (Eq. 25, ``emax="max"``) leaves all but one
instance of a positive bag to follow σ(E f), and without a constant term they drag the RBF
latent down with the negatives, witnesses included (``docs/BENCHMARKS.md``, "The hard bag
likelihood in large bags", session 29). The public MIL tables' bags hold a median of 4–27
instances; a slide's, 10³–10⁵ tiles."""

VGPMIL_VARIANCES: tuple[float, ...] = (0.25, *AUTO_VARIANCES)
"""Kernel variances that VGPMIL's and ψ-VGPMIL's ``kernel=None`` tries: the common grid and ¼
below it, which the held-out set whose witnesses lie outside a sphere wants
(``docs/MODELS.md``, "Automatic defaults")."""

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
    damping: float = 0.0

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
        log_pi, log1m_pi = log_sigmoids(logits)
        emax = expected_max_of_others(np.exp(log_pi), log1m_pi, block.offsets, self.emax)
        logits = damped_logits((log_pi, log1m_pi), mean + self.log_h * sign * (1.0 - emax), self.damping)
        log_pi, log1m_pi = log_sigmoids(logits)
        pi = np.exp(log_pi)

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


def damped_logits(old: tuple[np.ndarray, np.ndarray], new: np.ndarray, damping: float) -> np.ndarray:
    """Logit of ``damping·σ(old) + (1 − damping)·σ(new)``: the q(y) update (Eq. 25) damped in
    probability space, in log space so that logits of ±40 keep their precision. ``old`` is given
    as ``(log σ(old), log σ(−old))`` (:func:`log_sigmoids`), which the step has already computed.

    The undamped update is a Jacobi step on all π of a bag at once; with a large ``log H`` two
    instances of a positive bag can swap "the positive one" every sweep (a period-2 cycle,
    ``docs/MODELS.md``). A convex combination with the previous π removes that cycle.
    """
    if damping == 0.0:
        return new
    a, b = np.log(damping), np.log1p(-damping)
    (old_pos, old_neg), (new_pos, new_neg) = old, log_sigmoids(new)
    return log_add_exp(a + old_pos, b + new_pos) - log_add_exp(a + old_neg, b + new_neg)


class _LogisticGPMIL(BagRuleChoice, SparseGPMILBase):
    """Predictions for the logistic family (000, Eq. 30–37)."""

    bag_rules = BAG_RULES

    @abstractmethod
    def _psi(self) -> Psi: ...

    def _start_fit(self, X_train: Any, instance_labels: np.ndarray, offsets: np.ndarray | None = None,
                   coords: np.ndarray | None = None, choice: BagBlock | None = None, inducing: np.ndarray | None = None,
                   choice_memo: MutableMapping[str, Any] | None = None) -> PsiMILUpdates | HyperMILUpdates:
        """``H_`` = ``H`` (``"auto"``: the first of :data:`AUTO_H` until the kernel choice says
        otherwise), then the family's start."""
        if not (isinstance(self.H, str) and self.H == "auto") and not (isinstance(self.H, numbers.Real) and self.H > 1):
            raise ValueError(f"H must be 'auto' or a number > 1 (the bag-likelihood odds), got {self.H!r}")
        self.H_ = AUTO_H[0] if isinstance(self.H, str) else float(self.H)
        return super()._start_fit(X_train, instance_labels, offsets=offsets, coords=coords, choice=choice, inducing=inducing,
                                  choice_memo=choice_memo)

    def _auto_variances(self) -> tuple[float, ...]:
        """:data:`VGPMIL_VARIANCES` (G-VGPMIL overrides it with a grid under its bound)."""
        return VGPMIL_VARIANCES

    #: How far from the chosen variance, in steps of :meth:`_auto_variances`, the second stage of
    #: ``kernel=None`` tries the constant kernel b = v (``RBF.bias``; ``docs/MODELS.md``, "A constant
    #: kernel"); ``None``: not at all. VGPMIL 0, G-VGPMIL 1 (measured: ``docs/BENCHMARKS.md``).
    _constant_kernel_reach: int | None = None

    #: How far from the chosen variance, in grid steps, the second stage tries the relevance
    #: length scales (:func:`~mil_core.relevance.relevance_length_scales`); ``None``: not at all.
    #: VGPMIL and G-VGPMIL 1 (measured: ``docs/BENCHMARKS.md``, session 36).
    _relevance_reach: int | None = None

    def _reach(self, reach: int | None) -> int | None:
        """A refinement's reach (:attr:`_constant_kernel_reach`, :attr:`_relevance_reach`) for this
        fit: ``None`` (not tried) when hyper-parameters are learnt, whose gradients take the
        isotropic RBF alone."""
        return None if any(learnt_hyper_parameters(self).values()) else reach

    def _tries_constant_kernel(self) -> bool:
        """Whether ``kernel=None`` may choose the constant kernel (:meth:`_reach`)."""
        return self._reach(self._constant_kernel_reach) is not None

    def _auto_settings(self, bag_sizes: np.ndarray) -> tuple[dict[str, Any], ...]:
        """``H="auto"``: each of :data:`AUTO_H` beside every kernel variance (a fixed H: the variance
        only). Where the median bag holds :data:`LARGE_BAGS` instances or more and the model tries
        the constant kernel (:meth:`_tries_constant_kernel`), the hard likelihood — the largest of
        :data:`AUTO_H`, or a fixed H as large (G-VGPMIL's 1e12) — is tried with b = v only."""
        hard = max(AUTO_H)
        constant = {"kernel_bias": 1.0} if self._tries_constant_kernel() and np.median(bag_sizes) >= LARGE_BAGS else {}
        if isinstance(self.H, str):
            return tuple({"H": h, **(constant if h == hard else {})} for h in AUTO_H)
        return (constant if self.H >= hard else {},)

    def _refined_candidates(self, variance: float, setting: dict[str, Any],
                            settings: tuple[dict[str, Any], ...]) -> tuple[tuple[float, dict[str, Any]], ...]:
        """The constant kernel b = v with each of the first stage's ``settings`` (each H) at the variances
        within :attr:`_constant_kernel_reach` grid steps of the chosen one, and the relevance length
        scales (:func:`~mil_core.relevance.relevance_length_scales`) with the chosen ``setting`` at
        those within :attr:`_relevance_reach` — neither when hyper-parameters are learnt
        (:meth:`_reach`). Why the relevance kernel: with few
        informative features among many the isotropic ℓ = √D gives them 1/D of every distance
        (random problem 32, one of 200: 0.537 → 1.000); always on, it lost on the sparse ``text``
        set (0.900 → 0.806), so the split of the training bags decides (``docs/BENCHMARKS.md``,
        session 36). Each of :data:`~mil_core.relevance.RELEVANCE_FORMS` is a candidate, the
        proportional first: where no feature stands out in a split's training half the two
        coincide there (and share one fit), and the tie keeps the weights the splits scored even
        when the sharpening test passes on all the choice's bags (``cancer``, session 39)."""
        grid = self._auto_variances()
        i = grid.index(variance)

        def near(reach: int | None) -> tuple[float, ...]:
            reach = self._reach(reach)
            return () if reach is None else grid[max(i - reach, 0): i + reach + 1]

        constant = tuple((v, {**s, "kernel_bias": 1.0}) for v in near(self._constant_kernel_reach) for s in settings)
        return constant + tuple((v, {**setting, "relevance": form}) for form in RELEVANCE_FORMS for v in near(self._relevance_reach))

    def _make_updates(self, gp: SparseGP) -> PsiMILUpdates | HyperMILUpdates:
        if self.emax not in ("exact", "max"):
            raise ValueError(f"emax must be 'exact' or 'max', got {self.emax!r}")
        if not 0.0 <= self.damping < 1.0:
            raise ValueError(f"damping must be in [0, 1), got {self.damping}")
        updates = PsiMILUpdates(gp=gp, psi=self._psi(), log_h=float(np.log(self.H_)), emax=self.emax, damping=float(self.damping))
        return hyper_updates(self, updates)

    def _bag_proba_from_state(self, gp: SparseGP, glob: GaussianQ | HyperState, X_sorted: Any, offsets: np.ndarray) -> np.ndarray:
        return bag_score(self._instance_proba_from_state(gp, glob, X_sorted), offsets, self.bag_rule_)

    def _bag_probas_from_state(self, gp: SparseGP, glob: GaussianQ | HyperState, X_sorted: Any, offsets: np.ndarray,
                               rules: tuple[str | None, ...]) -> dict[str | None, np.ndarray]:
        """Every rule from one set of instance probabilities (the kernel choice's candidates)."""
        p = self._instance_proba_from_state(gp, glob, X_sorted)
        return {rule: bag_score(p, offsets, self.bag_rule_ if rule is None else rule) for rule in rules}

    @staticmethod
    def _instance_proba_from_state(gp: SparseGP, glob: GaussianQ | HyperState, X_sorted: Any) -> np.ndarray:
        """``σ(κ(σ²) μ)`` of a fit state's latent at each row (the closed form validation scores with)."""
        if isinstance(glob, HyperState):
            gp, glob = glob.gp, glob.q
        mean, var = gp.whiten(X_sorted).latent_moments(glob)
        return expit(probit_scale(mean, var))

    def _finish_fit(self, trace: FitTrace, monitor: Any = None) -> None:
        super()._finish_fit(trace, monitor)
        unwrap_hyper_state(self)

    def _instance_moments(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        return self.gp_.whiten(X).latent_moments(self.q_)

    def _row_chunks(self, n_rows: int) -> Iterator[slice]:
        """Row slices of at most 2²² Monte Carlo draws each."""
        chunk = max(1, (1 << 22) // self.n_mc_samples)
        return (slice(start, start + chunk) for start in range(0, n_rows, chunk))

    def _sample_latent(self, mean: np.ndarray, var: np.ndarray, rng: Any) -> Iterator[tuple[slice, np.ndarray]]:
        """Yield (row slice, samples (rows, L)) of f* ~ N(mean, var), chunk by chunk."""
        for rows in self._row_chunks(mean.shape[0]):
            yield rows, sample_latent(mean[rows], var[rows], self.n_mc_samples, rng)

    def predict_instance_proba(
        self, X: Any, *, return_std: bool = False, method: Literal["mc", "probit"] = "probit"
    ) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Instance probability ``p(y* = 1) = E[σ(f*)]`` (Eq. 31).

        ``method="probit"`` (default): the closed form ``σ(μ / sqrt(1 + πσ²/8))``, deterministic and
        the score the kernel choice ranks and the pipeline writes; its std, when asked for, comes from
        Monte Carlo. ``method="mc"``: ``n_mc_samples`` draws, seeded by ``random_state`` (Eq. 32; std
        by Eq. 33). Every row's draws are ``f*ₙ = μₙ + σₙ z`` with the same standard normals ``z``, so
        a row's numbers do not depend on the other rows predicted with it.
        """
        X, _ = self._check_predict_input(X)
        return self._instance_proba(X, return_std=return_std, method=method)

    def _instance_proba(self, X: Any, *, return_std: bool, method: str) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """:meth:`predict_instance_proba` on rows already checked (and standardised)."""
        mean, var = self._instance_moments(X)
        need_mc = method == "mc" or return_std
        if method not in ("mc", "probit"):
            raise ValueError(f"method must be 'mc' or 'probit', got {method!r}")
        p = expit(probit_scale(mean, var))
        sd = np.zeros_like(p)
        if need_mc:
            z = shared_normal_draws(self.random_state, self.n_mc_samples)  # each row's draws its own moments' only
            for rows in self._row_chunks(mean.shape[0]):
                s = expit(mean[rows, None] + np.sqrt(var[rows])[:, None] * z)
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
        method: Literal["mc", "probit"] = "probit",
        rule: BagRule | None = None,
    ) -> tuple[np.ndarray, np.ndarray] | tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Bag probability by a MIL rule: ``keys, p`` or ``keys, p, std``; ``keys = np.unique(bag_ids)``.

        ``method`` as in :meth:`predict_instance_proba` (default the closed form, as the pipeline).
        ``rule`` (default: the fitted ``bag_rule_``) combines the instance probabilities
        (:func:`mil_core.bags.bag_score`): ``"noisy_or"`` is the paper's ``1 − Π(1 − pₙ)``
        (Eq. 34–35, in log space), ``"top_fraction"`` the mean of the top 5 %, ``"max"``, ``"mean"``.
        The std is the Monte Carlo spread of the same rule applied to draws of ``σ(f*)`` (Eq. 37),
        drawn bag by bag.
        """
        X, bags = self._check_predict_input(X, bag_ids)
        rule = self.bag_rule_ if rule is None else rule
        if rule not in BAG_RULES:
            raise ValueError(f"rule must be one of {', '.join(BAG_RULES)}, got {rule!r}")
        p_inst = self._instance_proba(X, return_std=False, method=method)[bags.order]
        offsets = bags.offsets
        p = bag_score(p_inst, offsets, rule)
        if not return_std:
            return bags.keys, p
        mean, var = self._instance_moments(take_rows(X, bags.order))
        sd = np.empty(bags.n_bags)
        for b, rng in enumerate(bag_generators(self.random_state, bags.keys)):  # a bag's draws its own
            rows = slice(offsets[b], offsets[b + 1])
            sd[b] = _rule_draws(rule, self._sample_latent(mean[rows], var[rows], rng), offsets[b + 1] - offsets[b]).std()
        return bags.keys, p, sd


def _rule_draws(rule: str, chunks: Iterable[tuple[slice, np.ndarray]], n: int) -> np.ndarray:
    """Monte Carlo draws (L,) of one bag's ``rule`` score from chunks of latent draws f (rows, L),
    accumulated chunk by chunk, so a bag of 10⁵ instances never holds all its draws at once."""
    acc = None
    k = max(1, int(np.ceil(TOP_FRACTION * n)))
    for _, f in chunks:
        if rule == "noisy_or":
            part = np.sum(log_sigmoids(f)[1], axis=0)
            acc = part if acc is None else acc + part
        elif rule == "max" or rule == "mean":
            part = expit(f).max(axis=0) if rule == "max" else expit(f).sum(axis=0)
            acc = part if acc is None else (np.maximum(acc, part) if rule == "max" else acc + part)
        else:  # top_fraction: a running top-k per column
            both = expit(f) if acc is None else np.concatenate([acc, expit(f)], axis=0)
            acc = -np.partition(-both, min(k, both.shape[0]) - 1, axis=0)[:k]
    if rule == "noisy_or":
        return -np.expm1(acc)
    if rule == "mean":
        return acc / n
    return acc if rule == "max" else acc.mean(axis=0)


_COMMON_PARAMS = """
    n_inducing : int, default=100
        Number of inducing points M (k-means, half from each bag class). A training set with
        fewer instances makes every instance one (the exact GP); a warning says so when
        ``n_inducing`` is not the default.
    kernel : RBF or None
        Kernel; ``None`` (default) chooses the variance v ∈ {¼, 1, 4, 16, 64} (G-VGPMIL: 1/32 … 2,
        see ``GVGPMIL._auto_variances``) of ``RBF(v, length_scale=√D)``, VGPMIL and G-VGPMIL also
        whether a constant kernel b = v is added to it (``RBF.bias``: far from the training data f
        reverts to a shift the data set rather than to 0; tried in a second stage near the chosen
        variance, and in bags of a median :data:`LARGE_BAGS`+ instances with H = 1e12 from the
        first; not with hyper-parameter learning), the number of sweeps and
        (``bag_rule="auto"``) the bag rule by 3 repeats of a 2-fold split of the training bags
        (:meth:`~mil_core.models.base.SparseGPMILBase._select_kernel`).
    standardize : bool, default=True
        Fit and predict on features standardised with the training instances' mean and scale,
        ``feature_mean_`` / ``feature_scale_`` (:class:`~mil_core.models.base.FeatureStandardisation`).
    H : float or "auto", default="auto" (G-VGPMIL: 1e12, the paper's)
        Bag-likelihood odds ``H^{G_b}/(H+1)`` (Eq. 4). ``"auto"``: 100 or 1e12
        (:data:`AUTO_H`), chosen with the kernel variance and sweeps on the same split of the
        training bags (the point with the best held-out AUC); with a fixed kernel 100. Where the
        choice's median bag holds :data:`LARGE_BAGS` instances or more, the kernel choice tries
        H = 1e12 (here or G-VGPMIL's) only with the constant kernel. The used value is ``H_``.
        Each default is measured (``docs/MODELS.md``, "The bag likelihood's H"): for VGPMIL
        neither value is best everywhere (1e12 raised MUSK1 and the high-dimensional set, lowered
        the large bags and ``sizes``), and the per-fit choice beat both over 13 sets; for G-VGPMIL
        1e12 raised the held-out bag AUC on 7 of 13 sets.
    emax : {"max", "exact"}, default="max"
        ``E[max y_{b∖n}]`` rule: the reference codes' max of the others' π, or the mean-field
        ``1 − Π_{j≠n}(1 − π_j)`` (whose ELBO is a true bound). ``"max"`` is the default because
        it gave the higher CV bag AUC in 5 of 6 model × dataset pairs (``docs/MODELS.md``).
    damping : float in [0, 1), default=0.5
        Each sweep's q(y) is ``damping·π_old + (1 − damping)·π_new`` (Eq. 25 damped): without it
        the fixed point can cycle with period 2 (H = 1e12 on MUSK1: bag scores move by 0.23 per
        sweep forever); 0.5 converges there for both E[max] rules.
    bag_rule : {"auto", "top_fraction", "max", "mean", "noisy_or"}, default="auto"
        How instance probabilities make a bag score, in ``predict_bag_proba``, in validation
        (early stopping, kernel choice) and in the pipeline (:func:`mil_core.bags.bag_score`).
        ``"auto"``: ``top_fraction``, unless the kernel choice's split finds ``max`` or ``mean``
        better by more than 2 paired standard errors and 0.1 held-out AUC (``mean``: the errors
        alone where ``top_fraction`` is below chance there;
        :func:`~mil_core.models.base.clearly_better_rule`) — where ``top_fraction`` ranks bags
        by their size, e.g. small positive bags with weak witnesses among large negative ones;
        with a fixed kernel ``top_fraction``. The rule used is ``bag_rule_``.
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
        Kernel, inducing points ``gp_.Z`` (in standardised units with ``standardize``) and ``chol(Kzz)``.
    q_ : GaussianQ
        Whitened q(v) = N(m', S'); u = L v.
    elbo_ : ndarray
        ELBO per iteration (with ``emax="max"`` a monitor, not a bound).
    n_iter_, converged_, kernel_, n_features_in_, classes_, bag_rule_, H_, feature_mean_, feature_scale_
    kernel_selection_, setting_selection_, auto_max_iter_
        What ``kernel=None`` chose from (:meth:`~mil_core.models.base.SparseGPMILBase._select_kernel`).
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
        standardize: bool = True,
        H: float | Literal["auto"] = "auto",
        emax: EmaxRule = "max",
        damping: float = 0.5,
        bag_rule: BagRule | Literal["auto"] = "auto",
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
        standardize: bool = True,
        H: float | Literal["auto"] = "auto",
        emax: EmaxRule = "max",
        damping: float = 0.5,
        bag_rule: BagRule | Literal["auto"] = "auto",
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

    _constant_kernel_reach = 0  # b = v with each H at the chosen variance (docs/BENCHMARKS.md, session 25)
    _relevance_reach = 1

    def _psi(self) -> Psi:
        return HyperbolicSecant()


class GVGPMIL(_LogisticGPMIL):
    __doc__ = (
        """G-VGPMIL: ψ-VGPMIL with a Gamma(α, β) mixing density, ``θ(c) = α/(β + c²/2)``
    (seed 000, Sec. 5, Eq. 38).

    Parameters
    ----------
    alpha, beta : float, default=1.0, 1.0
        The Gamma parameters (the paper's grid: α ∈ {0.5, 1}, β ∈ {1, 2.5, 4}); initial values
        when ``learn_psi``. (1, 1) is the only point of the grid with α/√(2β) > ½, where the
        pseudo-likelihood has a finite optimum (Notes); the paper's (1, 2.5) ran away to a bag AUC
        of 0.33 on MUSK2 (``docs/MODELS.md``).
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
        beta: float = 1.0,
        kernel: RBF | None = None,
        standardize: bool = True,
        H: float | Literal["auto"] = 1e12,
        emax: EmaxRule = "max",
        damping: float = 0.5,
        bag_rule: BagRule | Literal["auto"] = "auto",
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

    _constant_kernel_reach = 1  # level with trying every variance; the chosen one alone lost text −0.023 (docs/BENCHMARKS.md, session 25)
    _relevance_reach = 1

    def _psi(self) -> Psi:
        return GammaMixture(alpha=self.alpha, beta=self.beta)

    def _auto_variances(self) -> tuple[float, ...]:
        """``kernel=None`` tries v ∈ v_max·(1/64, 1/16, 1/4, 1) with ``v_max = 4α² − 2β`` (α = β = 1:
        1/32 … 2): below it every instance has a finite fixed point (Notes), whatever its position.
        The grid is the common one (×4 steps over a 64× range) hung from the bound: the
        earlier 8× range (0.25 … 2) could not reach the small variances that the noisy Fox-like set
        (v = 1/32: 0.628 bag AUC against 0.615 at 0.25) and the text-like set (1/8: 0.878 against
        0.862) want, while MUSK1 and digits want 0.5–2 (``docs/MODELS.md``).

        An instance with π ≈ 0 and latent variance s is stationary where ``−½ = θ(c)·f``,
        ``c² = f² + s`` (Eq. 38), i.e. ``f²/2 + 2αf + β + s/2 = 0``, which has a real root only
        when ``s ≤ 4α² − 2β``. Far from the inducing points s is the prior variance v, so a larger
        v lets those instances run to f → −∞ (the large-bag collapse to bag AUC 0.50,
        ``docs/MODELS.md``). Where ``4α² − 2β ≤ 0`` no variance is safe and the common grid
        (:data:`~mil_core.models.base.AUTO_VARIANCES`) is kept."""
        bound = 4.0 * self.alpha**2 - 2.0 * self.beta
        return tuple(bound * f for f in (1 / 64, 1 / 16, 0.25, 1.0)) if bound > 0 else AUTO_VARIANCES

    def _smaller_variance_within_se(self) -> float:
        """½: a smaller variance within half a standard error of the best point is chosen. Here the
        held-out AUC of neighbouring variances is often within noise (text-like set: ⅛ and ½ differ by
        less than their split-to-split spread on half the bags), and the smaller one keeps the
        instances further from the runaway above ``4α² − 2β`` (:meth:`_auto_variances`);
        ``docs/MODELS.md``, "Automatic defaults", has the measurement."""
        return 0.5
