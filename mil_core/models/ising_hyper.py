"""Learning the Ising/CAR strength λ of VGPMIL-PR-I (seed 002, Sec. 2.3–2.4; its Sec. 4 leaves λ
to future work: "it remains a hyperparameter that has to be found empirically using the
validation set").

Two objectives, chosen by ``lam_objective``; both are maximised in ``log λ`` between closed-form
sweeps, as sums over bags (map → sum → small step).

**"field" (default): type-II maximum likelihood of the coupling on the latent field.** The
coupling is a prior that says neighbouring tiles have similar latent values, with precision
``P_b = I + λC_b`` (the paper's ``Σ_b⁻¹``, Eq. 9–12). Its strength is estimated where the data
carry it: from the spatial structure of the instances' posterior latent field
``z_b = E[f_b] = A'_b m'``, taken as a draw from the proper CAR (Gaussian Markov random field)
``z_b ~ N(c_b 1, τ⁻¹ P_b⁻¹)`` with a free level ``c_b`` per bag (restricted likelihood: the
Laplacian's constant modes, one per connected component, are left out) and a common precision
``τ`` profiled out. With ``C_b = U diag(d) Uᵀ`` and ``w = Uᵀ z_b`` over the ``n`` non-constant
modes of all bags:

    ℓ(λ) = ½ Σ_k log(1 + λ d_k) − (n/2) log((S₀ + λ S₁)/n) − (n/2)(1 + log 2π),
    S₀ = Σ_k w_k² (the field's spread about each bag's level),
    S₁ = Σ_k d_k w_k² = Σ_b z_bᵀ C_b z_b (its squared differences across neighbour edges).

The data enter through ``S₀`` and ``S₁`` only; ``dℓ/dλ`` at 0 is positive exactly when the
field's energy sits in the smooth (low-``d``) modes more than a white field's would. This is the
classical maximum-likelihood estimate of a CAR dependence parameter, on the field the GP infers.
``E[f]`` is a function of the features alone (``f`` is a GP in feature space), so the coupling
cannot create the correlation it measures (the posterior ``E[m]`` would: it is smoothed by
``Σ_b``); alternated with the sweeps, the estimate settles instead of running away. It does not
maximise the ELBO: the ELBO may decrease across a λ step.
Measured on lesions of known layout (``docs/BENCHMARKS.md``, "Ising strength λ") it moves the
right way: larger on compact lesions than on scattered ones. Its size is that of the *inferred*
field, which is shrunk towards white noise by the feature noise, so it is conservative (smaller
than the best λ for accuracy on the paper's grid).

**"bound": the ELBO.** With ``q(v)`` fixed and ``q(m_b)`` the optimal truncated Gaussian of
Eq. 15, the ELBO collapsed over ``q(m)`` is, per bag (``μ_b = Σ_b A'_b m'``, Eq. 18):

    J_b(λ) = log Z_b(μ_b, Σ_b) − ½ tr(Σ_b A'_b S' A'_bᵀ) − ½ Σ_i (Σ_b)_ii r_i

with ``r_i`` the FITC residual. It is exactly the data part of the ELBO that
:class:`~mil_core.models.probit_updates.ProbitMILUpdates` tracks; ``KL(q(v) ‖ p(v))`` does not depend on λ.
Writing ``E log p(m_b | f_b)`` out gives ``½ log det P_b`` and the quadratic term
``−½ E[(m − Σf)ᵀP(m − Σf)]``; for the optimal ``q(m_b)`` they combine with its entropy into
``log Z_b`` (the normaliser of ``N(μ_b, Σ_b)`` on the bag's region), which is why no explicit
log-determinant appears. ``log Z_b`` is taken under the paper's diagonal approximation (Eq. 19–20:
``N(μ_b, diag Σ_b)``), the one the fit uses with ``moments="diagonal"``. In spectral form, with
``g_k = 1/(1 + λ d_k)``:

    Σ_b = U diag(g) Uᵀ,  μ_b = U (g ∘ Uᵀa),  diag Σ_b = (U∘U) g,
    tr(Σ_b A' S' A'ᵀ) = Σ_k g_k (B S' Bᵀ)_kk,  B = Uᵀ A'_b,

and ``∂g/∂λ = −d g²`` gives the exact gradient of every term. For the smoother form
(``coupling_form="smoother"``, ``m_b | f_b ~ N(Σ_b f_b, I)``, ``q(m_b)`` exact):

    J_b(λ) = log Z_b(Σ_b A'_b m', I) − ½ tr(Σ_b² A'_b S' A'_bᵀ) − ½ Σ_i (Σ_b²)_ii r_i,

``g`` becoming ``g²`` in the two trace terms and the variance 1. **Measured, the bound does not
make λ track spatial correlation, in either form** (``docs/BENCHMARKS.md``): it runs to ~500
(paper's form) or to ``LAM_MAX`` (smoother form) on compact and scattered lesions alike. In the
paper's form λ also shrinks the noise of ``m`` (``(Σ_b)_ii`` from 1 towards ``1/|b|``), which the
bound rewards on every layout; in both forms averaging ``f`` over neighbours averages its
posterior variance, above all the FITC residual (on the benchmark ``−½ Σ r_i`` is −155 nats at
λ = 0, −1 at λ = 100), and the negative bags, all background and so spatially coherent whatever
the lesion layout, gain ~10 nats, while the positive bags that carry the layout change by ~1 nat.
With bag labels only, the bound's dependence on λ is dominated by layout-independent terms.

Both objectives use the per-bag spectra ``U_b``, ``d_b`` and ``B_b``, computed once per partition;
a bag of ``n`` instances costs ``O(n³)`` once and ``O(n² + nM)`` per evaluation, so bags are
limited to ``exact_diag_max`` instances (dense, like ``diag Σ_b``).

**Cost.** When λ changes, :meth:`IsingLamUpdates.inner_bags` rebuilds the inner model's partition
from the spectra (``diag Σ_b``, ``G'``, ``log det P_b``) and the stored whitened features and
Laplacian: no whitening, dense Cholesky or neighbour search is redone (before, each λ step re-ran
``prepare``: on the benchmark 24 dense Choleskys + triangular inverses per step, 97 % of a learnt
fit's time; a 10-sweep fit went from 19 s to 0.5 s at the same learnt λ).

**Map → sum → small step.** A partition returns the sums over its bags — :class:`FieldStats`
(``S₀``, ``S₁``, the log-determinant and its derivative, the mode count) or :class:`LamStats`
(``J`` and ``dJ/d log λ``); the reduction is ``+`` and ``value_and_grad`` turns the total into the
objective. :class:`IsingLamUpdates` wraps the model's :class:`~mil_core.models.probit_updates.ProbitMILUpdates`;
its global state :class:`LamState` carries ``(q, λ)``; a :class:`LamProbe` state makes the same
partition step return the statistics and leave the local state untouched, so any executor's
``sweep`` evaluates the objective and its gradient. :meth:`IsingLamUpdates.hyper_step` (called by
:func:`~mil_core.engine.optimise` after each global update) runs a few L-BFGS-B evaluations in
``log λ`` — positivity by construction — within ``[LAM_MIN, LAM_MAX]``, and keeps the best point
seen, so **the objective never decreases across a λ step**.

**Fallback.** :func:`select_lam_by_validation`: the paper's protocol made explicit — fit a fixed
grid of λ on a stratified split of the bags and keep the λ with the best validation bag AUC
(instance AUC when instance labels are known).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import scipy.optimize
import scipy.sparse as sp
from scipy.special import log_ndtr
from sklearn.base import clone
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import train_test_split

from .._backend import array_namespace, like, take_rows, to_numpy
from ..bags import BagIndex
from ..engine import BagBlock, GaussianQ, Summable, WhitenedBlock
from ..ising import CARCoupling, laplacian, neighbour_edges
from ..truncnorm import log_inverse_mills, positive_bag_log_normaliser
from ..validation import check_features
from .hyper import check_hyper_schedule
from .probit_updates import ProbitBags, ProbitLocal, ProbitMILUpdates, fresh_local

__all__ = [
    "LAM_MIN",
    "LAM_MAX",
    "LamObjective",
    "LamState",
    "LamProbe",
    "LamStats",
    "FieldStats",
    "SpectralBags",
    "IsingLamUpdates",
    "ising_lam_updates",
    "unwrap_lam_state",
    "LamSelection",
    "select_lam_by_validation",
]


def _stack(blocks: list[Any], reference: Any) -> Any:
    """Row blocks concatenated in ``reference``'s namespace (an empty (0, M) array when none)."""
    xp = array_namespace(reference)
    return xp.concat(blocks, axis=0) if blocks else reference[0:0, ...]


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0)


