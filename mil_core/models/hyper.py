"""Learning hyper-parameters by maximising the ELBO (seed 000, Sec. 4, Eq. 29; Algorithm 1, step 8).

Between closed-form sweeps, the kernel hyper-parameters λ = (v, ℓ or ARD ℓ_d, optionally the
inducing points Z) and, for G-VGPMIL, the Gamma parameters (α, β) of ψ are moved uphill on

    J(λ) = Σₙ [(πₙ − ½) E fₙ + log ψ(cₙ)] − log Z(λ) + (terms constant in λ)        (Eq. 29)

with ``q(v)`` (whitened) and ``q(y)`` held fixed. ``log ψ(cₙ)`` with ``cₙ² = E fₙ²`` is the
ELBO's ``E log ψ(fₙ)`` after the optimal Gaussian tangent bound (Eq. 28), so by the envelope theorem
``∂J/∂E fₙ = πₙ − ½ − θₙ E fₙ`` and ``∂J/∂Var fₙ = −θₙ/2``. In the whitened parametrisation
``KL(q(v) ‖ N(0, I))`` does not depend on λ: the kernel enters only through ``a'ₙ = L⁻¹k(Z, xₙ)``
and ``k(xₙ, xₙ)``.

**Map → sum → small step.** Every term is a sum over instances, so a partition returns a
:class:`HyperStats` (value, the gradient through ``K(X, Z)`` and ``k(x, x)``, and the M×M matrix
``Σ Āₙᵀa'ₙ`` through which the ``Kzz`` part of the gradient is finished on the client);
the reduction is ``+``. :class:`HyperMILUpdates` wraps a model's :class:`~mil_core.engine.PartitionUpdates`:
its global state :class:`HyperState` carries ``(q, gp, ψ)``; a :class:`HyperProbe` state makes
the same partition step return :class:`HyperStats` and leave the local state untouched, so any
executor's ``sweep`` (serial or Dask) evaluates J and ∇J. :meth:`HyperMILUpdates.hyper_step`,
called by :func:`~mil_core.engine.optimise` after each global update, runs a few L-BFGS-B
evaluations in unconstrained coordinates (log v, log ℓ, log α, log β, Z) and keeps the best point
seen, so **J never decreases across a hyper-parameter step** (the starting point is evaluated first).

**The log-normaliser.** ψ-VGPMIL's joint is normalised by
``Z(λ) = ∫ N(f; 0, K) Πₙ ψ(fₙ)·2cosh(fₙ/2) df`` (Eq. 19–20, with the ψ of
:mod:`mil_core.likelihoods`, whose constants cancel between ψ and Z). For VGPMIL
(ψ = hyperbolic secant) the integrand is 1: ``log Z = 0``. Otherwise two treatments:

* ``"mc_rff"`` (the paper's): ``log (1/S) Σₛ exp(Σₙ log g(fₛₙ))`` with prior draws
  ``f = √v·φ(x)ᵀw`` from random Fourier features (fixed frequencies and weights: common random
  numbers, so J is a smooth function of λ). Its log-mean-exp of a sum over N instances has a
  variance that grows with N; it is biased low.
* ``"quadrature"`` (ours, the default): the prior replaced by the product of its marginals,
  ``log Z ≈ Σₙ log E_{N(0, k(xₙ,xₙ))}[ψ(f)·2cosh(f/2)]``, each a 1-D integral evaluated by
  Gauss–Hermite quadrature (shifted: ``E[2cosh(f/2)ψ(f)] = 2e^{v/8} E_{N(v/2, v)}[ψ(f)]``).
  Deterministic and exact for its model; it ignores prior correlations between instances.
  ``docs/MODELS.md`` compares the two on MUSK.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import scipy.linalg
import scipy.optimize
from scipy.special import expit, logsumexp

from .._backend import array_namespace, like, solve_lower_transposed, to_numpy
from ..engine import BagBlock, GaussianQ, SparseGP, Summable
from ..kernels import RBF
from ..likelihoods import GammaMixture, HyperbolicSecant, Psi

__all__ = [
    "HyperSpace",
    "HyperState",
    "HyperProbe",
    "HyperStats",
    "HyperMILUpdates",
    "QuadratureNormaliser",
    "RFFNormaliser",
    "LogNormaliserName",
    "make_normaliser",
    "hyper_updates",
    "unwrap_hyper_state",
]

LogNormaliserName = Literal["quadrature", "mc_rff"]


# ------------------------------------------------------------------------- parameter space
@dataclass(frozen=True)
class HyperSpace:
    """Which hyper-parameters are learnt, and their unconstrained coordinates.

    Layout: ``[log v, log ℓ (1, or D with ARD), (log α, log β), (Z row-major)]``. Positivity of
    v, ℓ, α, β holds by construction (log parametrisation); ``bounds`` keep them within a factor
    ``e^7`` (≈ 1100) of their initial values, a guard against the runaway of an improper ψ (see
    ``docs/MODELS.md``), not a prior.
    """

    n_features: int
    n_inducing: int
    ard: bool = False
    learn_kernel: bool = True
    learn_inducing: bool = False
    learn_psi: bool = False

    def free(self) -> np.ndarray:
        """Mask of the learnt coordinates (v and ℓ stay in the layout when the kernel is fixed)."""
        n_ell = self.n_features if self.ard else 1
        mask = np.ones(1 + n_ell + 2 * self.learn_psi + self.n_inducing * self.n_features * self.learn_inducing, dtype=bool)
        mask[: 1 + n_ell] = self.learn_kernel
        return mask

    def pack(self, gp: SparseGP, psi: Psi) -> np.ndarray:
        ell = np.atleast_1d(np.asarray(gp.kernel.length_scale, dtype=np.float64))
        parts = [np.array([np.log(gp.kernel.variance)]), np.log(ell)]
        if self.learn_psi:
            parts.append(np.log([psi.alpha, psi.beta]))
        if self.learn_inducing:
            parts.append(gp.Z.ravel())
        return np.concatenate(parts)

    def unpack(self, x: np.ndarray, gp: SparseGP, psi: Psi) -> tuple[SparseGP, Psi]:
        n_ell = self.n_features if self.ard else 1
        variance = float(np.exp(x[0]))
        ell = np.exp(x[1 : 1 + n_ell])
        length_scale = tuple(ell.tolist()) if self.ard else float(ell[0])
        at = 1 + n_ell
        if self.learn_psi:
            psi = GammaMixture(alpha=float(np.exp(x[at])), beta=float(np.exp(x[at + 1])))
            at += 2
        Z = x[at:].reshape(gp.Z.shape) if self.learn_inducing else gp.Z
        return SparseGP.build(RBF(variance=variance, length_scale=length_scale), Z), psi

    def bounds(self, initial: np.ndarray) -> list[tuple[float | None, float | None]]:
        """Bounds of the full layout: log-parameters within ±7 of ``initial``; Z free."""
        n_log = 1 + (self.n_features if self.ard else 1) + (2 if self.learn_psi else 0)
        return [(v - 7.0, v + 7.0) for v in initial[:n_log]] + [(None, None)] * (initial.shape[0] - n_log)


# ------------------------------------------------------------------------------ global state
@dataclass(frozen=True)
class HyperState:
    """Global state with learnt hyper-parameters: whitened ``q``, the current ``gp`` (kernel, Z,
    chol Kzz) and ``psi``. ``history`` holds ``(J before, J after)`` of every hyper-parameter step."""

    q: GaussianQ
    gp: SparseGP
    psi: Psi
    history: tuple[tuple[float, float], ...] = ()


@dataclass(frozen=True)
class HyperProbe:
    """Asks every partition for J and ∇J at ``(gp, psi)`` with ``q`` and the local π fixed."""

    q: GaussianQ
    gp: SparseGP
    psi: Psi


@dataclass(frozen=True)
class HyperStats(Summable):
    """A partition's contribution to J and ∇J (see the module docstring).

    ``grad``: direct part in unconstrained coordinates (v, ℓ and ψ entries of the layout);
    ``grad_Z``: the ``K(X, Z)`` part of ∂J/∂Z (M, D) or empty; ``cross``: ``Σ Āₙᵀa'ₙ`` (M, M);
    ``mc_log_weights`` (S,) and ``mc_grad`` (S, P): Monte Carlo log Z pieces (empty unless
    ``"mc_rff"``).
    """

    value: float
    n_instances: int
    grad: np.ndarray
    grad_Z: np.ndarray
    cross: np.ndarray
    mc_log_weights: np.ndarray
    mc_grad: np.ndarray


# -------------------------------------------------------------------- RBF gradient helpers
def _scaled_centred(X: Any, Z: np.ndarray, kernel: RBF) -> tuple[Any, Any]:
    """``X/ℓ`` and ``Z/ℓ`` centred on the mean of ``Z/ℓ``, in ``X``'s namespace and device."""
    ell = like(np.asarray(kernel.length_scale, dtype=np.float64), X)
    Xs, Zs = X / ell, like(Z, X) / ell
    centre = array_namespace(X).mean(Zs, axis=0)
    return Xs - centre, Zs - centre


