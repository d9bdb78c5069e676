"""The exact-posterior Gibbs sampler of the probit GP-MIL model (seed 003, §2), with the Ising/CAR
coupling of seed 002 (Eq. 12) when λ > 0: a slow gold standard for VGPMIL-PR(-I) on small data.

Target: ``p(v, m | y)`` for ``v ~ N(0, I)`` (whitened ``u = Lv``), ``m_b | v ~ N(Σ_b A'_b v, Σ_b)``
and the hard MIL bag likelihood — the model whose mean-field posterior the variational fit
approximates (the FITC residual only adds a constant to its ELBO). Alternating exact conditionals:

* ``m_i | m_{−i}, v, y``: the Gaussian conditional ``N(μ_i + (λ/P_ii)Σ_{j~i}(m_j − μ_j), 1/P_ii)``
  (``μ = Σ_b A'_b v``, ``P = I + λC``), truncated to ``m_i < 0`` in a negative bag; in a positive
  bag truncated to ``m_i ≥ 0`` when all other instances of the bag are negative, else
  unconstrained (seed 003 Eq. 13–14). Instance ``k`` of every bag is updated at once (bags are
  conditionally independent given ``v``), instances of a bag one after another. A bag without
  neighbours (every bag at λ = 0) is drawn whole from ``m_b | v, y_b`` instead
  (:func:`_uncoupled_bag_draws`: exact, vectorised over bags, no loop over instances);
* a scale move (marginal augmentation: Liu & Sabatti 2000, van Dyk & Meng 2001): the bag likelihood
  depends on the signs of ``m`` only, so ``m ← g·m`` with ``g² ~ Gamma(N/2, rate Q/2)``,
  ``Q = mᵀ(P − A'(I + G')⁻¹A'ᵀ)m`` (``m``'s marginal precision, ``v`` integrated out), leaves the posterior
  invariant; it moves the overall magnitude of the latent field, a direction in which the two-block
  scan mixes slowly (``docs/BENCHMARKS.md``, "Gibbs reference": effective sample sizes with and without it);
* ``v | m ~ N((I + G')⁻¹ A'ᵀm, (I + G')⁻¹)``, ``G' = Σ_b A'_bᵀΣ_bA'_b`` (seed 003 Eq. 7–9 with
  ``q(m)`` a point mass).

Map → sum → small solve (DESIGN §1–2): a sweep is the m-step on every partition of whole bags,
which returns ``r'_p = A'_pᵀm_p``, ``m_pᵀP_pm_p`` (and the constant ``G'_p``), the sum, and the scale
move and v-step on the client (an M×M Cholesky, one Gamma and one M-dimensional draw). The chain's randomness is *keyed*, not
streamed: bag ``b``'s uniforms at sweep ``t`` come from the counter-based Philox generator keyed by
``(seed, t, b)`` (``b``: the bag's position among the fit's bags, ``BagBlock.bag_index``), and the
v-step's normals from the key ``(seed, t)``. Every draw is therefore a function of what it
belongs to, not of the order in which a process happens to ask for it, so a fit split into any
partitions, on any number of workers, resumed from any checkpoint, draws exactly the numbers of
the serial fit and gives its samples to round-off.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import scipy.linalg
import scipy.sparse
from scipy.special import ndtri

from .._backend import cholesky_with_jitter, take_rows
from ..bags import segment_sum
from ..engine import (
    BagBlock,
    FitTrace,
    GaussianQ,
    SerialExecutor,
    SparseGP,
    Summable,
    optimise,
)
from ..ising import Neighbourhood
from ..kernels import RBF
from ..threadpools import single_thread_when_small
from ..truncnorm import log_neg_log_ndtr, upper_truncated_quantile
from ..validation import check_mil_data, feature_names
from .base import forget_fit, store_params
from .probit import VGPMILPRI
from .probit_updates import ProbitBags, ProbitMILUpdates

__all__ = ["GibbsChain", "GibbsState", "GibbsUpdates", "VGPMILPRGibbs", "split_rhat"]

_LOG_2PI = float(np.log(2.0 * np.pi))
_WORD = 1 << 32  # sweeps and bag positions each fill 32 bits of the second Philox key word


def _key(seed: int, sweep: int, stream: int) -> np.ndarray:
    """The Philox key of one ``(sweep, stream)`` of a chain: ``(seed, sweep·2³² + stream)``.

    Philox is a keyed bijection of its counter: distinct keys give independent streams that can be
    made in any order on any process (Salmon et al. 2011). Stream 0 is the v-step; bag ``b`` is ``b + 1``.
    """
    return np.array([seed, sweep * _WORD + stream], dtype=np.uint64)


def _stream(seed: int, sweep: int, stream: int) -> np.random.Generator:
    return np.random.Generator(np.random.Philox(key=_key(seed, sweep, stream)))


def _uniforms(seed: int, sweep: int, bag_index: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Uniforms in (0, 1) of one sweep from each bag's own stream: one per instance (block row order) and
    one per bag (which instance of an uncoupled positive bag is its first non-negative one). One generator
    re-keyed per bag: a fresh one would also draw OS entropy it does not use."""
    bits = np.random.Philox(key=_key(seed, sweep, 0))
    generator = np.random.Generator(bits)
    per_instance, per_bag = np.empty(int(np.sum(sizes))), np.empty(sizes.shape[0])
    start = 0
    for i, (b, n) in enumerate(zip(bag_index.tolist(), sizes.tolist())):
        bits.state = {"bit_generator": "Philox", "state": {"counter": np.zeros(4, np.uint64), "key": _key(seed, sweep, b + 1)},
                      "buffer": np.zeros(4, np.uint64), "buffer_pos": 4, "has_uint32": 0, "uinteger": 0}
        draws = generator.random(n + 1)
        per_instance[start : start + n], per_bag[i] = draws[:n], draws[n]
        start += n
    return per_instance + 2.0**-54, per_bag + 2.0**-54


