"""Random Fourier features for an RBF kernel (seed 004, Eq. 16; Rahimi & Recht)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from sklearn.utils import check_random_state

from ._backend import array_namespace, like

__all__ = ["RandomFourierFeatures"]


@dataclass(frozen=True)
class RandomFourierFeatures:
    """``φ(x) = k^{-1/2} [cos(g₁ᵀx), sin(g₁ᵀx), …, cos(g_kᵀx), sin(g_kᵀx)]`` with
    ``gⱼ ~ N(0, σ_g² I)`` (Eq. 16), so ``φ(x)ᵀφ(x') → exp(−σ_g²‖x − x'‖²/2)`` as k grows.

    ``frequencies`` is the (D, k) matrix of the gⱼ; the features are returned in the order
    ``[cos(xG), sin(xG)]`` (a fixed permutation of Eq. 16, which changes nothing for a linear model).
    """

    frequencies: np.ndarray

    @classmethod
    def sample(cls, n_features: int, n_components: int, scale: float, random_state: Any = None) -> RandomFourierFeatures:
        """Draw k = ``n_components`` frequencies with standard deviation σ_g = ``scale``."""
        if not (isinstance(n_components, (int, np.integer)) and n_components >= 1):
            raise ValueError(f"n_random_features must be a positive integer, got {n_components!r}")
        if not scale > 0:
            raise ValueError(f"rff_scale must be positive, got {scale!r}")
        rng = check_random_state(random_state)
        return cls(frequencies=scale * rng.standard_normal((n_features, n_components)))

    @property
    def n_output_features(self) -> int:
        return 2 * int(self.frequencies.shape[1])

    def __call__(self, X: Any) -> Any:
        xp = array_namespace(X)
        projected = X @ like(self.frequencies, X, dtype=X.dtype)
        norm = 1.0 / np.sqrt(self.frequencies.shape[1])
        return norm * xp.concat([xp.cos(projected), xp.sin(projected)], axis=1)