def _rbf_log_ell_gradient(weights: Any, X: Any, Z: np.ndarray, kernel: RBF, ard: bool) -> np.ndarray:
    """``Σₙₘ Wₙₘ ∂K(X, Z)ₙₘ/∂log ℓ_d`` for ``Wₙₘ = K̄ₙₘ Kₙₘ``: ``Σ Wₙₘ (xₙd − z_md)²/ℓ_d²`` by
    GEMMs where ``X`` lives; a D-vector comes back."""
    xp = array_namespace(X)
    Xs, Zs = _scaled_centred(X, Z, kernel)
    per_feature = to_numpy(
        xp.sum(weights, axis=1) @ (Xs * Xs) - 2.0 * xp.sum(Xs * (weights @ Zs), axis=0) + xp.sum(weights, axis=0) @ (Zs * Zs)
    )
    return per_feature if ard else np.array([per_feature.sum()])


def _rbf_Z_gradient(weights: Any, X: Any, Z: np.ndarray, kernel: RBF) -> np.ndarray:
    """``Σₙ Wₙₘ ∂K(X, Z)ₙₘ/∂Z_md = Σₙ Wₙₘ (xₙd − z_md)/ℓ_d²`` (the second argument only), host (M, D)."""
    ell2 = np.asarray(kernel.length_scale, dtype=np.float64) ** 2
    xp = array_namespace(X)
    return (to_numpy(weights.T @ X) - to_numpy(xp.sum(weights, axis=0))[:, None] * np.asarray(Z)) / ell2


