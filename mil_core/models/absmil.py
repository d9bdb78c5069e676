"""AbSMIL: attribute-based symmetric MIL with a cardinality constraint (seed 004, Sec. III–IV).

Every instance has an attribute ``z ∈ {0, 1, …, C}``: 0 is irrelevant, ``C⁺ = {1, …, C/2}`` are
positive and ``C⁻ = {C/2 + 1, …, C}`` negative attributes. A bag is positive when it holds
positive but no negative attributes, negative in the mirror case, and (``T_b = 1``) it holds
between 1 and ``n_max`` relevant instances. Instances follow a multinomial logistic model
``P(z = c | x) = softmax(Wᵀx)_c`` (Eq. 1). The objective (Eq. 3) is

    L(W) = (1/B) Σ_b (−log P(Y_b, T_b = 1 | X_b, W) + λ_e H_b(W)) + λ_q ‖W‖²/2,

with H_b the summed instance entropies (Eq. 2). Its gradient is Eq. 8 (Fisher's identity: the
E-step posteriors ``P^post`` make the gradient of the EM surrogate equal that of L).

E-step (Eq. 9–15). Given ``Y_b``, the states of the signed count ``N_bi`` of the wrong sign have
backward message β ≡ 0, so only the count of relevant instances of the bag's own side,
``0 … n_max``, carries mass: the chain is run on that count with the two symbols
``P⁰`` (irrelevant) and ``P^side = Σ_{c∈side} P_c`` (relevant of the bag's side), in log space
(``logaddexp``) so that bags of thousands of instances do not underflow. Cost O(n_b·n_max) per
bag. Without a constraint (``n_max=None``) the posteriors are closed form:
``P(Y, T) = Π(P⁰ + P^side) − Π P⁰``.

M-step. ``solver="batch"``: full-batch projected gradient descent; each partition of whole bags
returns the sum over its bags of the gradient and objective pieces (:class:`AttributeStats`), the
client takes a step, so it runs under any executor of :mod:`mil_core.engine`. ``solver="pegasos"``:
Algorithm 1, stochastic steps on ``batch_size`` random bags with ``η_k = 1/(kλ_q)`` and the
projection on the ball of radius ``τ`` (Eq. 8 and below), single process.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
from array_api_compat import device
from scipy.special import expit, log_softmax
from sklearn.base import BaseEstimator
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted

from .._backend import array_namespace, like, take_rows, to_numpy
from ..bags import segment_logsumexp, segment_sum, split_into_blocks
from ..engine import BagBlock, FitTrace, SerialExecutor, Summable, optimise
from ..random_features import RandomFourierFeatures
from ..truncnorm import log1mexp
from ..validation import check_features, check_mil_data, feature_names
from .base import FeatureStandardisation, fitted_names, forget_fit, store_params, take_bags

__all__ = [
    "AbSMIL",
    "AbSMILUpdates",
    "AbSMILState",
    "AttributeBags",
    "AttributeStats",
    "relevance_caps",
    "count_chain",
]

CapSpec = int | float | None

_MEMORY_BUDGET = 1 << 22  # float64 elements of forward messages held at once (32 MiB)


# ------------------------------------------------------------------------- the E-step chain
def _logsumexp(a: np.ndarray, axis: int) -> np.ndarray:
    """log Σ exp along ``axis``; a slice of only −inf (an impossible event) gives −inf. The chain
    calls it per position on small arrays, where ``scipy.special.logsumexp`` (the other modules')
    took 5–7× as long (200 × 30 and 8 × 6 arrays, session 45)."""
    top = np.max(a, axis=axis, keepdims=True)
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.sum(np.exp(a - top), axis=axis)) + np.squeeze(top, axis=axis)


def _log1mexp(x: np.ndarray) -> np.ndarray:
    """``log(1 − eˣ)`` for x ≤ 0 (−inf at x = 0): :func:`mil_core.truncnorm.log1mexp` of ``log(−x)``."""
    with np.errstate(divide="ignore"):
        return log1mexp(np.log(-np.minimum(x, 0.0)))


def relevance_caps(sizes: np.ndarray, n_max: CapSpec) -> np.ndarray | None:
    """Per-bag cap on the number of relevant instances: ``min(n_max, n_b)`` for an integer,
    ``ceil(n_max · n_b)`` (at least 1) for a fraction in (0, 1], ``None`` for no constraint."""
    if n_max is None:
        return None
    sizes = np.asarray(sizes, dtype=np.int64)
    if isinstance(n_max, (int, np.integer)):
        return np.minimum(int(n_max), sizes)
    return np.clip(np.ceil(float(n_max) * sizes - 1e-9).astype(np.int64), 1, sizes)


def count_chain(
    log_irrelevant: np.ndarray,
    log_relevant: np.ndarray,
    offsets: np.ndarray,
    caps: np.ndarray | None,
    *,
    posteriors: bool = True,
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Forward–backward over the count of relevant instances (Eq. 10–15), in log space.

    Parameters: per instance ``log P⁰`` and ``log P^side`` (N,), CSR ``offsets``, per-bag
    ``caps`` (1 ≤ cap ≤ n_b) or ``None`` for the unconstrained closed form.

    Returns ``log P(Y, T = 1 | X_b)`` per bag (the chain ends with 1 … cap relevant instances
    of the side, none of the other side) and, when ``posteriors``, per instance
    ``log P(z = 0 | Y, T, X_b)`` and ``log P(z ∈ side | Y, T, X_b)``.
    """
    if caps is None:
        return _unconstrained_chain(log_irrelevant, log_relevant, offsets, posteriors)
    sizes = np.diff(offsets)
    n_bags = sizes.shape[0]
    log_lik = np.empty(n_bags)
    post_irrelevant = np.empty(log_irrelevant.shape[0]) if posteriors else None
    post_relevant = np.empty(log_irrelevant.shape[0]) if posteriors else None
    for group in _groups_by_size(sizes, caps, posteriors):
        length = int(sizes[group].max())
        positions = np.arange(length)
        valid = positions[None, :] < sizes[group][:, None]  # (G, L)
        rows = np.where(valid, offsets[group][:, None] + positions[None, :], 0)
        # Padding after a bag's end is an "irrelevant with probability 1" instance: identity steps.
        lp0 = np.where(valid, log_irrelevant[rows], 0.0).T
        lpr = np.where(valid, log_relevant[rows], -np.inf).T
        n_states = int(caps[group].max()) + 1
        alpha = _forward(lp0, lpr, n_states, keep=posteriors)
        beta = np.where(
            (np.arange(n_states)[None, :] >= 1) & (np.arange(n_states)[None, :] <= caps[group][:, None]), 0.0, -np.inf
        )  # Eq. 12: the bag ends with 1 … cap relevant instances of its side
        log_lik[group] = _logsumexp(alpha[-1] + beta, axis=1)
        if posteriors:
            joint0, joint_rel = _backward(lp0, lpr, alpha, beta)
            post_irrelevant[rows[valid]] = (joint0.T - log_lik[group][:, None])[valid]
            post_relevant[rows[valid]] = (joint_rel.T - log_lik[group][:, None])[valid]
    return log_lik, post_irrelevant, post_relevant


def _groups_by_size(sizes: np.ndarray, caps: np.ndarray, keep_messages: bool) -> list[np.ndarray]:
    """Bags of similar size together (little padding), each group's messages within budget."""
    order = np.argsort(sizes, kind="stable")
    groups, current, longest, widest = [], [], 0, 0
    for b in order:
        length, width = max(longest, int(sizes[b])), max(widest, int(caps[b]) + 1)
        cells = (length + 1 if keep_messages else 2) * width * (len(current) + 1)
        if current and cells > _MEMORY_BUDGET:
            groups.append(np.array(current))
            current, length, width = [], int(sizes[b]), int(caps[b]) + 1
        current.append(b)
        longest, widest = length, width
    groups.append(np.array(current))
    return groups


def _forward(lp0: np.ndarray, lpr: np.ndarray, n_states: int, keep: bool) -> np.ndarray:
    """``log α_i(k)`` for i = 0 … L (i = 0: before the first instance) — Eq. 10–11 on one side.

    Returns (L + 1, G, K) messages when ``keep``, else only the last one as (1, G, K).
    """
    length, n_groups = lp0.shape
    alpha = np.full((length + 1 if keep else 2, n_groups, n_states), -np.inf)
    alpha[0, :, 0] = 0.0
    for i in range(length):
        prev, cur = (alpha[i], alpha[i + 1]) if keep else (alpha[i % 2], alpha[(i + 1) % 2])
        np.add(prev, lp0[i][:, None], out=cur)
        cur[:, 1:] = np.logaddexp(cur[:, 1:], prev[:, :-1] + lpr[i][:, None])
    return alpha if keep else alpha[length % 2][None]


def _backward(lp0: np.ndarray, lpr: np.ndarray, alpha: np.ndarray, beta: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Backward messages (Eq. 13) and the joints ``log P(z_i = 0 | side, Y, T)·…`` (Eq. 14–15):

    ``joint⁰_i = P⁰_i Σ_k α_{i−1}(k) β_i(k)``, ``joint^side_i = P^side_i Σ_k α_{i−1}(k) β_i(k+1)``.
    """
    length = lp0.shape[0]
    joint0, joint_rel = np.empty(lp0.shape), np.empty(lp0.shape)
    for i in range(length - 1, -1, -1):
        before = alpha[i]
        joint0[i] = lp0[i] + _logsumexp(before + beta, axis=1)
        joint_rel[i] = lpr[i] + _logsumexp(before[:, :-1] + beta[:, 1:], axis=1)
        previous = beta + lp0[i][:, None]
        previous[:, :-1] = np.logaddexp(previous[:, :-1], beta[:, 1:] + lpr[i][:, None])
        beta = previous
    return joint0, joint_rel


def _unconstrained_chain(
    log_irrelevant: np.ndarray, log_relevant: np.ndarray, offsets: np.ndarray, posteriors: bool
) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """No cardinality constraint, in closed form. With ``rⱼ = P^side_j / P⁰_j`` and
    ``u = Σⱼ log(1 + rⱼ)``: ``P(Y, T) = Π(P⁰ + P^side) − Π P⁰ = Π P⁰ · expm1(u)``, and for
    instance i ``P(z_i ∈ side, Y, T) = P^side_i Π_{j≠i}(P⁰ + P^side)``,
    ``P(z_i = 0, Y, T) = P⁰_i Π_{j≠i} P⁰ · expm1(u − log(1 + r_i))``.

    ``log expm1(u)`` is evaluated from ``log u`` (a log-sum-exp of ``log log(1 + rⱼ)``), so a bag
    whose instances are all almost surely irrelevant (u below the smallest double) stays finite.
    """
    sizes = np.diff(offsets)
    log_ratio = log_relevant - log_irrelevant
    log1p_ratio = np.logaddexp(0.0, log_ratio)
    log_log1p_ratio = np.where(log_ratio < -35.0, log_ratio, np.log(np.logaddexp(0.0, np.maximum(log_ratio, -35.0))))
    sum_irrelevant = segment_sum(log_irrelevant, offsets)
    log_u = segment_logsumexp(log_log1p_ratio, offsets)
    log_lik = sum_irrelevant + _log_expm1(log_u)
    if not posteriors:
        return log_lik, None, None
    u = segment_sum(log1p_ratio, offsets)
    others_irrelevant = np.repeat(sum_irrelevant, sizes) - log_irrelevant
    bag_lik = np.repeat(log_lik, sizes)
    post_relevant = log_relevant + others_irrelevant + np.repeat(u, sizes) - log1p_ratio - bag_lik
    log_u_others = np.repeat(log_u, sizes) + _log1mexp(log_log1p_ratio - np.repeat(log_u, sizes))
    post_irrelevant = log_irrelevant + others_irrelevant + _log_expm1(log_u_others) - bag_lik
    return log_lik, post_irrelevant, post_relevant


def _log_expm1(log_u: np.ndarray) -> np.ndarray:
    """``log(eᵘ − 1)`` from ``log u`` (−inf for u = 0): series for small u, ``u + log(1 − e⁻ᵘ)``
    for large u."""
    u = np.exp(np.minimum(log_u, 6.0))
    small = log_u + u / 2.0 + u * u / 24.0
    moderate = np.log(np.expm1(np.clip(u, 4.5e-5, None)))
    large_u = np.exp(np.clip(log_u, 3.0, 700.0))
    large = large_u + _log1mexp(-large_u)
    return np.where(log_u < -10.0, small, np.where(log_u > 3.0, large, moderate))


# ------------------------------------------------------------------------ partition protocol
@dataclass(frozen=True)
class AttributeBags:
    """A prepared block: model features Φ (n, d') in the input's namespace, CSR offsets, bag
    labels (B,) and per-bag relevance caps (or ``None``)."""

    features: Any
    offsets: np.ndarray
    labels: np.ndarray
    caps: np.ndarray | None

    def subset(self, bags: np.ndarray) -> AttributeBags:
        """The selected bags (indices into this block), in the given order."""
        features, offsets = take_bags(self.features, self.offsets, bags)
        return AttributeBags(features, offsets, self.labels[bags], None if self.caps is None else self.caps[bags])


@dataclass(frozen=True)
class AttributeStats(Summable):
    """A partition's sums over its bags: gradient of Σ_b (L_b + λ_e H_b) w.r.t. W (Eq. 8
    without the λ_q term), that objective, the number of bags and instances, and Σ‖φ‖²."""

    gradient: np.ndarray
    objective: float
    n_bags: int
    n_instances: int
    feature_energy: float


@dataclass(frozen=True)
class AbSMILState:
    """Global state of the batch solver: ``weights`` (d', C + 1) where the next sweep
    evaluates, the step size, and the best point evaluated so far (its objective and gradient).

    A step that does not lower the objective is undone and the step halved; an accepted step
    grows it by 1.25 (a backtracking "bold driver" that needs only the sweep's statistics).
    """

    weights: np.ndarray
    step: float = float("nan")
    best_weights: np.ndarray | None = None
    best_objective: float = float("inf")
    best_gradient: np.ndarray | None = None

    @property
    def solution(self) -> np.ndarray:
        return self.weights if self.best_weights is None else self.best_weights


@dataclass(frozen=True)
class AbSMILUpdates:
    """AbSMIL as partition step + reduction + global update (see the module docstring)."""

    n_attributes: int
    n_max: CapSpec
    lambda_q: float
    lambda_e: float
    initial_weights: np.ndarray
    feature_map: RandomFourierFeatures | None = None
    fit_intercept: bool = True

    def features(self, X: Any) -> Any:
        """Φ(X): random Fourier features (Eq. 16) when configured, then a constant column."""
        xp = array_namespace(X)
        phi = X if self.feature_map is None else self.feature_map(X)
        if self.fit_intercept:
            phi = xp.concat([phi, xp.ones((phi.shape[0], 1), dtype=phi.dtype, device=device(phi))], axis=1)
        return phi

    def prepare(self, block: BagBlock) -> AttributeBags:
        offsets = np.asarray(block.offsets, dtype=np.int64)
        return AttributeBags(
            features=self.features(block.X),
            offsets=offsets,
            labels=np.asarray(block.labels, dtype=np.int64),
            caps=relevance_caps(np.diff(offsets), self.n_max),
        )

    def init_local(self, block: AttributeBags) -> None:
        return None

    def init_global(self) -> AbSMILState:
        return AbSMILState(weights=self.initial_weights)

    def log_attribute_proba(self, features: Any, weights: np.ndarray) -> np.ndarray:
        """``log P(z = c | x, W)`` (Eq. 1) as host float64 (n, C + 1)."""
        return log_softmax(to_numpy(features @ like(weights, features, dtype=features.dtype)).astype(np.float64), axis=1)

    def side_log_proba(self, log_p: np.ndarray, positive: np.ndarray | bool) -> np.ndarray:
        """``log P^+`` where ``positive`` else ``log P^−`` (Eq. 9)."""
        half = self.n_attributes // 2
        log_pos = _logsumexp(log_p[:, 1 : half + 1], axis=1)
        log_neg = _logsumexp(log_p[:, half + 1 :], axis=1)
        return np.where(positive, log_pos, log_neg)

    def attribute_posteriors(self, log_p: np.ndarray, block: AttributeBags, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """E-step: ``P^post_ic = P(z_i = c | Y_b, T_b = 1, X_b)`` (Eq. 7) for bags labelled
        ``labels``, and ``log P(Y_b, T_b = 1 | X_b)`` per bag."""
        positive = np.repeat(labels == 1, np.diff(block.offsets))
        log_side = self.side_log_proba(log_p, positive)
        log_lik, post0, post_side = count_chain(log_p[:, 0], log_side, block.offsets, block.caps)
        half = self.n_attributes // 2
        in_side = np.zeros(log_p.shape, dtype=bool)
        in_side[:, 1 : half + 1] = positive[:, None]
        in_side[:, half + 1 :] = ~positive[:, None]
        # Within the side, attribute c takes the share P_c / P^side of the relevant mass.
        post = np.where(in_side, np.exp(np.minimum(post_side[:, None] + log_p - log_side[:, None], 0.0)), 0.0)
        post[:, 0] = np.exp(np.minimum(post0, 0.0))
        return post, log_lik

    def partition_step(self, block: AttributeBags, local: None, state: AbSMILState) -> tuple[AttributeStats, None]:
        """Sums over the block's bags of Eq. 8's data and entropy gradient and of the objective."""
        log_p = self.log_attribute_proba(block.features, state.weights)
        p = np.exp(log_p)
        post, log_lik = self.attribute_posteriors(log_p, block, block.labels)
        entropy = -np.sum(p * log_p, axis=1)
        # ∂H/∂logit_c = P_c Σ_t P_t (log P_t − log P_c)   (Appendix I)
        residual = p - post + self.lambda_e * p * (-entropy[:, None] - log_p)
        xp = array_namespace(block.features)
        stats = AttributeStats(
            gradient=to_numpy(block.features.T @ like(residual, block.features, dtype=block.features.dtype)).astype(np.float64),
            objective=float(-np.sum(log_lik) + self.lambda_e * np.sum(entropy)),
            n_bags=int(log_lik.shape[0]),
            n_instances=int(block.offsets[-1]),
            feature_energy=float(to_numpy(xp.sum(block.features * block.features))),
        )
        return stats, None

    def objective_and_gradient(self, stats: AttributeStats, weights: np.ndarray) -> tuple[float, np.ndarray]:
        """Eq. 3 and its gradient (Eq. 8, averaged over bags) from summed statistics."""
        objective = stats.objective / stats.n_bags + 0.5 * self.lambda_q * float(np.sum(weights * weights))
        return objective, stats.gradient / stats.n_bags + self.lambda_q * weights

    def radius(self, mean_bag_size: float) -> float:
        """``τ = sqrt(2(λ_e + 1) n_b log(C + 1) / λ_q)`` (Appendix I): the minimiser lies in this ball."""
        return float(np.sqrt(2.0 * (self.lambda_e + 1.0) * mean_bag_size * np.log(self.n_attributes + 1) / self.lambda_q))

    def project(self, weights: np.ndarray, mean_bag_size: float) -> np.ndarray:
        """``Π_τ(v) = min(1, τ/‖v‖) v``."""
        norm = float(np.linalg.norm(weights))
        tau = self.radius(mean_bag_size)
        return weights if norm <= tau else weights * (tau / norm)

    def global_update(self, stats: AttributeStats, state: AbSMILState) -> tuple[AbSMILState, float]:
        """One backtracking projected gradient step on Eq. 3; returns the objective at
        ``state.weights`` (the point the statistics were computed at)."""
        objective, gradient = self.objective_and_gradient(stats, state.weights)
        if objective <= state.best_objective:
            if np.isnan(state.step):  # 1 / (λ_q + ½ (1 + λ_e) mean_b Σ‖φ‖²): a curvature bound of L_b
                step = 1.0 / (self.lambda_q + 0.5 * (1.0 + self.lambda_e) * stats.feature_energy / stats.n_bags)
            else:
                step = 1.25 * state.step
            best = (state.weights, objective, gradient)
        else:
            step = 0.5 * state.step
            best = (state.best_weights, state.best_objective, state.best_gradient)
        trial = self.project(best[0] - step * best[2], stats.n_instances / stats.n_bags)
        new_state = AbSMILState(weights=trial, step=step, best_weights=best[0], best_objective=best[1], best_gradient=best[2])
        return new_state, objective

    def pegasos_step(self, stats: AttributeStats, weights: np.ndarray, k: int) -> tuple[np.ndarray, float]:
        """Algorithm 1, line 16: ``W ← Π_τ(W − ∇Q_batch / (kλ_q))``; returns the new weights and
        the batch objective at the old ones."""
        objective, gradient = self.objective_and_gradient(stats, weights)
        return self.project(weights - gradient / (k * self.lambda_q), stats.n_instances / stats.n_bags), objective


# --------------------------------------------------------------------------------- estimator
class AbSMIL(FeatureStandardisation, BaseEstimator):
    """Attribute-based symmetric MIL with a cardinality constraint (seed 004).

    Parameters
    ----------
    n_attributes : int, default=2
        C, even: attributes 1…C/2 are positive, C/2+1…C negative, 0 irrelevant.
    n_max : int, float or None, default=None
        Cardinality constraint on relevant instances per bag: a count, a fraction of each bag's
        size in (0, 1] (the paper's "5 % of n_b"), or ``None`` for no constraint.
    lambda_q, lambda_e : float, default=1e-4, 1e-2
        Quadratic and entropy regularisers of Eq. 3 (λ_q > 0: it also sets the Pegasos step
        and the projection radius).
    solver : {"batch", "pegasos"}, default="batch"
        ``"batch"``: full-batch projected gradient with backtracking, partition statistics
        summed (distributable); ``max_iter`` gradient steps. ``"pegasos"``: Algorithm 1 on
        ``batch_size`` random bags per step (1 in the paper), single process; ``max_iter`` epochs.
    batch_size : int, default=1
        Bags per Pegasos step.
    max_iter, tol
        Iterations (batch) or epochs (Pegasos); relative objective tolerance.
    n_random_features : int or None, default=None
        k > 0: the RBF extension with random Fourier features (Eq. 16), 2k model features.
    rff_scale : float or None
        σ_g of the random frequencies; ``None`` is 1/√D (kernel length scale √D).
    standardize : bool, default=True
        Fit and predict on features standardised with the training instances' mean and scale,
        ``feature_mean_`` / ``feature_scale_`` (:class:`~mil_core.models.base.FeatureStandardisation`).
    fit_intercept : bool, default=True
        Append a constant feature (not in the paper's Eq. 1, which has no bias term).
    init_scale : float, default=0.01
        Initial weights ~ N(0, init_scale²) (random, to break the symmetry between attributes).
    n_init : int, default=1
        Restarts; the one with the lowest final objective is kept (the paper uses 10).
    block_size : int, default=65536
        Instances per partition of whole bags for the batch solver (results do not depend on it).
    random_state : int or None

    Attributes
    ----------
    weights_ : ndarray (d', C + 1)
        W of Eq. 1 (the last row is the intercept when ``fit_intercept``).
    feature_map_ : RandomFourierFeatures or None
    objective_ : ndarray
        Eq. 3 at every evaluated point (batch: including rejected trial steps) or the mean
        batch objective per epoch (Pegasos).
    n_iter_, converged_, n_features_in_, classes_, feature_mean_, feature_scale_
    """

    objective_name: str = "loss"  # objective_: Eq. 3, minimised (the pipeline's log, model.json, the report)

    def __init__(
        self,
        *,
        n_attributes: int = 2,
        n_max: CapSpec = None,
        lambda_q: float = 1e-4,
        lambda_e: float = 1e-2,
        solver: Literal["batch", "pegasos"] = "batch",
        batch_size: int = 1,
        max_iter: int = 300,
        tol: float = 1e-6,
        n_random_features: int | None = None,
        rff_scale: float | None = None,
        standardize: bool = True,
        fit_intercept: bool = True,
        init_scale: float = 0.01,
        n_init: int = 1,
        block_size: int = 65536,
        random_state: int | None = None,
    ):
        store_params(self, locals())

    # ---- fit ---------------------------------------------------------------------------------
    def _check_params(self) -> None:
        C = self.n_attributes
        if not (isinstance(C, (int, np.integer)) and not isinstance(C, bool) and C >= 2 and C % 2 == 0):
            raise ValueError(f"n_attributes must be an even integer >= 2 (half positive, half negative), got {C!r}")
        n_max = self.n_max
        if isinstance(n_max, bool):
            raise ValueError(f"n_max must be an integer >= 1, a fraction in (0, 1] or None, got {n_max!r}")
        if isinstance(n_max, (int, np.integer)):
            if n_max < 1:
                raise ValueError(f"n_max must be >= 1 relevant instance, got {n_max}")
        elif n_max is not None and not (isinstance(n_max, float) and 0.0 < n_max <= 1.0):
            raise ValueError(f"n_max must be an integer >= 1, a fraction in (0, 1] or None, got {n_max!r}")
        if not self.lambda_q > 0:
            raise ValueError(f"lambda_q must be > 0, got {self.lambda_q}")
        if not self.lambda_e >= 0:
            raise ValueError(f"lambda_e must be >= 0, got {self.lambda_e}")
        if self.solver not in ("batch", "pegasos"):
            raise ValueError(f"solver must be 'batch' or 'pegasos', got {self.solver!r}")
        for name in ("batch_size", "max_iter", "n_init"):
            value = getattr(self, name)
            if not (isinstance(value, (int, np.integer)) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.tol < 0:
            raise ValueError(f"tol must be >= 0, got {self.tol}")
        if not self.init_scale > 0:
            raise ValueError(f"init_scale must be > 0, got {self.init_scale}")

    def fit(self, X: Any, bag_ids: Any, y: Any) -> AbSMIL:
        """Fit on instances ``X`` (N, D), their ``bag_ids`` (N,) and ``y`` (N,), the bag label of
        each instance's bag."""
        names = feature_names(X)
        X, bags, labels = check_mil_data(X, bag_ids, y)
        self._check_params()
        forget_fit(self, names)
        (X_sorted, scaling), offsets = self._standardise_training_rows(take_rows(X, bags.order)), bags.offsets
        rng = check_random_state(self.random_state)
        updates = self._initial_updates(X_sorted, rng)
        blocks = [
            BagBlock(X=X_sorted[offsets[a] : offsets[b], ...], offsets=offsets[a : b + 1] - offsets[a], labels=labels[a:b])
            for a, b in split_into_blocks(offsets, self.block_size)
        ]
        best = None
        for _ in range(self.n_init):
            candidate = replace(updates, initial_weights=self.init_scale * rng.standard_normal(updates.initial_weights.shape))
            if self.solver == "batch":
                trace = optimise(SerialExecutor(candidate, blocks).sweep, candidate, candidate.init_global(), max_iter=self.max_iter, tol=self.tol)
                final = trace.glob.best_objective
            else:
                whole = candidate.prepare(BagBlock(X=X_sorted, offsets=offsets, labels=labels))
                trace = self._pegasos(candidate, whole, rng)
                final = trace.objective[-1]
            if best is None or final < best[0]:
                best = (final, trace)
        self._finish_fit(best[1])
        self.feature_mean_, self.feature_scale_ = scaling
        return self

    # ---- executors that train outside fit (tasks.training.fit_cohort) ---------------------------
    def _check_common_params(self, n_instances: int | None) -> None:
        """The checks of a fit outside :meth:`fit`, which runs the batch solver from one start
        (restarts and Pegasos' bag-by-bag steps are serial)."""
        self._check_params()
        if self.solver != "batch" or self.n_init != 1:
            raise ValueError("AbSMIL outside fit() runs the batch solver from one start: use solver='batch' and n_init=1 "
                             f"(got solver={self.solver!r}, n_init={self.n_init})")

    def _start_fit(
        self, X_sample: Any, instance_labels: np.ndarray | None = None, offsets: np.ndarray | None = None, coords: Any = None
    ) -> AbSMILUpdates:
        """Fitted start state and the updates of :meth:`fit`'s first start, drawn from the same
        seeded stream (random features, then initial weights), so a distributed fit equals ``fit``.
        ``offsets``/``coords`` (the GP models' automatic kernel choice) are not used."""
        rng = check_random_state(self.random_state)
        updates = self._initial_updates(X_sample, rng)
        return replace(updates, initial_weights=self.init_scale * rng.standard_normal(updates.initial_weights.shape))

    def _make_updates(self, gp: Any = None) -> AbSMILUpdates:
        """The updates of a resumed fit (the weights come from its checkpointed state)."""
        return self._updates(np.zeros((self._feature_width() + int(self.fit_intercept), int(self.n_attributes) + 1)))

    def _feature_width(self) -> int:
        return self.n_features_in_ if self.feature_map_ is None else self.feature_map_.n_output_features

    def _initial_updates(self, X_train: Any, rng: np.random.RandomState) -> AbSMILUpdates:
        """Set ``n_features_in_``, ``classes_``, ``feature_map_`` and return the updates (initial
        weights zero; :meth:`fit` draws them per restart)."""
        self.n_features_in_ = int(X_train.shape[1])
        self.classes_ = np.array([0, 1])
        self.feature_mean_ = self.feature_scale_ = None  # an executor's rows come as they are used (fit sets its own)
        self.feature_map_ = None
        if self.n_random_features is not None:
            scale = 1.0 / np.sqrt(self.n_features_in_) if self.rff_scale is None else self.rff_scale
            self.feature_map_ = RandomFourierFeatures.sample(self.n_features_in_, self.n_random_features, scale, rng)
        return self._make_updates()

    def _pegasos(self, updates: AbSMILUpdates, whole: AttributeBags, rng: np.random.RandomState) -> FitTrace:
        """Algorithm 1 with ``batch_size`` bags per step; one trace entry per epoch."""
        trace = FitTrace(glob=updates.init_global())
        weights, k = trace.glob.weights, 0
        n_bags = whole.labels.shape[0]
        for epoch in range(1, self.max_iter + 1):
            order = rng.permutation(n_bags)
            objectives = []
            for start in range(0, n_bags, self.batch_size):
                k += 1
                stats, _ = updates.partition_step(whole.subset(order[start : start + self.batch_size]), None, AbSMILState(weights))
                weights, objective = updates.pegasos_step(stats, weights, k)
                objectives.append(objective)
            trace.objective.append(float(np.mean(objectives)))
            trace.n_iter = epoch
            if not np.isfinite(trace.objective[-1]):
                raise FloatingPointError(f"objective became {trace.objective[-1]} in epoch {epoch}")
            if epoch > 1 and abs(trace.objective[-1] - trace.objective[-2]) <= self.tol * max(abs(trace.objective[-2]), 1.0):
                trace.converged = True
                break
        trace.glob = AbSMILState(weights=weights)
        return trace

    def _finish_fit(self, trace: FitTrace, monitor: Any = None) -> None:
        self.weights_ = trace.glob.solution
        self.objective_ = np.asarray(trace.objective)
        self.n_iter_ = trace.n_iter
        self.converged_ = trace.converged

    # ---- prediction --------------------------------------------------------------------------
    def _updates(self, weights: np.ndarray | None = None) -> AbSMILUpdates:
        return AbSMILUpdates(
            n_attributes=int(self.n_attributes),
            n_max=self.n_max,
            lambda_q=float(self.lambda_q),
            lambda_e=float(self.lambda_e),
            initial_weights=self.weights_ if weights is None else weights,
            feature_map=self.feature_map_,
            fit_intercept=bool(self.fit_intercept),
        )

    def _side_chains(self, X: Any, bag_ids: Any, *, posteriors: bool):
        """Validated input, bag index, log P(z | x) (bag order) and, per side m ∈ {0, 1}, the
        chain's ``log P(Y = m, T = 1 | X_b)`` and (optionally) instance posteriors."""
        check_is_fitted(self, "weights_")
        X, bags, _ = check_mil_data(X, bag_ids, n_features=self.n_features_in_, names=fitted_names(self))
        updates = self._updates()
        X_sorted = take_rows(self._standardised_input(X), bags.order)
        log_p = updates.log_attribute_proba(updates.features(X_sorted), self.weights_)
        caps = relevance_caps(bags.sizes, self.n_max)
        chains = {
            m: count_chain(log_p[:, 0], updates.side_log_proba(log_p, bool(m)), bags.offsets, caps, posteriors=posteriors)
            for m in (0, 1)
        }
        return bags, log_p, chains

    def predict_bag_proba(self, X: Any, bag_ids: Any, *, return_std: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """``keys, p``: ``p = P(Y = 1 | X_b, T = 1)``, the forward messages' ``P(Y = m, T = 1)``
        (Sec. IV-D) normalised over m ∈ {0, 1}; ``keys = np.unique(bag_ids)``.

        AbSMIL is a point estimate of W: ``return_std=True`` is an error.
        """
        if return_std:
            raise ValueError("AbSMIL is a point estimate (no posterior over W): there is no predictive std")
        bags, _, chains = self._side_chains(X, bag_ids, posteriors=False)
        return bags.keys, expit(chains[1][0] - chains[0][0])

    def predict_attribute_proba(self, X: Any, bag_ids: Any | None = None) -> np.ndarray:
        """Instance attribute probabilities (N, C + 1), rows in input order.

        Without ``bag_ids``: ``P(z = c | x, W)`` (Eq. 1; Sec. IV-D predicts from it "without
        knowing the bag label"). With ``bag_ids``: the posterior given the whole bag and the
        constraint, ``Σ_m P(Y = m | X_b, T = 1) P(z = c | Y = m, T = 1, X_b)`` (forward–backward
        for both labels).
        """
        if bag_ids is None:
            check_is_fitted(self, "weights_")
            X = self._standardised_input(check_features(X, n_features=self.n_features_in_, names=fitted_names(self)))
            updates = self._updates()
            return np.exp(updates.log_attribute_proba(updates.features(X), self.weights_))
        bags, log_p, chains = self._side_chains(X, bag_ids, posteriors=True)
        half = int(self.n_attributes) // 2
        sizes = bags.sizes
        p_positive = np.repeat(expit(chains[1][0] - chains[0][0]), sizes)
        side_weight = {1: p_positive, 0: 1.0 - p_positive}
        proba = np.zeros(log_p.shape)
        updates = self._updates()
        for m, columns in ((1, slice(1, half + 1)), (0, slice(half + 1, None))):
            _, post0, post_side = chains[m]
            log_side = updates.side_log_proba(log_p, bool(m))
            proba[:, 0] += side_weight[m] * np.exp(post0)
            proba[:, columns] += side_weight[m][:, None] * np.exp(post_side[:, None] + log_p[:, columns] - log_side[:, None])
        out = np.empty_like(proba)
        out[bags.order] = proba
        return out

    def predict_attributes(self, X: Any, bag_ids: Any | None = None) -> np.ndarray:
        """``ẑ = argmax_c`` of :meth:`predict_attribute_proba` (Sec. IV-D)."""
        return np.argmax(self.predict_attribute_proba(X, bag_ids), axis=1)

    def predict_instance_proba(self, X: Any, bag_ids: Any | None = None) -> np.ndarray:
        """Probability that each instance is a relevant instance of the positive class,
        ``Σ_{c ∈ C⁺} P(z = c | ·)`` (with or without bag context, as :meth:`predict_attribute_proba`)."""
        half = int(self.n_attributes) // 2
        return self.predict_attribute_proba(X, bag_ids)[:, 1 : half + 1].sum(axis=1)