LAM_MIN, LAM_MAX = 1e-3, 1e3
LamObjective = Literal["field", "bound"]


@dataclass(frozen=True)
class LamState:
    """Global state with a learnt λ: whitened ``q(v)`` and λ; ``history`` holds ``(J before,
    J after, λ after)`` of every λ step."""

    q: GaussianQ
    lam: float
    history: tuple[tuple[float, float, float], ...] = ()


@dataclass(frozen=True)
class LamProbe:
    """Asks every partition for ``J(λ)`` and ``dJ/d log λ`` with ``q`` fixed."""

    q: GaussianQ
    lam: float


@dataclass(frozen=True)
class LamStats(Summable):
    """A partition's ``J`` terms (the bound) and their derivative in ``log λ``."""

    value: float
    grad: float
    n_instances: int

    def value_and_grad(self, lam: float) -> tuple[float, float]:
        return self.value, self.grad


@dataclass(frozen=True)
class FieldStats(Summable):
    """A partition's sums for the CAR likelihood of the latent field at one λ (module docstring):
    ``Σ log(1 + λd_k)``, ``Σ d_k/(1 + λd_k)``, ``S₀``, ``S₁`` and the number of modes."""

    logdet: float
    dlogdet: float
    spread: float
    roughness: float
    n_modes: int

    @classmethod
    def from_spectrum(cls, coefficients: np.ndarray, eigvals: np.ndarray, lam: float) -> FieldStats:
        """One bag: its field's coefficients ``w = Uᵀz`` on the Laplacian's eigenvectors and the
        eigenvalues ``d``; the constant modes (``d = 0``, one per connected component) are left out."""
        varying = eigvals > 1e-9 * max(1.0, float(eigvals.max(initial=0.0)))
        d, w2 = eigvals[varying], coefficients[varying] ** 2
        return cls(
            logdet=float(np.sum(np.log1p(lam * d))),
            dlogdet=float(np.sum(d / (1.0 + lam * d))),
            spread=float(np.sum(w2)),
            roughness=float(d @ w2),
            n_modes=int(d.size),
        )

    def value_and_grad(self, lam: float) -> tuple[float, float]:
        """Profile log-likelihood ``ℓ(λ)`` and ``dℓ/d log λ``; ``(−∞, 0)`` for a constant field,
        which carries no information on λ."""
        total = self.spread + lam * self.roughness
        n = self.n_modes
        if not (n and total > 0):
            return -np.inf, 0.0
        value = 0.5 * self.logdet - 0.5 * n * np.log(total / n) - 0.5 * n * (1.0 + np.log(2.0 * np.pi))
        return float(value), float(lam * (0.5 * self.dlogdet - 0.5 * n * self.roughness / total))