def _uncoupled_bag_draws(mu: np.ndarray, offsets: np.ndarray, positive: np.ndarray, u: np.ndarray, u_bag: np.ndarray) -> np.ndarray:
    """Exact joint draws of ``m_b ~ N(μ_b, I)`` under each bag's MIL constraint (bags without neighbours).

    A negative bag's instances are independent, truncated to ``m < 0``. A positive bag (``m`` not all
    negative) is drawn by its first non-negative instance ``J``: ``P(J = j) ∝ Π_{i<j} Φ(−μ_i) · Φ(μ_j)``,
    whose CDF telescopes to ``(1 − e^{−t_j}) / (1 − e^{−t_n})`` with ``t_j = Σ_{i≤j} −log Φ(−μ_i)``; then the
    instances before ``J`` are truncated to ``m < 0``, ``m_J`` to ``m ≥ 0`` and those after are free. The
    sums are taken bag by bag, scaled by the bag's largest term (``log(−log Φ(−μ))`` in log space), so a
    bag whose instances are all far below zero keeps its relative precision and the draw does not depend
    on the bags beside it. One block draw replaces a bag's single-site updates (seed 003 Eq. 13–14) and
    mixes at least as well.
    """
    sizes = np.diff(offsets)
    positive_row = np.repeat(positive, sizes)
    m = mu + ndtri(u)
    negative_row = ~positive_row
    m[negative_row] = upper_truncated_quantile(mu[negative_row], 1.0, u[negative_row])
    if not positive.any():
        return m
    log_tau = log_neg_log_ndtr(mu)
    top = np.maximum.reduceat(log_tau, offsets[:-1])
    scaled = np.exp(log_tau - np.repeat(top, sizes))  # in (0, 1], the bag's largest term is 1
    partial = np.empty_like(scaled)
    for a, z in zip(offsets[:-1].tolist(), offsets[1:].tolist()):  # bag by bag: no bag's sum depends on another's
        np.cumsum(scaled[a:z], out=partial[a:z])
    total = partial[offsets[1:] - 1]
    t_n = np.exp(top) * total
    with np.errstate(over="ignore", invalid="ignore"):  # the branch not taken may overflow
        threshold = np.where(t_n < 1e-10, u_bag * total, -np.log1p(u_bag * np.expm1(-t_n)) * np.exp(-top))
    first = np.minimum(segment_sum((partial < np.repeat(threshold, sizes)).astype(np.int64), offsets), sizes - 1)
    position = np.arange(mu.shape[0]) - np.repeat(offsets[:-1], sizes)
    before = positive_row & (position < np.repeat(first, sizes))
    at = positive_row & (position == np.repeat(first, sizes))
    m[before] = upper_truncated_quantile(mu[before], 1.0, u[before])
    m[at] = -upper_truncated_quantile(-mu[at], 1.0, u[at])
    return m


