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
λ = 0 it is the exact ELBO and never decreases after the first sweep (below).

**Prior mean and start (large bags).** The latent is ``f = b + A'v``: a constant prior mean ``b``
(:class:`ProbitQ` carries it beside ``q(v)``). With ``learn_prior_mean`` it is learnt by
empirical Bayes: after every global update, safeguarded Newton steps on ``Σ_b log Z_b(b)`` — the
ELBO's only term that depends on ``b`` once ``q(m)`` is optimal for the new ``b`` — each step one
probe sweep (:class:`PriorMeanProbe` → :class:`PriorMeanStats`, value, gradient and curvature in
closed form from the independent truncated moments; a step that lowers the value is halved; the
probes and the next sweep share ``q(v)`` and with it ``A'm``, cached in :class:`ProbitLocal`: only
the first probe after a global update reads the features), so
the ELBO does not decrease across a ``b`` step (with ``moments="mean_field"`` and λ > 0 the steps use the
diagonal form of ``log Z_b``, an approximation of the bound that fit tracks). Why: with a zero mean, a positive bag of
10³–10⁴ instances is "surely positive" (``P(all negative) = Π Φ(−μ_i) ≈ 0``) at any instance
probability that is not tiny, so its likelihood carries no information and its instances are
regressed towards the negatives around them; the closed-form sweeps lower the whole field only by
the small truncated-mean pushes ``φ(μ)/Φ(−μ)`` of the negative bags (hundreds of sweeps), and
the witnesses are dragged down with it (instance AUC 0.79 → 0.59 on the large-bag set). A learnt
``b`` lowers the field in a few steps to where ``P(all negative)`` of a positive bag is of order
one and its likelihood points at its witnesses. The first sweep starts from the bag labels (every
instance of a positive bag truncated to ``m > 0``, as VGPMIL's first sweep sets ``π`` from the bag
label): from the prior state a large positive bag says nothing, and from a start that says
nothing the positive bags' pull goes to whichever instance happens to be highest. With a learnt
``b`` the first sweep only scores the prior state and ``b`` is learnt on it (at ``q(v)`` = prior
that is the constant instance probability that best explains the bag labels and sizes), so that
the label start (second sweep) regresses on the contrast between "above zero" and that level.
``docs/BENCHMARKS.md`` ("Probit family defaults") has the measurements.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
from scipy.special import log_ndtr

from .._backend import array_namespace, to_numpy
from ..bags import segment_logsumexp, segment_sum
from ..engine import BagBlock, GaussianQ, SparseGP, Summable, WhitenedBlock, gaussian_update, transposed_product
from ..ising import CARCoupling, Neighbourhood
from ..orthant import mean_field_gap, mean_field_negative_orthant
from ..truncnorm import log1mexp, log_inverse_mills, positive_bag_log_normaliser, positive_bag_means, upper_truncated_moments

__all__ = ["Moments", "CouplingForm", "ProbitBags", "ProbitStats", "ProbitQ", "PriorMeanProbe", "PriorMeanStats",
           "PriorMeanInputs", "ProbitLocal", "ProbitMILUpdates", "as_probit_local", "fresh_local", "positive_bag_offsets"]

Moments = Literal["diagonal", "mean_field"]
CouplingForm = Literal["ising", "smoother"]


@dataclass(frozen=True)
class ProbitBags:
    """A prepared partition: whitened features, bag structure, the coupling ``Σ`` and what does
    not change across iterations (``diag Σ``, ``log det P_b``, the mean-field gap, ``G'_p``, and
    ``Σ1``, through which the prior mean ``b`` enters ``m ~ N(Σ(b1 + A'v), ·)``)."""

    features: WhitenedBlock
    offsets: np.ndarray
    labels: np.ndarray
    coupling: CARCoupling
    marginal_var: np.ndarray
    logdet_precision: np.ndarray
    mean_field_gap: np.ndarray
    gram: np.ndarray
    fitc_trace: float
    ones_smoothed: np.ndarray

    @property
    def instance_labels(self) -> np.ndarray:
        return np.repeat(self.labels, np.diff(self.offsets))


@dataclass(frozen=True)
class ProbitStats(Summable):
    """A partition's contribution: ``G'_p`` (constant), ``r'_p = Σ A'ᵀE[m]``, ELBO data terms, and
    of those the FITC residual's ``−½ Σ_i (Σ_b)_ii Var_FITC,i`` (``kernel_term``: no update of
    ``q(m)``, ``q(v)`` or ``b`` changes it, only the kernel and λ;
    :func:`~mil_core.engine.optimise`'s convergence test leaves it out of its scale)."""

    precision: np.ndarray
    shift: np.ndarray
    elbo: float
    n_instances: int
    kernel_term: float


