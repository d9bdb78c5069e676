"""The ψ functions of ψ-VGPMIL (seed 000, Sec. 4, Eq. 16–28 and Eq. 38).

The logistic likelihood is written ``p(y|f) ∝ exp((y − ½) f) ψ(f)`` with ψ a Gaussian scale
mixture. The variational updates need only ``θ(c) = −ψ'(c) / (c ψ(c))`` (Eq. 28); the ELBO
monitor also needs ``log ψ(c)`` up to a constant, from the tangent bound
``log ψ(f) ≥ log ψ(c) − ½ θ(c) (f² − c²)``.

All functions act on NumPy float64 arrays of ``c ≥ 0`` (the bag-local logic runs on the host).
:func:`log_sigmoids` and :func:`log_add_exp` are the log-space arithmetic of the logistic
likelihood's q(y) update (Eq. 25), written for speed on 10⁷-vectors.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["Psi", "HyperbolicSecant", "GammaMixture", "ThetaFunction", "as_psi", "log_add_exp", "log_sigmoids"]


def log_sigmoids(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(log σ(x), log σ(−x))`` for any float ``x``, sharing one ``log1p(e^{−|x|})``:
    ``log σ(±x) = min(±x, 0) − log1p(e^{−|x|})``. Exact in the tails, and a third of the time
    of ``np.logaddexp(0, ∓x)`` each (the host part of a sweep over 10⁷ instances is these)."""
    x = np.asarray(x, dtype=np.float64)
    tail, log_pos, log_neg = (np.empty_like(x) for _ in range(3))  # outputs: arrays also for a 0-d x
    np.abs(x, out=tail)
    for step in (np.negative, np.exp, np.log1p):  # in place: one temporary for a 10⁷-vector, not four
        step(tail, out=tail)
    np.subtract(np.minimum(x, 0.0, out=log_pos), tail, out=log_pos)
    np.negative(np.add(np.maximum(x, 0.0, out=log_neg), tail, out=log_neg), out=log_neg)
    return log_pos, log_neg


def log_add_exp(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """``log(eˣ + eʸ)`` of finite arrays as ``max(x, y) + log1p(e^{−|x−y|})`` (``np.logaddexp``'s
    value at a third of its time)."""
    x, y = np.broadcast_arrays(np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64))
    out = np.subtract(x, y, out=np.empty(x.shape))
    for step in (np.abs, np.negative, np.exp, np.log1p):
        step(out, out=out)
    return np.add(out, np.maximum(x, y), out=out)


@runtime_checkable
class Psi(Protocol):
    """A ψ of ψ-VGPMIL: ``theta(c)`` (Eq. 28) and ``log_psi(c)`` up to an additive constant."""

    def theta(self, c: np.ndarray) -> np.ndarray: ...

    def log_psi(self, c: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class HyperbolicSecant:
    """ψ = hyperbolic secant: the logistic likelihood of VGPMIL / PG-VGPMIL.

    ``θ_PG(c) = tanh(c/2) / (2c)`` (Eq. 14), the mean of PG(1, c) and the Jaakkola ``2λ(ξ)``;
    ``log ψ(c) = log σ(c) − c/2``. At small ``c`` the Taylor series ``1/4 − c²/48 + c⁴/480`` is
    used, so θ is smooth at 0.
    """

    def theta(self, c: np.ndarray) -> np.ndarray:
        c = np.abs(np.asarray(c, dtype=np.float64))
        with np.errstate(invalid="ignore", divide="ignore"):  # c = 0 is replaced below
            theta = np.asarray(np.tanh(c / 2.0) / (2.0 * c))  # an array also for a scalar c
        small = c < 1e-3
        if np.any(small):
            c2 = c[small] ** 2
            theta[small] = 0.25 - c2 / 48.0 + c2**2 / 480.0
        return theta

    def log_psi(self, c: np.ndarray) -> np.ndarray:
        c = np.abs(np.asarray(c, dtype=np.float64))
        return -np.log1p(np.exp(-c)) - c / 2.0  # log σ(c) for c ≥ 0


@dataclass(frozen=True)
class GammaMixture:
    """ψ with a Gamma(α, β) mixing density: G-VGPMIL (Eq. 38).

    ``θ_G(c) = α / (β + c²/2)``; ``log ψ(c) = −α log(β + c²/2)`` (normaliser dropped).
    """

    alpha: float = 1.0
    beta: float = 2.5

    def __post_init__(self) -> None:
        if not (self.alpha > 0 and self.beta > 0):
            raise ValueError(f"alpha and beta must be positive, got alpha={self.alpha}, beta={self.beta}")

    def theta(self, c: np.ndarray) -> np.ndarray:
        c = np.asarray(c, dtype=np.float64)
        return self.alpha / (self.beta + 0.5 * c**2)

    def log_psi(self, c: np.ndarray) -> np.ndarray:
        c = np.asarray(c, dtype=np.float64)
        return -self.alpha * np.log(self.beta + 0.5 * c**2)


_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(48)


@dataclass(frozen=True)
class ThetaFunction:
    """A user-supplied θ: ``log ψ`` follows from ``d log ψ / dc = −c θ(c)`` (Eq. 28).

    ``log ψ(c) = −∫₀ᶜ t θ(t) dt`` is evaluated by 48-point Gauss–Legendre quadrature, exact to
    rounding for the smooth θ of this family; θ itself is used as given by the updates.
    """

    fn: Callable[[np.ndarray], np.ndarray]

    def theta(self, c: np.ndarray) -> np.ndarray:
        return np.asarray(self.fn(np.asarray(c, dtype=np.float64)), dtype=np.float64)

    def log_psi(self, c: np.ndarray) -> np.ndarray:
        c = np.abs(np.asarray(c, dtype=np.float64))
        t = 0.5 * c[..., None] * (_GL_NODES + 1.0)
        integrand = t * self.theta(t)
        return -0.5 * c * (integrand @ _GL_WEIGHTS)


def as_psi(psi: Psi | Callable[[np.ndarray], np.ndarray] | None) -> Psi:
    """Normalise the ``psi`` parameter: ``None`` → :class:`HyperbolicSecant`; a bare θ callable
    → :class:`ThetaFunction`."""
    if psi is None:
        return HyperbolicSecant()
    if isinstance(psi, Psi):
        return psi
    if callable(psi):
        return ThetaFunction(psi)
    raise TypeError(f"psi must be a Psi object or a callable θ(c), got {type(psi).__name__}")
