"""The ψ functions of ψ-VGPMIL (seed 000, Sec. 4, Eq. 16–28 and Eq. 38).

The logistic likelihood is written ``p(y|f) ∝ exp((y − ½) f) ψ(f)`` with ψ a Gaussian scale
mixture. The variational updates need only ``θ(c) = −ψ'(c) / (c ψ(c))`` (Eq. 28); the ELBO
monitor also needs ``log ψ(c)`` up to a constant, from the tangent bound
``log ψ(f) ≥ log ψ(c) − ½ θ(c) (f² − c²)``.

All functions act on NumPy float64 arrays of ``c ≥ 0`` (the bag-local logic runs on the host).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np

__all__ = ["Psi", "HyperbolicSecant", "GammaMixture", "ThetaFunction", "as_psi"]


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
        small = c < 1e-3
        safe = np.where(small, 1.0, c)
        series = 0.25 - c**2 / 48.0 + c**4 / 480.0
        return np.where(small, series, np.tanh(safe / 2.0) / (2.0 * safe))

    def log_psi(self, c: np.ndarray) -> np.ndarray:
        c = np.abs(np.asarray(c, dtype=np.float64))
        return -np.logaddexp(0.0, -c) - c / 2.0


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