@dataclass(frozen=True)
class SpectralBags:
    """A prepared partition: the raw block, its whitened features, its Laplacian ``C`` and, per
    bag, the Laplacian's eigenvectors ``U`` and eigenvalues ``d``; ``projected`` stacks every bag's
    projected features ``B_b = U_bᵀ A'_b`` (N, M) as a :class:`WhitenedBlock` where ``A'`` lives,
    so the M × M and N-vector products with it are single GEMMs there."""

    block: BagBlock
    features: WhitenedBlock
    laplacian: sp.csr_matrix
    offsets: np.ndarray
    labels: np.ndarray
    resid: np.ndarray
    eigvecs: tuple[np.ndarray, ...]
    eigvals: tuple[np.ndarray, ...]
    projected: WhitenedBlock


@dataclass
class LamLocal:
    """A partition's local state: the inner model's warm start and its prepared block at the λ
    it was built for (rebuilt when λ changes, or when None: it is a cache, not saved in checkpoints)."""

    warm: np.ndarray
    bags: ProbitBags | None = field(default=None, metadata={"transient": True})


@dataclass(frozen=True)
class IsingLamUpdates:
    """VGPMIL-PR-I updates (``inner``) with λ learnt between closed-form sweeps (module docstring).

    ``objective``: ``"field"`` or ``"bound"``; ``hyper_steps``: objective evaluations (one sweep
    each) per λ step, after every ``hyper_every``-th global update.
    """

    inner: ProbitMILUpdates
    objective: LamObjective = "field"
    hyper_every: int = 1
    hyper_steps: int = 5

    # ---- PartitionUpdates protocol ------------------------------------------------------
    def prepare(self, block: BagBlock) -> SpectralBags:
        if block.coords is None:
            raise ValueError("learning lam needs instance coords (fit(X, bag_ids, y, coords=...))")
        offsets = np.asarray(block.offsets)
        sizes = np.diff(offsets)
        if sizes.size and sizes.max() > self.inner.exact_diag_max:
            raise ValueError(
                f"learn_lam uses a dense eigendecomposition per bag; a bag has {sizes.max()} instances "
                f"> exact_diag_max={self.inner.exact_diag_max} (raise exact_diag_max, or select lam with "
                "mil_core.models.ising_hyper.select_lam_by_validation)"
            )
        features = self.inner.gp.whiten(block.X)
        C = laplacian(neighbour_edges(np.asarray(block.coords, dtype=np.int64), offsets, self.inner.neighbourhood), int(offsets[-1]))
        eigvecs, eigvals, projected = [], [], []
        for a, z in zip(offsets[:-1], offsets[1:]):
            d, U = np.linalg.eigh(C[a:z, a:z].toarray())
            eigvals.append(np.clip(d, 0.0, None))  # a Laplacian is PSD; clip round-off below 0
            eigvecs.append(U)
            projected.append(like(U, features.A).T @ features.A[a:z, ...])
        return SpectralBags(
            block=block,
            features=features,
            laplacian=C,
            offsets=offsets,
            labels=np.asarray(block.labels),
            resid=np.asarray(to_numpy(features.resid), dtype=np.float64),  # an N-vector
            eigvecs=tuple(eigvecs),
            eigvals=tuple(eigvals),
            projected=WhitenedBlock(A=_stack(projected, features.A), resid=0.0),
        )

    def init_local(self, block: SpectralBags) -> LamLocal:
        return LamLocal(warm=fresh_local(int(block.offsets[-1])).warm)

    def init_global(self) -> LamState:
        return LamState(q=self.inner.init_global(), lam=float(self.inner.lam))

    def partition_step(self, block: SpectralBags, local: LamLocal, glob: LamState | LamProbe) -> tuple[Any, LamLocal]:
        if isinstance(glob, LamProbe):
            terms = self.field_terms if self.objective == "field" else self.lam_terms
            return terms(block, glob.q, glob.lam), local
        bags = local.bags
        if bags is None or bags.coupling.lam != glob.lam:
            bags = self.inner_bags(block, glob.lam)
        stats, inner = replace(self.inner, lam=glob.lam).partition_step(bags, ProbitLocal(warm=local.warm), glob.q)
        return stats, LamLocal(warm=inner.warm, bags=bags)

    def inner_bags(self, block: SpectralBags, lam: float) -> ProbitBags:
        """The inner model's prepared partition at ``λ`` from the spectra (module docstring): no
        whitening, Cholesky or eigendecomposition is redone when λ changes."""
        smoother = self.inner.coupling_form == "smoother"
        noise_var, fitc_weight, logdet, weights = [], [], [], []
        for U, d in zip(block.eigvecs, block.eigvals):
            g = 1.0 / (1.0 + lam * d)
            weight = g * g if smoother else g  # Σ² or Σ in G' and in the FITC term
            weights.append(weight)
            fitc_weight.append((U * U) @ weight)
            noise_var.append(np.ones_like(g) if smoother else fitc_weight[-1])
            logdet.append(0.0 if smoother else float(np.sum(np.log1p(lam * d))))
        gram = block.projected.weighted_gram(_concat(weights))  # Σ_b B_bᵀ diag(weight_b) B_b
        coupling = CARCoupling.from_laplacian(block.laplacian, block.offsets, lam, block.block.coords)
        return replace(self.inner, lam=lam).assemble(
            block.features, block.block, coupling, _concat(noise_var), np.asarray(logdet), gram, _concat(fitc_weight)
        )

    def global_update(self, stats: Any, glob: LamState) -> tuple[LamState, float]:
        q, objective = self.inner.global_update(stats, glob.q)
        return replace(glob, q=q), objective

    # ---- the objectives ------------------------------------------------------------------
    def field_terms(self, block: SpectralBags, q: GaussianQ, lam: float) -> FieldStats:
        """One partition's :class:`FieldStats` of the latent field ``E[f] = A'm'`` (module docstring)."""
        coefficients = np.split(block.projected.latent_mean(q.mean), block.offsets[1:-1])
        stats = [FieldStats.from_spectrum(w, d, lam) for d, w in zip(block.eigvals, coefficients)]
        return sum(stats[1:], stats[0]) if stats else FieldStats(0.0, 0.0, 0.0, 0.0, 0)

    def lam_terms(self, block: SpectralBags, q: GaussianQ, lam: float) -> LamStats:
        """One partition's ``Σ_b J_b(λ)`` and ``λ Σ_b dJ_b/dλ`` (module docstring)."""
        smoother = self.inner.coupling_form == "smoother"
        value = grad = 0.0
        coefficients, spreads = block.projected.latent_moments(q)  # B m', diag(B S' Bᵀ) for every bag
        for b, (a, z) in enumerate(zip(block.offsets[:-1], block.offsets[1:])):
            U, d = block.eigvecs[b], block.eigvals[b]
            g = 1.0 / (1.0 + lam * d)
            dg = -d * g * g
            coef = coefficients[a:z]
            mu, dmu = U @ (g * coef), U @ (dg * coef)
            U2 = U * U
            if smoother:  # noise variance 1; Σ² weighs Var f
                var, dvar = np.ones(z - a), np.zeros(z - a)
                weight, dweight = g * g, 2.0 * g * dg
            else:
                var, dvar = U2 @ g, U2 @ dg
                weight, dweight = g, dg
            sd = np.sqrt(var)
            alpha = mu / sd
            dalpha = (dmu - 0.5 * alpha * dvar / sd) / sd
            mills = np.exp(log_inverse_mills(alpha))  # −d log Φ(−α)/dα
            if block.labels[b] == 1:
                log_p0, log_z = positive_bag_log_normaliser(alpha, np.array([0, z - a]))
                log_z, dlog_z = float(log_z[0]), float(np.exp(log_p0[0] - log_z[0]) * (mills @ dalpha))
            else:
                log_z, dlog_z = float(np.sum(log_ndtr(-alpha))), -float(mills @ dalpha)
            spread = spreads[a:z]  # (B S' Bᵀ)_kk
            resid_weight = U2.T @ block.resid[a:z]  # Σ_i r_i U_ik²
            value += log_z - 0.5 * float(weight @ (spread + resid_weight))
            grad += lam * (dlog_z - 0.5 * float(dweight @ (spread + resid_weight)))
        return LamStats(value=value, grad=grad, n_instances=int(block.offsets[-1]))

    def evaluate(self, sweep: Callable[[Any], LamStats | FieldStats], q: GaussianQ, log_lam: float) -> tuple[float, float]:
        """The objective and its derivative in ``log λ`` at ``λ = exp(log_lam)``, ``q`` and the data fixed."""
        lam = float(np.exp(log_lam))
        return sweep(LamProbe(q=q, lam=lam)).value_and_grad(lam)

    def hyper_step(self, sweep: Callable[[Any], Any], iteration: int, state: LamState) -> LamState:
        """A few L-BFGS-B evaluations on the negated objective in ``log λ``; the best point seen is
        kept (the starting point is evaluated first, so the objective never decreases)."""
        if iteration % self.hyper_every or self.hyper_steps < 1:
            return state
        seen: list[tuple[float, float]] = []  # (J, log λ)
        scale: list[float] = []

        def negative(x: np.ndarray) -> tuple[float, np.ndarray]:
            if len(seen) >= self.hyper_steps + 1:  # budget spent: a flat answer ends the line search
                return np.inf, np.zeros(1)
            value, grad = self.evaluate(sweep, state.q, float(x[0]))
            if not (np.isfinite(value) and np.isfinite(grad)):
                value, grad = -np.inf, 0.0
            seen.append((value, float(x[0])))
            if not scale:
                scale.append(max(abs(value), 1.0) if np.isfinite(value) else 1.0)
            return (-value / scale[0] if np.isfinite(value) else np.inf), np.array([-grad / scale[0]])

        start = float(np.clip(np.log(state.lam), np.log(LAM_MIN), np.log(LAM_MAX)))
        scipy.optimize.minimize(
            negative, np.array([start]), jac=True, method="L-BFGS-B", bounds=[(np.log(LAM_MIN), np.log(LAM_MAX))],
            options={"maxfun": self.hyper_steps + 1, "maxiter": self.hyper_steps},
        )
        best_value, best_log_lam = max(seen, key=lambda item: item[0])
        lam = float(np.exp(best_log_lam)) if best_log_lam != start else state.lam
        return replace(state, lam=lam, history=state.history + ((seen[0][0], best_value, lam),))