@dataclass(frozen=True)
class GibbsState:
    """The chain on the client after ``sweep`` sweeps: the last ``v``, the kept samples (k, M) and the last
    scale move ``g`` (the partitions' ``m`` are ``g`` times what they hold; they apply it next sweep)."""

    v: np.ndarray
    sweep: int
    samples: np.ndarray
    scale: float = 1.0


@dataclass(frozen=True)
class GibbsChain:
    """A partition's part of the chain: the current ``m`` (block row order) and the sum of its kept values."""

    m: np.ndarray
    m_sum: np.ndarray


@dataclass(frozen=True)
class GibbsBags:
    """A prepared partition: the probit model's block (``G'_p``, the coupling ``Σ_b``), the bags' stream keys,
    the bags without neighbours (``alone``: their rows and CSR offsets; drawn a bag at a time) and, for the
    others, per within-bag position ``k`` the rows updated together (with their rows of the coupling)."""

    probit: ProbitBags
    bag_index: np.ndarray
    steps: tuple[tuple[np.ndarray, np.ndarray, Any], ...]
    alone: np.ndarray
    alone_rows: np.ndarray
    alone_offsets: np.ndarray


@dataclass(frozen=True)
class GibbsStats(Summable):
    """A partition's contribution to a sweep: ``G'_p`` (constant), ``r'_p = A'_pᵀm_p``, ``log p(m_p | v)`` and
    ``m_pᵀP_pm_p`` (for the scale move)."""

    precision: np.ndarray
    shift: np.ndarray
    log_density: float
    quadratic: float
    n_instances: int