def _cholesky_backward(L: np.ndarray, L_bar: np.ndarray) -> np.ndarray:
    """Symmetric ``K̄`` from ``L̄`` for ``L = chol(K)`` (Murray 2016): ``L⁻ᵀ Φ(LᵀL̄) L⁻¹``, symmetrised."""
    P = np.tril(L.T @ np.tril(L_bar))
    P[np.diag_indices_from(P)] *= 0.5
    S = scipy.linalg.solve_triangular(L, P, lower=True, trans=1, check_finite=False)  # L⁻ᵀ P
    S = scipy.linalg.solve_triangular(L, S.T, lower=True, trans=1, check_finite=False).T  # (L⁻ᵀ (L⁻ᵀ P)ᵀ)ᵀ = L⁻ᵀ P L⁻¹
    return 0.5 * (S + S.T)


# ---------------------------------------------------------------------------- log-normalisers
_HERMITE_NODES, _HERMITE_WEIGHTS = np.polynomial.hermite_e.hermegauss(160)
_LOG_HERMITE_WEIGHTS = np.log(_HERMITE_WEIGHTS / np.sqrt(2.0 * np.pi))


def _log_psi_and_derivatives(psi: Psi, f: np.ndarray, learn_psi: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``log ψ(f)``, ``d log ψ/df = −f θ(|f|)`` (Eq. 28) and, for the Gamma ψ, ``∂ log ψ/∂(log α, log β)``."""
    c = np.abs(f)
    value, slope = psi.log_psi(c), -f * psi.theta(c)
    if not learn_psi:
        return value, slope, np.zeros(f.shape + (0,))
    base = psi.beta + 0.5 * f**2
    return value, slope, np.stack([-psi.alpha * np.log(base), -psi.alpha * psi.beta / base], axis=-1)


@dataclass(frozen=True)
class QuadratureNormaliser:
    """``log Z ≈ N · log E_{N(0, v)}[ψ(f)·2cosh(f/2)]`` by 160-point Gauss–Hermite quadrature (error ≤ 2e-5 for v ≤ 20, growing with v).

    Only v (and α, β) enter: the marginal prior of every instance is N(0, v) for the RBF kernel.
    """

    def partition_terms(self, X: np.ndarray, gp: SparseGP, psi: Psi, space: HyperSpace) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(0), np.zeros((0, 0))

    def log_z_per_instance(self, variance: float, psi: Psi, learn_psi: bool) -> tuple[float, np.ndarray]:
        """``log E[ψ(f)2cosh(f/2)]`` for f ~ N(0, v), and its gradient in ``(log v[, log α, log β])``."""
        if isinstance(psi, HyperbolicSecant):
            return 0.0, np.zeros(1 + 2 * learn_psi)
        sd = np.sqrt(variance)
        f = 0.5 * variance + sd * _HERMITE_NODES
        log_psi, slope, d_psi = _log_psi_and_derivatives(psi, f, learn_psi)
        terms = _LOG_HERMITE_WEIGHTS + log_psi
        weights = np.exp(terms - logsumexp(terms))
        d_log_v = variance * (0.125 + weights @ (slope * (0.5 + 0.5 * _HERMITE_NODES / sd)))
        value = np.log(2.0) + 0.125 * variance + logsumexp(terms)
        return float(value), np.concatenate([[d_log_v], weights @ d_psi])

    def finish(self, stats: HyperStats, gp: SparseGP, psi: Psi, space: HyperSpace) -> tuple[float, np.ndarray]:
        """``log Z`` and its gradient in the direct layout ``[log v, log ℓ…, (log α, log β)]``."""
        value, grad = self.log_z_per_instance(gp.kernel.variance, psi, space.learn_psi)
        full = np.zeros(stats.grad.shape[0])
        full[0], full[full.shape[0] - (grad.shape[0] - 1) :] = grad[0], grad[1:]
        return stats.n_instances * value, stats.n_instances * full


@dataclass(frozen=True)
class RFFNormaliser:
    """The paper's Monte Carlo ``log Z`` with random-Fourier-feature prior draws (Sec. 4).

    ``f_s(x) = √v · k^{-1/2} [cos(xᵀΩ/ℓ), sin(xᵀΩ/ℓ)] w_s`` with Ω (D, k) and w_s (2k,) standard
    normal, drawn once (common random numbers). Scalar length-scale only.
    """

    frequencies: np.ndarray  # (D, k)
    weights: np.ndarray  # (2k, S)

    @classmethod
    def sample(cls, n_features: int, n_components: int = 128, n_samples: int = 64, seed: int = 0) -> RFFNormaliser:
        rng = np.random.default_rng(seed)
        return cls(rng.standard_normal((n_features, n_components)), rng.standard_normal((2 * n_components, n_samples)))

    def partition_terms(self, X: np.ndarray, gp: SparseGP, psi: Psi, space: HyperSpace) -> tuple[np.ndarray, np.ndarray]:
        """Per-sample partial sums ``Σₙ log g(f_sn)`` (S,) and their gradient (S, P) over this block."""
        k = self.frequencies.shape[1]
        v, ell = gp.kernel.variance, float(gp.kernel.length_scale)
        xp = array_namespace(X)
        phase = X @ like(self.frequencies / ell, X)
        cos, sin = xp.cos(phase), xp.sin(phase)
        scale, weights = np.sqrt(v / k), like(self.weights, X)
        f = to_numpy(scale * xp.concat([cos, sin], axis=1) @ weights)  # (n, S): this normaliser's N × S transfer
        df_dlog_ell = to_numpy(scale * xp.concat([sin * phase, -cos * phase], axis=1) @ weights)
        log_psi, slope, d_psi = _log_psi_and_derivatives(psi, f, space.learn_psi)
        log_g = log_psi + np.logaddexp(0.5 * f, -0.5 * f)
        dlog_g = slope + 0.5 * np.tanh(0.5 * f)
        grad = [np.sum(dlog_g * 0.5 * f, axis=0), np.sum(dlog_g * df_dlog_ell, axis=0)]
        grad += [d_psi[..., j].sum(axis=0) for j in range(d_psi.shape[-1])]
        return log_g.sum(axis=0), np.stack(grad, axis=1)

    def finish(self, stats: HyperStats, gp: SparseGP, psi: Psi, space: HyperSpace) -> tuple[float, np.ndarray]:
        logw = stats.mc_log_weights
        weights = np.exp(logw - logsumexp(logw))
        return float(logsumexp(logw) - np.log(logw.shape[0])), weights @ stats.mc_grad


def make_normaliser(name: LogNormaliserName, n_features: int, ard: bool, random_state: int | None) -> QuadratureNormaliser | RFFNormaliser:
    if name == "quadrature":
        return QuadratureNormaliser()
    if name == "mc_rff":
        if ard:
            raise ValueError("log_normaliser='mc_rff' supports a scalar length-scale only; use 'quadrature' with ARD")
        return RFFNormaliser.sample(n_features, seed=0 if random_state is None else int(random_state))
    raise ValueError(f"log_normaliser must be 'quadrature' or 'mc_rff', got {name!r}")


# ----------------------------------------------------------------------------- the updates
@dataclass(frozen=True)
class HyperMILUpdates:
    """A ψ-VGPMIL :class:`~mil_core.models.vgpmil.PsiMILUpdates` (``inner``) with learnt hyper-parameters.

    Prepared blocks are the raw :class:`~mil_core.engine.BagBlock` (the whitened features change
    with λ, so each sweep whitens with the ``gp`` of the global state). With ``hyper_every`` k,
    a hyper-parameter step of at most ``hyper_steps`` objective evaluations (each one sweep)
    follows every k-th global update.
    """

    inner: Any
    space: HyperSpace
    normaliser: QuadratureNormaliser | RFFNormaliser
    hyper_every: int = 1
    hyper_steps: int = 5

    def prepare(self, block: BagBlock) -> BagBlock:
        return block

    def init_local(self, block: BagBlock) -> np.ndarray:
        return self.inner.init_local(self.inner.prepare(block))

    def init_global(self) -> HyperState:
        return HyperState(q=self.inner.init_global(), gp=self.inner.gp, psi=self.inner.psi)

    def partition_step(self, block: BagBlock, logits: np.ndarray, glob: HyperState | HyperProbe) -> tuple[Any, np.ndarray]:
        inner = replace(self.inner, gp=glob.gp, psi=glob.psi)
        if isinstance(glob, HyperProbe):
            return self._probe(block, logits, glob), logits
        return inner.partition_step(inner.prepare(block), logits, glob.q)

    def global_update(self, stats: Any, glob: HyperState) -> tuple[HyperState, float]:
        q, objective = self.inner.global_update(stats, glob.q)
        return replace(glob, q=q), objective

    # ---- J and ∇J ------------------------------------------------------------------------
    def _probe(self, block: BagBlock, logits: np.ndarray, probe: HyperProbe) -> HyperStats:
        """One partition's J terms and gradient with q and π fixed (module docstring).

        The N × M and N × D work runs where ``block.X`` lives; only N-vectors of moments, the
        M × M ``Σ Āᵀa'`` and the D / M × D gradient pieces come to the host."""
        gp, psi, space = probe.gp, probe.psi, self.space
        xp = array_namespace(block.X)
        X = xp.asarray(block.X, dtype=xp.float64)
        L, m, S = like(gp.chol, X), probe.q.mean, probe.q.cov
        v = gp.kernel.variance
        Kxz = gp.kernel(X, like(gp.Z, X))
        features = gp.whiten_cross(Kxz.T, gp.kernel.diag(X))
        A, resid = features.A, to_numpy(features.resid)
        inside = resid > 0.0  # the FITC residual is clipped at 0: no gradient where it is
        AS = A @ like(S, X)
        mean = to_numpy(A @ like(m, X))
        var = np.maximum(to_numpy(xp.sum(AS * A, axis=1)) + resid, 0.0)
        c = np.sqrt(mean**2 + var)
        theta = psi.theta(c)
        pi = expit(logits)
        log_psi, _, d_psi = _log_psi_and_derivatives(psi, c, space.learn_psi)
        value = float(np.sum((pi - 0.5) * mean + log_psi))

        g_mean, h_var = pi - 0.5 - theta * mean, -0.5 * theta
        A_bar = (like(g_mean, X)[:, None] * like(m, X)[None, :] + 2.0 * like(h_var, X)[:, None] * AS
                 - 2.0 * like(h_var * inside, X)[:, None] * A)
        K_bar = solve_lower_transposed(L, A_bar.T).T  # Ā L⁻¹
        W = K_bar * Kxz
        grad = [np.array([float(xp.sum(W)) + v * np.sum(h_var * inside)]), _rbf_log_ell_gradient(W, X, gp.Z, gp.kernel, space.ard)]
        if space.learn_psi:
            grad.append(d_psi.sum(axis=0))
        mc_log_weights, mc_grad = self.normaliser.partition_terms(X, gp, psi, space)
        return HyperStats(
            value=value,
            n_instances=int(X.shape[0]),
            grad=np.concatenate(grad),
            grad_Z=_rbf_Z_gradient(W, X, gp.Z, gp.kernel) if space.learn_inducing else np.zeros(0),
            cross=to_numpy(A_bar.T @ A),
            mc_log_weights=mc_log_weights,
            mc_grad=mc_grad,
        )

    def objective_and_gradient(self, stats: HyperStats, gp: SparseGP, psi: Psi) -> tuple[float, np.ndarray]:
        """Finish J and ∇J on the client: the ``Kzz`` path from ``Σ Āᵀa'`` and the log-normaliser."""
        space, L, Z = self.space, gp.chol, gp.Z
        L_bar = -scipy.linalg.solve_triangular(L, stats.cross, lower=True, trans=1, check_finite=False)  # −L⁻ᵀ Σ Āᵀa'
        Kzz_bar = _cholesky_backward(L, L_bar)
        Kzz = gp.kernel(Z, Z)
        W = Kzz_bar * Kzz
        n_ell = space.n_features if space.ard else 1
        grad = stats.grad.copy()
        grad[0] += np.sum(Kzz_bar * (Kzz + gp.jitter * np.eye(Z.shape[0])))  # the jitter scales with v
        grad[1 : 1 + n_ell] += _rbf_log_ell_gradient(W, Z, Z, gp.kernel, space.ard)
        log_z, log_z_grad = self.normaliser.finish(stats, gp, psi, space)
        grad -= log_z_grad
        if space.learn_inducing:
            grad_Z = stats.grad_Z + 2.0 * _rbf_Z_gradient(W, Z, Z, gp.kernel)
            grad = np.concatenate([grad, grad_Z.ravel()])
        return stats.value - log_z, grad

    def evaluate(self, sweep: Callable[[Any], HyperStats], state: HyperState, x: np.ndarray) -> tuple[float, np.ndarray, SparseGP, Psi]:
        """J and ∇J (unconstrained coordinates) at ``x`` with the state's q and the current π."""
        gp, psi = self.space.unpack(x, state.gp, state.psi)
        stats = sweep(HyperProbe(q=state.q, gp=gp, psi=psi))
        value, grad = self.objective_and_gradient(stats, gp, psi)
        return value, grad, gp, psi

    def hyper_step(self, sweep: Callable[[Any], Any], iteration: int, state: HyperState) -> HyperState:
        """Algorithm 1, step 8: a few L-BFGS-B evaluations on −J/N, keeping the best point seen.

        The starting point is evaluated first, so J after the step is ≥ J before it.
        """
        if iteration % self.hyper_every or self.hyper_steps < 1:
            return state
        full = self.space.pack(state.gp, state.psi)
        free = self.space.free()
        seen: list[tuple[float, SparseGP, Psi]] = []

        def negative(x: np.ndarray) -> tuple[float, np.ndarray]:
            if len(seen) >= self.hyper_steps + 1:  # budget spent: a flat answer ends the line search
                return np.inf, np.zeros_like(x)
            point = full.copy()
            point[free] = x
            value, grad, gp, psi = self.evaluate(sweep, state, point)
            grad = grad[free]
            if not np.isfinite(value) or not np.all(np.isfinite(grad)):
                value, grad = -np.inf, np.zeros_like(x)
            seen.append((value, gp, psi))
            scale = max(abs(seen[0][0]), 1.0) if np.isfinite(seen[0][0]) else 1.0
            return (-value / scale if np.isfinite(value) else np.inf), -grad / scale

        bounds = self.space.bounds(self.space.pack(self.inner.gp, self.inner.psi))
        scipy.optimize.minimize(  # every accepted point lies within the bounds, so full[free] does
            negative, full[free], jac=True, method="L-BFGS-B", bounds=[b for b, f in zip(bounds, free) if f],
            options={"maxfun": self.hyper_steps + 1, "maxiter": self.hyper_steps},
        )
        best = max(range(len(seen)), key=lambda i: seen[i][0])
        value, gp, psi = seen[best]
        return replace(state, gp=gp, psi=psi, history=state.history + ((seen[0][0], value),))


# --------------------------------------------------------------------- estimator plumbing
def check_hyper_schedule(estimator: Any) -> tuple[int, int]:
    """The validated ``(hyper_every, hyper_steps)`` of an estimator that learns hyper-parameters."""
    every, steps = estimator.hyper_every, estimator.hyper_steps
    if not (isinstance(every, (int, np.integer)) and every >= 1):
        raise ValueError(f"hyper_every must be an integer >= 1, got {every!r}")
    if not (isinstance(steps, (int, np.integer)) and steps >= 0):
        raise ValueError(f"hyper_steps must be an integer >= 0, got {steps!r}")
    return int(every), int(steps)


HYPER_PARAMETER_FLAGS = ("learn_kernel", "learn_inducing", "learn_psi")
"""Constructor flags of what an estimator may learn by the ELBO (a model has those it supports)."""


def learnt_hyper_parameters(estimator: Any) -> dict[str, bool]:
    """Each of :data:`HYPER_PARAMETER_FLAGS`: whether ``estimator`` learns it (False where it has no such flag)."""
    return {name: bool(getattr(estimator, name, False)) for name in HYPER_PARAMETER_FLAGS}


def hyper_updates(estimator: Any, updates: Any) -> Any:
    """Wrap a ψ-VGPMIL estimator's updates in :class:`HyperMILUpdates` when it learns anything
    (``learn_kernel``, ``learn_inducing``, ``learn_psi``); otherwise return them unchanged."""
    learn = learnt_hyper_parameters(estimator)
    if not any(learn.values()):
        return updates
    every, steps = check_hyper_schedule(estimator)
    if learn["learn_psi"] and not isinstance(updates.psi, GammaMixture):
        raise ValueError("learn_psi needs the Gamma ψ of G-VGPMIL")
    gp = updates.gp
    if gp.kernel.bias:
        raise ValueError(f"{', '.join(k for k, on in learn.items() if on)}: hyper-parameter learning takes an RBF "
                         f"without a constant term (bias=0), got bias={gp.kernel.bias:g}")
    ard = np.ndim(gp.kernel.length_scale) == 1
    space = HyperSpace(gp.Z.shape[1], gp.Z.shape[0], ard=ard, **learn)
    name = getattr(estimator, "log_normaliser", "quadrature")
    normaliser = make_normaliser(name, gp.Z.shape[1], ard, estimator.random_state)
    return HyperMILUpdates(updates, space, normaliser, hyper_every=int(every), hyper_steps=int(steps))


def unwrap_hyper_state(estimator: Any) -> None:
    """After a fit with learnt hyper-parameters: ``q_``, ``gp_``, ``kernel_`` from the final
    :class:`HyperState`, plus ``psi_`` and ``hyper_objective_``."""
    state = estimator.q_
    if not isinstance(state, HyperState):
        return
    estimator.q_, estimator.gp_, estimator.kernel_ = state.q, state.gp, state.gp.kernel
    estimator.psi_ = state.psi
    estimator.hyper_objective_ = np.asarray(state.history).reshape(-1, 2)