# --------------------------------------------------------------------- estimator plumbing
def ising_lam_updates(estimator: Any, updates: ProbitMILUpdates) -> ProbitMILUpdates | IsingLamUpdates:
    """Wrap VGPMIL-PR-I's updates in :class:`IsingLamUpdates` when ``learn_lam``; otherwise
    return them unchanged."""
    if not getattr(estimator, "learn_lam", False):  # subclasses without the parameter (Gibbs)
        return updates
    every, steps = check_hyper_schedule(estimator)
    if not LAM_MIN <= updates.lam <= LAM_MAX:
        raise ValueError(f"with learn_lam, lam is the starting value and must lie in [{LAM_MIN}, {LAM_MAX}], got {updates.lam!r}")
    objective = estimator.lam_objective
    if objective not in ("field", "bound"):
        raise ValueError(f"lam_objective must be 'field' or 'bound', got {objective!r}")
    if objective == "bound" and updates.moments != "diagonal" and updates.coupling_form == "ising":
        raise ValueError("lam_objective='bound' needs moments='diagonal' (the bound's log Z_b is the paper's Eq. 19-20)")
    return IsingLamUpdates(updates, objective=objective, hyper_every=int(every), hyper_steps=int(steps))


def unwrap_lam_state(estimator: Any) -> None:
    """After a fit: ``q_`` from the final :class:`LamState`, the learnt ``lam_`` and
    ``lam_history_`` ((J before, J after, λ) per step); ``lam_ = lam`` when λ is fixed."""
    state = estimator.q_
    if isinstance(state, LamState):
        estimator.q_, estimator.lam_ = state.q, state.lam
        estimator.lam_history_ = np.asarray(state.history).reshape(-1, 3)
    else:
        estimator.lam_ = float(estimator.lam)