@dataclass(frozen=True)
class GibbsUpdates:
    """The sampler as :class:`~mil_core.engine.PartitionUpdates`: the m-step is the partition step, the
    v-step the global update. ``seed`` keys every draw (module docstring); sweeps after ``burn_in``,
    every ``thin``-th, are kept."""

    probit: ProbitMILUpdates
    seed: int
    burn_in: int
    thin: int

    def prepare(self, block: BagBlock) -> GibbsBags:
        bags = self.probit.prepare(block)
        n_bags = bags.offsets.shape[0] - 1
        bag_index = np.arange(n_bags) if block.bag_index is None else np.asarray(block.bag_index, dtype=np.int64)
        if bag_index.shape != (n_bags,) or (n_bags and not 0 <= bag_index.min() <= bag_index.max() < _WORD - 1):
            raise ValueError(f"bag_index must hold one position in [0, 2^32 - 1) per bag ({n_bags}), got shape {bag_index.shape}")
        P = bags.coupling.precision
        coupled = bags.coupling.edge_count > 0
        off_diagonal = (scipy.sparse.diags(P.diagonal()) - P).tocsr()
        sizes = np.diff(bags.offsets)
        steps = []
        for k in range(int(sizes[coupled].max(initial=0))):
            has = np.flatnonzero(coupled & (sizes > k))
            rows = bags.offsets[:-1][has] + k
            steps.append((rows, has, off_diagonal[rows]))
        alone = np.flatnonzero(~coupled)
        alone_rows = np.repeat(bags.offsets[:-1][alone] - np.concatenate([[0], np.cumsum(sizes[alone])[:-1]]), sizes[alone]) \
            + np.arange(int(sizes[alone].sum()))
        return GibbsBags(probit=bags, bag_index=bag_index, steps=tuple(steps), alone=alone, alone_rows=alone_rows,
                         alone_offsets=np.concatenate([[0], np.cumsum(sizes[alone])]).astype(np.int64))

    def init_local(self, block: GibbsBags) -> GibbsChain:
        """A valid start: every instance below zero but the first of each positive bag."""
        offsets = block.probit.offsets
        m = np.full(int(offsets[-1]), -0.5)
        m[offsets[:-1][block.probit.labels == 1]] = 0.5
        return GibbsChain(m=m, m_sum=np.zeros_like(m))

    def init_global(self) -> GibbsState:
        M = self.probit.gp.n_inducing
        return GibbsState(v=np.zeros(M), sweep=0, samples=np.zeros((0, M)))

    def kept(self, sweep: int) -> bool:
        return sweep > self.burn_in and (sweep - self.burn_in - 1) % self.thin == 0

    def partition_step(self, block: GibbsBags, chain: GibbsChain, state: GibbsState) -> tuple[GibbsStats, GibbsChain]:
        """The m-step of sweep ``state.sweep + 1`` on one partition (module docstring)."""
        bags, sweep = block.probit, state.sweep + 1
        offsets, coupling = bags.offsets, bags.coupling
        mu = coupling.solve(bags.features.latent_mean(state.v))
        pdiag = coupling.precision.diagonal()
        cond_sd = 1.0 / np.sqrt(pdiag)
        u, u_bag = _uniforms(self.seed, sweep, block.bag_index, np.diff(offsets))
        m = chain.m * state.scale  # the previous sweep's scale move
        m_sum = chain.m_sum + m if self.kept(state.sweep) else chain.m_sum
        positive_bag = bags.labels == 1
        rows = block.alone_rows
        m[rows] = _uncoupled_bag_draws(mu[rows], block.alone_offsets, positive_bag[block.alone], u[rows], u_bag[block.alone])
        n_nonneg = segment_sum((m >= 0).astype(np.int64), offsets)
        for rows, bag, coupling_rows in block.steps:  # bags with neighbours: single-site, in order within a bag
            mean = mu[rows] + (coupling_rows @ (m - mu)) / pdiag[rows]
            sd = cond_sd[rows]
            was_nonneg = m[rows] >= 0
            pos = positive_bag[bag]
            others_nonneg = n_nonneg[bag] - was_nonneg
            must_be_positive = pos & (others_nonneg == 0)  # m ≥ 0; else, in a positive bag, unconstrained
            ur = u[rows]
            new = mean + sd * ndtri(ur)  # free: the Gaussian conditional
            below = ~pos  # negative bags: m < 0
            new[below] = upper_truncated_quantile(mean[below], sd[below], ur[below])
            new[must_be_positive] = -upper_truncated_quantile(-mean[must_be_positive], sd[must_be_positive], ur[must_be_positive])
            n_nonneg[bag] += (new >= 0).astype(np.int64) - was_nonneg
            m[rows] = new
        residual = m - mu
        log_density = -0.5 * float(residual @ (coupling.precision @ residual)) + 0.5 * float(np.sum(bags.logdet_precision)) \
            - 0.5 * m.shape[0] * _LOG_2PI
        stats = GibbsStats(precision=bags.gram, shift=bags.features.project(m), log_density=log_density,
                           quadratic=float(m @ (coupling.precision @ m)), n_instances=int(m.shape[0]))
        return stats, GibbsChain(m=m, m_sum=m_sum)

    def global_update(self, stats: GibbsStats, state: GibbsState) -> tuple[GibbsState, float]:
        """The scale move and the v-step of sweep ``state.sweep + 1`` (module docstring); the objective is
        ``log p(v, m)`` of the state the m-step saw (the previous ``v``, the new ``m``): a trace of the chain,
        not a bound."""
        sweep, M = state.sweep + 1, state.v.shape[0]
        chol, _ = cholesky_with_jitter(np.eye(M) + 0.5 * (stats.precision + stats.precision.T), initial_relative_jitter=0.0)
        mean = scipy.linalg.cho_solve((chol, True), stats.shift, check_finite=False)
        rng = _stream(self.seed, sweep, 0)
        quadratic = stats.quadratic - float(stats.shift @ mean)  # mᵀ(P − A'(I + G')⁻¹A'ᵀ)m: m's marginal precision
        scale = float(np.sqrt(rng.gamma(0.5 * stats.n_instances, 2.0 / quadratic))) if quadratic > 0 else 1.0
        v = scale * mean + scipy.linalg.solve_triangular(chol.T, rng.standard_normal(M), lower=False)
        samples = np.vstack([state.samples, v]) if self.kept(sweep) else state.samples
        log_joint = stats.log_density - 0.5 * float(state.v @ state.v) - 0.5 * M * _LOG_2PI
        return GibbsState(v=v, sweep=sweep, samples=samples, scale=scale), log_joint


def split_rhat(samples: np.ndarray) -> float:
    """The largest split-R̂ (Gelman et al., BDA3 §11.4) over the columns of one chain's samples: the
    two halves' between/within variance ratio; ≈ 1 when the halves agree, NaN below 4 samples."""
    n = samples.shape[0] // 2
    if n < 2:
        return float("nan")
    halves = np.stack([samples[:n], samples[-n:]])  # (2, n, M)
    within = halves.var(axis=1, ddof=1).mean(axis=0)
    between = n * halves.mean(axis=1).var(axis=0, ddof=1)
    var_plus = (n - 1) / n * within + between / n
    with np.errstate(divide="ignore", invalid="ignore"):
        rhat = np.sqrt(np.where(within > 0, var_plus / within, 1.0))
    return float(np.max(rhat))