@dataclass(frozen=True)
class ProbitQ(GaussianQ):
    """Whitened ``q(v) = N(mean, cov)`` and the latent's constant prior mean ``b``: ``f = b + A'v``.
    ``started=False`` (a learnt ``b`` before its first step): the first sweep only scores the prior
    state, ``q(v)`` stays the prior and ``b`` is learnt on it before the label start."""

    prior_mean: float = 0.0
    started: bool = True


@dataclass(frozen=True)
class PriorMeanProbe:
    """A global state that makes :meth:`ProbitMILUpdates.partition_step` return the partition's
    :class:`PriorMeanStats` at ``q(v)`` and prior mean ``b`` and leave its local state alone."""

    q: GaussianQ
    prior_mean: float


@dataclass(frozen=True)
class PriorMeanStats(Summable):
    """``Σ_b log Z_b`` and its first and second derivatives in the prior mean ``b`` (module docstring)."""

    value: float
    grad: float
    curvature: float


@dataclass(frozen=True)
class PriorMeanInputs:
    """What ``Σ_b log Z_b(b)`` needs of a partition at one ``q(v)``: ``latent = Σ A'm``, the part of
    ``E[m]``'s mean ``Σ(b1 + A'v)`` (Eq. 18) free of ``b``, at the ``q(v)`` whose mean is ``q_mean``,
    and the block's ``Σ1``, marginal sd, bag offsets and labels: vectors of the partition's length,
    with no features."""

    q_mean: np.ndarray
    latent: np.ndarray
    ones_smoothed: np.ndarray
    sd: np.ndarray
    offsets: np.ndarray
    labels: np.ndarray

    @classmethod
    def at(cls, block: ProbitBags, q: GaussianQ) -> PriorMeanInputs:
        return cls(q_mean=array_namespace(q.mean).asarray(q.mean, copy=True),
                   latent=block.coupling.solve(block.features.latent_mean(q.mean)), ones_smoothed=block.ones_smoothed,
                   sd=np.sqrt(block.marginal_var), offsets=block.offsets, labels=block.labels)

    def is_for(self, q: GaussianQ) -> bool:
        return self.q_mean.shape == q.mean.shape and bool(array_namespace(q.mean).all(self.q_mean == q.mean))


@dataclass
class ProbitLocal:
    """A partition's local state: ``warm``, the warm start of ``E[m]`` (NaN: the next started sweep
    starts from the bag labels), and ``inputs`` (:class:`PriorMeanInputs`) at the last ``q(v)`` seen.
    A learnt ``b``'s probe sweeps and the sweep after them all see one ``q(v)``: with ``inputs``
    cached, ``A'm`` (an N×M product) and the coupling's solve run once per global update, and a
    probe needs no features (:meth:`ProbitMILUpdates.step_from_local`: a streaming executor skips
    reading the block). Transient: not saved in checkpoints, rebuilt when missing or stale."""

    warm: np.ndarray
    inputs: PriorMeanInputs | None = field(default=None, metadata={"transient": True})

    def has_inputs_for(self, q: GaussianQ) -> bool:
        """Whether the cached :class:`PriorMeanInputs` were computed at this ``q(v)``."""
        return self.inputs is not None and self.inputs.is_for(q)


def as_probit_local(local: ProbitLocal | np.ndarray) -> ProbitLocal:
    """A partition's local state; a bare warm-start array (a training checkpoint written before
    :class:`ProbitLocal`, session 17) is taken as one, so such a run still resumes."""
    return local if isinstance(local, ProbitLocal) else ProbitLocal(warm=local)


def fresh_local(n_instances: int) -> ProbitLocal:
    """The local state of a partition before its first sweep: NaN marks "start from the bag labels"."""
    return ProbitLocal(warm=np.full(n_instances, np.nan))


def positive_bag_offsets(sizes: np.ndarray, positive: np.ndarray) -> np.ndarray:
    """CSR offsets of the positive bags' rows taken out of a partition (``positive``: per bag)."""
    return np.concatenate([[0], np.cumsum(sizes[positive])]).astype(np.int64)


def prior_mean_of(q: GaussianQ) -> float:
    """``b`` of a fitted state (0 for a plain :class:`~mil_core.engine.GaussianQ`, e.g. the Gibbs reference's)."""
    return float(getattr(q, "prior_mean", 0.0))