# ------------------------------------------------------------------ validation fallback
@dataclass(frozen=True)
class LamSelection:
    """Result of :func:`select_lam_by_validation`: the selected λ, the validation score of every
    grid value, the metric used, and the estimator refitted on all bags with the selected λ."""

    lam: float
    grid: tuple[float, ...]
    scores: tuple[float, ...]
    metric: str
    estimator: Any


def select_lam_by_validation(
    estimator: Any,
    X: Any,
    bag_ids: Any,
    y: Any,
    coords: Any,
    *,
    grid: Sequence[float] = (0.0, 0.5, 1.0, 2.0),
    instance_labels: Any | None = None,
    validation_fraction: float = 0.25,
    random_state: int | None = 0,
) -> LamSelection:
    """Choose λ from ``grid`` by validation AUC on a stratified hold-out of whole bags, then refit
    on all bags (the documented fallback to learning λ by the bound).

    The metric is the instance AUC when ``instance_labels`` (per row of ``X``) are given, the bag
    AUC otherwise; ties go to the smaller λ. ``estimator`` is a VGPMIL-PR-I (cloned, with
    ``learn_lam=False``).
    """
    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction}")
    grid = tuple(float(v) for v in grid)
    if not grid or any(not (np.isfinite(v) and v >= 0) for v in grid):
        raise ValueError(f"grid must be a non-empty sequence of finite lam >= 0, got {grid!r}")
    X, bag_ids, y, coords = check_features(X), np.asarray(bag_ids), np.asarray(y), np.asarray(coords)  # X may be on a device
    bags = BagIndex.from_ids(bag_ids)
    bag_of_row = np.empty(bag_ids.shape[0], dtype=np.int64)
    bag_of_row[bags.order] = bags.instance_bag()
    bag_labels = np.zeros(bags.keys.shape[0], dtype=np.int64)
    bag_labels[bag_of_row] = y
    train_bags, val_bags = train_test_split(
        np.arange(bag_labels.shape[0]), test_size=validation_fraction, stratify=bag_labels, random_state=random_state
    )
    train, val = np.isin(bag_of_row, train_bags), np.isin(bag_of_row, val_bags)
    X_train, X_val = take_rows(X, np.flatnonzero(train)), take_rows(X, np.flatnonzero(val))
    metric = "bag_auc" if instance_labels is None else "instance_auc"
    scores = []
    for lam in grid:
        model = clone(estimator).set_params(lam=lam, learn_lam=False)
        model.fit(X_train, bag_ids[train], y[train], coords=coords[train])
        if instance_labels is None:
            keys, proba = model.predict_bag_proba(X_val, bag_ids[val], coords=coords[val])
            truth = bag_labels[np.searchsorted(bags.keys, keys)]
        else:
            proba, truth = model.predict_instance_proba(X_val), np.asarray(instance_labels)[val]
        scores.append(float(roc_auc_score(truth, proba)))
    best = int(np.argmax(scores))
    final = clone(estimator).set_params(lam=grid[best], learn_lam=False).fit(X, bag_ids, y, coords=coords)
    return LamSelection(lam=grid[best], grid=grid, scores=tuple(scores), metric=metric, estimator=final)