class VGPMILPRGibbs(VGPMILPRI):
    """Gibbs sampler for probit GP-MIL (λ = 0: the model of VGPMIL-PR; λ > 0: VGPMIL-PR-I).

    Same inducing points as the variational estimators with the same ``n_inducing`` and
    ``random_state`` (k-means on the training instances), and the same prediction methods,
    applied to the Gaussian ``q_`` moment-matched to the posterior samples of ``v``. Runs on the
    serial executor (:meth:`fit`) and on the Dask executor (``tasks.training.fit_cohort``) with the
    same draws (module docstring).

    Parameters
    ----------
    lam, neighbourhood, n_inducing, exact_diag_max, diag_tol, exact_orthant_max, n_mc_samples
        As in :class:`~mil_core.models.probit.VGPMILPRI` (``lam=0`` by default here).
    bag_rule : {"auto", "top_fraction", "max", "mean", "noisy_or", "orthant"}, default="auto"
        How bags are scored (``predict_bag_proba``, the kernel choice, the pipeline), as in the
        variational models: ``"orthant"`` is the paper's ``1 − P(m* < 0)`` (Eq. 26), which follows
        the bag size; ``"auto"`` is chosen with the kernel by the variational model
        (:meth:`_select_kernel`). The rule used is ``bag_rule_``.
    kernel : RBF or None
        ``None`` chooses the RBF variance on the training bags with the variational model of the same
        posterior (:meth:`_select_kernel`).
    standardize : bool, default=True
        Fit and predict on features standardised with the training instances' mean and scale,
        ``feature_mean_`` / ``feature_scale_`` (:class:`~mil_core.models.base.FeatureStandardisation`).
    n_samples : int, default=2000
        Kept samples.
    burn_in : int, default=500
        Sweeps discarded first.
    thin : int, default=10
        Keep every ``thin``-th sweep after burn-in. 10 (20,500 sweeps in all) is the measured length at
        which the largest split-R̂ of the kept v samples falls below 1.05 (``converged_``) on the first
        folds of MUSK1 (1.042, 1.027; thin 1: 1.68, 1.49; thin 5: 1.07, 1.10) and digits bags
        (``docs/BENCHMARKS.md``, "Gibbs reference"): the mean latent value (the field's level) has an
        autocorrelation time of tens to hundreds of sweeps. About 4–5× the time of ``thin=1``.
    random_state : int or None
        Seed of k-means and of the sampler's keys.

    Attributes
    ----------
    v_samples_ : ndarray (n_samples, M)
        Posterior samples of the whitened inducing values.
    q_ : GaussianQ
        Their mean and covariance.
    m_mean_ : ndarray (N,)
        Posterior mean of ``m`` for each training instance, in the input row order (:meth:`fit` only;
        the cluster fit keeps each partition's running sum on its worker).
    objective_ : ndarray (n_iter_,)
        ``log p(v, m)`` after each sweep's m-step (a trace of the chain).
    rhat_ : float
        The largest split-R̂ of the v samples; ``converged_`` is ``rhat_ < 1.05``.
    kernel_selection_ : ndarray (k, 2)
        With ``kernel=None``: each variance tried and its mean held-out bag AUC.
    gp_, kernel_, n_iter_, n_features_in_, classes_, feature_mean_, feature_scale_
    """

    def __init__(
        self,
        *,
        lam: float = 0.0,
        neighbourhood: Neighbourhood = 4,
        n_inducing: int = 100,
        kernel: RBF | None = None,
        standardize: bool = True,
        n_samples: int = 2000,
        burn_in: int = 500,
        thin: int = 10,
        exact_diag_max: int = 2000,
        diag_tol: float = 1e-6,
        exact_orthant_max: int = 12,
        bag_rule: str = "auto",
        n_mc_samples: int = 500,
        random_state: int | None = None,
    ):
        store_params(self, locals())

    # the shared parameter checks and executors read these: a sampler has no tolerance (``None``: it runs
    # all its sweeps) and no early stopping
    tol, early_stopping, moments = None, False, "diagonal"
    objective_name = "log joint"  # objective_: log p(v, m) of the chain's state, not a bound
    learn_lam, coupling_form = False, "ising"

    @property
    def max_iter(self) -> int:
        """The sweeps the chain runs: ``burn_in + n_samples · thin``."""
        return int(self.burn_in) + int(self.n_samples) * int(self.thin)

    def _check_common_params(self, n_instances: int | None) -> None:
        for name, low in (("n_samples", 1), ("burn_in", 0), ("thin", 1)):
            value = getattr(self, name)
            if not (isinstance(value, (int, np.integer)) and value >= low):
                raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        if self.max_iter >= _WORD:
            raise ValueError(f"burn_in + n_samples * thin must be below 2^32 sweeps, got {self.max_iter}")
        super()._check_common_params(n_instances)

    def _make_updates(self, gp: SparseGP) -> GibbsUpdates:
        seed = np.random.SeedSequence(self.random_state).generate_state(1, np.uint64)[0] if not isinstance(
            self.random_state, np.random.RandomState) else self.random_state.randint(2**63 - 1, dtype=np.int64)
        probit = ProbitMILUpdates(gp=gp, lam=self._lam(), **self._updates_options())
        return GibbsUpdates(probit=probit, seed=int(seed), burn_in=int(self.burn_in), thin=int(self.thin))

    def _select_kernel(self, X_sorted: np.ndarray, offsets: np.ndarray, labels: np.ndarray, coords: np.ndarray | None,
                       memo: MutableMapping[str, Any] | None = None) -> RBF | None:
        """``kernel=None``: the RBF variance that the variational fit of the same model (VGPMIL-PR-I with this
        λ; VGPMIL-PR at λ = 0) chooses by held-out bag AUC over 3 repeats of a 2-fold split of the training
        bags (:meth:`~mil_core.models.base.SparseGPMILBase._select_kernel`); sets ``kernel_selection_``.

        Why the variational surrogate: the choice is of the model (its prior), not of the inference, and
        its 24 short closed-form fits (4 variances × 6 halves) cost a fraction of one chain, where 24
        chains would cost 24 times the fit. Its chosen number of sweeps is not used: the sampler runs its chain.
        """
        surrogate = self._variational_model()
        surrogate.bag_rule_ = self.bag_rule_
        kernel = surrogate._select_kernel(X_sorted, offsets, labels, coords, memo=memo)
        self.kernel_selection_, self.auto_max_iter_, self.bag_rule_ = surrogate.kernel_selection_, None, surrogate.bag_rule_
        return kernel

    def _choice_needs_coords(self) -> bool:
        return self._lam() > 0

    def _variational_model(self) -> VGPMILPRI:
        """VGPMIL-PR-I with this model's prior (the zero prior mean of seed 003), coupling and
        prediction settings (λ = 0 is VGPMIL-PR)."""
        shared = {name: value for name, value in self.get_params().items() if name in VGPMILPRI().get_params()}
        return VGPMILPRI(**shared, prior_mean=0.0)

    @single_thread_when_small
    def fit(self, X: Any, bag_ids: Any, y: Any, coords: Any | None = None) -> VGPMILPRGibbs:
        """Sample the posterior given instances, bag ids, per-instance bag labels (and coords)."""
        names = feature_names(X)
        X, bags, labels = check_mil_data(X, bag_ids, y)
        self._check_common_params(X.shape[0])
        coords_sorted = self._check_coords(coords, bags)
        forget_fit(self, names)
        X_sorted, scaling = self._standardise_training_rows(take_rows(X, bags.order))
        offsets = bags.offsets
        updates = self._start_fit(X_sorted, np.repeat(labels, np.diff(offsets)), offsets=offsets, coords=coords_sorted)
        block = BagBlock(X=X_sorted, offsets=offsets, labels=labels, coords=coords_sorted, bag_index=np.arange(bags.n_bags))
        executor = SerialExecutor(updates, [block])
        trace = optimise(executor.sweep, updates, updates.init_global(), max_iter=self.max_iter, tol=self.tol)
        self._finish_fit(trace)
        self.feature_mean_, self.feature_scale_ = scaling
        chain, state = executor.locals[0], trace.glob
        m_sum = chain.m_sum + state.scale * chain.m if updates.kept(state.sweep) else chain.m_sum  # the last scale move
        self.m_mean_ = np.empty(X.shape[0])
        self.m_mean_[bags.order] = m_sum / self.n_samples
        return self

    def _finish_fit(self, trace: FitTrace, monitor: Any = None) -> None:
        samples = trace.glob.samples
        self.v_samples_ = samples
        self.q_ = GaussianQ(mean=samples.mean(axis=0), cov=np.atleast_2d(np.cov(samples, rowvar=False)) if samples.shape[0] > 1
                            else np.zeros((samples.shape[1],) * 2))
        self.objective_ = np.asarray(trace.objective)
        self.n_iter_ = trace.n_iter
        self.rhat_ = split_rhat(samples)
        self.converged_ = bool(self.rhat_ < 1.05)