@dataclass(frozen=True)
class ProbitMILUpdates:
    """Partition step and global update of VGPMIL-PR(-I). The local state of a partition is a
    :class:`ProbitLocal`: the mean-field ``E[m]`` on the negative orthant (the warm start of
    ``moments="mean_field"``) and the cached inputs of the prior mean's probes."""

    gp: SparseGP
    lam: float = 0.0
    neighbourhood: Neighbourhood = 4
    moments: Moments = "diagonal"
    exact_diag_max: int = 2000
    diag_tol: float = 1e-6
    mean_field_tol: float = 1e-12
    mean_field_max_sweeps: int = 500
    coupling_form: CouplingForm = "ising"
    prior_mean: float = 0.0
    learn_prior_mean: bool = False
    prior_mean_steps: int = 4

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
            ones_smoothed=coupling.solve(np.ones(int(block.offsets[-1]))),
        )

    def init_local(self, block: ProbitBags) -> ProbitLocal:
        return fresh_local(int(block.offsets[-1]))

    def init_global(self) -> ProbitQ:
        return replace(ProbitQ.prior(self.gp.n_inducing), prior_mean=float(self.prior_mean), started=not self.learn_prior_mean)

    def partition_step(
        self, block: ProbitBags, local: ProbitLocal, q: GaussianQ | PriorMeanProbe
    ) -> tuple[ProbitStats | PriorMeanStats, ProbitLocal]:
        local = self.with_inputs(block, as_probit_local(local), q.q if isinstance(q, PriorMeanProbe) else q)
        if isinstance(q, PriorMeanProbe):
            return self.prior_mean_terms(local.inputs, q.prior_mean), local
        warm, b = local.warm, prior_mean_of(q)
        ones_smoothed = block.ones_smoothed  # Σ1: m ~ N(Σ(b1 + A'v), ·)
        mu = local.inputs.latent + b * ones_smoothed  # Eq. 18
        pending = warm.size > 0 and bool(np.isnan(warm[0]))
        start = pending and bool(getattr(q, "started", True))
        expected_m, log_z, new_warm = self.truncated_means(block, mu, np.zeros_like(warm) if pending else warm)
        warm = warm if pending and not start else new_warm  # the label start waits for a started state
        kernel_term = -0.5 * block.fitc_trace
        elbo = np.sum(log_z) - 0.5 * float(np.sum(q.cov * block.gram)) + kernel_term
        if start:  # the first sweep: every instance of a positive bag truncated to m > 0 (module docstring)
            positive = np.repeat(block.labels == 1, np.diff(block.offsets))
            above = -upper_truncated_moments(-mu, local.inputs.sd)[0]
            expected_m = np.where(positive, above, expected_m)
        targets = expected_m - b * ones_smoothed
        if self.coupling_form == "smoother":  # E[mᵀΣf] = (ΣE[m])ᵀA'v
            targets = block.coupling.solve(targets)
        stats = ProbitStats(
            precision=block.gram,
            shift=block.features.project(targets),
            elbo=float(elbo),
            n_instances=int(mu.shape[0]),
            kernel_term=float(kernel_term),
        )
        return stats, replace(local, warm=warm)

    @staticmethod
    def with_inputs(block: ProbitBags, local: ProbitLocal, q: GaussianQ) -> ProbitLocal:
        """``local`` with its :class:`PriorMeanInputs` at ``q(v)``: the cached ones when they were
        computed at this ``q(v)``, else new ones."""
        if local.has_inputs_for(q):
            return local
        return ProbitLocal(warm=local.warm, inputs=PriorMeanInputs.at(block, q))

    def step_from_local(self, local: ProbitLocal, glob: Any) -> tuple[PriorMeanStats, ProbitLocal] | None:
        """The partition step without the block where the local state holds all it needs: a prior-mean
        probe at the ``q(v)`` of the cached inputs (after the first probe of a global update); ``None``
        otherwise (:func:`mil_core.engine.step_from_local`)."""
        local = as_probit_local(local)
        if isinstance(glob, PriorMeanProbe) and local.has_inputs_for(glob.q):
            return self.prior_mean_terms(local.inputs, glob.prior_mean), local
        return None

    def prior_mean_terms(self, inputs: PriorMeanInputs, b: float) -> PriorMeanStats:
        """``Σ_b log Z_b`` at prior mean ``b`` and the ``q(v)`` of ``inputs``, and its derivatives in
        ``b``, with the independent (diagonal) truncated moments: ``α_i = μ_i/σ_i``,
        ``dα_i/db = c_i = (Σ1)_i/σ_i > 0``; a negative bag has ``log Z = Σ log Φ(−α_i)``, a
        positive bag ``log(1 − e^{−t})`` with ``t = Σ −log Φ(−α_i)``, ``t' = Σ r_i c_i``,
        ``t'' = Σ r_i(r_i − α_i)c_i²`` (``r`` the inverse Mills ratio), so ``L' = ρt'`` and
        ``L'' = ρt'' − L'² − L't'`` with ``ρ = e^{−t}/(1 − e^{−t})``, all in log space where they
        can underflow."""
        offsets, labels, ones_smoothed, sd = inputs.offsets, inputs.labels, inputs.ones_smoothed, inputs.sd
        sizes = np.diff(offsets)
        alpha = (inputs.latent + b * ones_smoothed) / sd
        c = ones_smoothed / sd
        log_q = log_ndtr(-alpha)
        log_r = log_inverse_mills(alpha, log_q)
        r = np.exp(log_r)
        slope = np.clip(r - alpha, 0.0, None)  # r(α) − α > 0: the truncated variance's factor
        positive = labels == 1
        negative_rows = np.repeat(~positive, sizes)
        value = float(np.sum(log_q[negative_rows]))
        grad = -float(np.sum((r * c)[negative_rows]))
        curvature = -float(np.sum((r * slope * c**2)[negative_rows]))
        if np.any(positive):  # on the positive bags' rows only
            rows, bags = ~negative_rows, positive_bag_offsets(sizes, positive)
            log_p0, log_z = positive_bag_log_normaliser(alpha[rows], bags, log_q[rows])
            log_r, log_c = log_r[rows], np.log(c[rows])
            with np.errstate(divide="ignore"):
                log_t1 = segment_logsumexp(log_r + log_c, bags)
                log_t2 = segment_logsumexp(log_r + np.log(slope[rows]) + 2.0 * log_c, bags)
            log_rho = log_p0 - log_z
            first = np.exp(log_rho + log_t1)
            second = np.exp(log_rho + log_t2) - first**2 - first * np.exp(log_t1)
            value += float(np.sum(log_z))
            grad += float(np.sum(first))
            curvature += float(np.sum(second))
        return PriorMeanStats(value=value, grad=grad, curvature=curvature)

    def hyper_step(self, sweep: Callable[[Any], Any], iteration: int, q: ProbitQ) -> ProbitQ:
        """``learn_prior_mean``: up to ``prior_mean_steps`` safeguarded Newton steps on ``b`` (one
        probe sweep each; a step that lowers ``Σ log Z_b`` is halved), run by
        :func:`~mil_core.engine.optimise` after each global update (module docstring)."""
        if not self.learn_prior_mean:
            return q
        b = prior_mean_of(q)
        here = sweep(PriorMeanProbe(q=q, prior_mean=b))
        for _ in range(self.prior_mean_steps):
            step = -here.grad / here.curvature if here.curvature < 0 else np.sign(here.grad)
            step = float(np.clip(step, -1.0, 1.0))
            while abs(step) > 1e-4:
                there = sweep(PriorMeanProbe(q=q, prior_mean=b + step))
                if there.value >= here.value:
                    break
                step /= 2.0
            if abs(step) <= 1e-4:
                break
            b, here = b + step, there
        return ProbitQ(mean=q.mean, cov=q.cov, prior_mean=b, started=True)

    def truncated_means(self, block: ProbitBags, mu: np.ndarray, warm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``E[m]`` of ``q(m_b)`` (Eq. 15, 19–20), ``log Z_b`` per bag and the new warm start."""
        offsets, labels = block.offsets, block.labels
        sizes, positive_bags = np.diff(offsets), labels == 1
        positive = np.repeat(positive_bags, sizes)
        if self.moments == "diagonal" or self.coupling_form == "smoother" or block.coupling.identity:
            sd = np.sqrt(block.marginal_var)
            log_q = log_ndtr(-mu / sd)  # log Φ(−α), shared by the three below
            neg_mean, _ = upper_truncated_moments(mu, sd, log_q)  # every row: the warm start
            expected, log_z = neg_mean.copy(), segment_sum(log_q, offsets)
            if np.any(positive_bags):  # the positive bags' moments on their rows only
                expected[positive], log_z[positive_bags] = positive_bag_means(
                    mu[positive], sd[positive], positive_bag_offsets(sizes, positive_bags), log_q[positive])
            return expected, log_z, neg_mean
        neg_mean, log_p0_bound = mean_field_negative_orthant(
            block.coupling, mu, warm, block.logdet_precision, self.mean_field_tol, self.mean_field_max_sweeps
        )
        log_p0 = np.minimum(log_p0_bound + block.mean_field_gap, 0.0)
        log_z_pos = log1mexp(np.log(np.maximum(-log_p0, 1e-300)))
        ratio = np.repeat(np.exp(log_p0 - log_z_pos), np.diff(offsets))
        pos_mean = mu + ratio * (mu - neg_mean)
        return np.where(positive, pos_mean, neg_mean), np.where(labels == 1, log_z_pos, log_p0), neg_mean

    def global_update(self, stats: ProbitStats, q: GaussianQ) -> tuple[ProbitQ, float]:
        """New q(v) (Eq. 16–17, whitened; the prior mean unchanged) and the ELBO of the state the
        statistics came from."""
        objective = stats.elbo - q.kl_to_prior()
        if not getattr(q, "started", True):  # the prior state scored; b is learnt on it next (ProbitQ)
            return q, objective
        new = gaussian_update(stats.precision, stats.shift)
        return ProbitQ(mean=new.mean, cov=new.cov, prior_mean=prior_mean_of(q)), objective
