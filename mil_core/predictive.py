"""Formulas on the Gaussian latent predictive ``f* ~ N(μ, σ²)`` (independent across instances,
the FITC-diagonal predictive of DESIGN §3) shared by the models and the orthant/Ising numerics."""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["probit_link_scale", "probit_scale", "sample_latent"]


def probit_scale(mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """``μ / sqrt(1 + πσ²/8)``: ``E[σ(f)] ≈ σ(that)`` for ``f ~ N(μ, σ²)`` (the probit
    approximation of the logistic-Gaussian integral; seed 000 Eq. 31, seed 001 Sec. 3)."""
    return mean / np.sqrt(1.0 + np.pi * var / 8.0)


def probit_link_scale(mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """``μ / sqrt(1 + σ²)``: ``E[Φ(f)] = Φ(that)`` exactly for ``f ~ N(μ, σ²)`` (the probit
    link's instance probability, seed 002 Eq. 25)."""
    return mean / np.sqrt(1.0 + var)


def sample_latent(mean: np.ndarray, var: np.ndarray, n_draws: int, rng: Any) -> np.ndarray:
    """``n_draws`` independent draws of ``f*ₙ ~ N(meanₙ, varₙ)``: an (n, n_draws) array.

    ``rng`` is a ``numpy.random.Generator`` or ``RandomState``; its standard normals fill the
    array row by row, so drawing a block of rows at a time continues the same stream.
    """
    return mean[:, None] + np.sqrt(var)[:, None] * rng.standard_normal((mean.shape[0], n_draws))
