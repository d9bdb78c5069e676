"""Kernels evaluated on blocks of rows.

Length-scale convention
-----------------------
``RBF(variance=v, length_scale=ℓ)`` is ``k(x, z) = v · exp(−‖x − z‖² / (2ℓ²))``, with ``ℓ`` a
scalar or a vector of per-feature length-scales (ARD: ``‖(x − z)/ℓ‖²``); ``bias=b`` adds a constant
kernel, ``k + b``.

The seeds write the kernel as ``v·exp(−‖x − x'‖/(2l))`` (000, Sec. 2.2) and initialise
``(v, l) = (0.5, D)`` for D-dimensional standardised features. Read with a squared norm, their
``l`` is our ``ℓ²``: the paper's default corresponds to ``ℓ = √D``, which is what
``length_scale=None`` resolves to at fit time (see :meth:`RBF.resolve`); ``length_scale="ard"``
resolves to one ``√D`` per feature, the start of an ARD kernel learnt with ``learn_kernel=True``
(seed 000 Sec. 4, Eq. 29).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from array_api_compat import device

from ._backend import array_namespace, like

__all__ = ["RBF"]


@dataclass(frozen=True)
class RBF:
    """Squared-exponential kernel ``v · exp(−‖(x − z)/ℓ‖² / 2)``, plus a constant ``b``.

    Parameters
    ----------
    variance:
        Signal variance ``v`` (> 0).
    length_scale:
        ``ℓ`` (> 0): a scalar, a length-D vector for ARD, ``None`` for ``√D``, or ``"ard"`` for a
        length-D vector of ``√D`` (when D is not known in advance), resolved by :meth:`resolve`
        once the number of features is known.
    bias:
        ``b`` (≥ 0) of the constant kernel added to the RBF: a N(0, b) prior over one shift
        shared by every latent, so that far from the training data f reverts to the shift the
        data set, not to 0 (π = ½). 0 (default): the RBF alone, the seeds' kernel. VGPMIL's and
        G-VGPMIL's ``kernel=None`` choose between b = 0 and b = v near the chosen variance
        (``docs/MODELS.md``, "A constant kernel").
    """

    variance: float = 1.0
    length_scale: float | tuple[float, ...] | str | None = None
    bias: float = 0.0

    def resolve(self, n_features: int) -> RBF:
        """Return a copy whose ``length_scale`` is concrete and validated for ``n_features``."""
        v = self.variance
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or v <= 0 or not np.isfinite(v):
            raise ValueError(f"kernel variance must be a positive finite number, got {v!r}")
        b = self.bias
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or b < 0 or not np.isfinite(b):
            raise ValueError(f"kernel bias must be a finite number >= 0, got {b!r}")
        if self.length_scale is None:
            return replace(self, length_scale=float(np.sqrt(n_features)))
        if isinstance(self.length_scale, str) and self.length_scale == "ard":
            return replace(self, length_scale=(float(np.sqrt(n_features)),) * n_features)
        try:
            ell = None if isinstance(self.length_scale, str | bool) else np.asarray(self.length_scale, dtype=np.float64)
        except (TypeError, ValueError):
            ell = None
        if ell is None:
            raise ValueError(f"length_scale must be a number, a list of numbers, None or 'ard', got {self.length_scale!r}")
        if ell.ndim > 1 or (ell.ndim == 1 and ell.shape[0] != n_features):
            raise ValueError(
                f"ARD length_scale must have one entry per feature ({n_features}), got shape {ell.shape}"
            )
        if np.any(ell <= 0) or not np.all(np.isfinite(ell)):
            raise ValueError("length_scale entries must be positive and finite")
        return replace(self, length_scale=float(ell) if ell.ndim == 0 else tuple(ell.tolist()))

    def _scaled(self, X: Any, xp: Any) -> Any:
        X = xp.asarray(X, dtype=xp.float64)
        return X / like(np.asarray(self.length_scale, dtype=np.float64), X)

    def __call__(self, X: Any, Z: Any) -> Any:
        """Cross-covariance block ``K(X, Z)`` of shape (n, M), via one GEMM.

        Both inputs are centred on the mean of ``Z`` first (the kernel is translation
        invariant), which keeps ``‖x‖² + ‖z‖² − 2xᵀz`` accurate for large feature values.
        """
        xp = array_namespace(X, Z)
        Xs, Zs = self._scaled(X, xp), self._scaled(Z, xp)
        centre = xp.mean(Zs, axis=0)
        Xs, Zs = Xs - centre, Zs - centre
        sq = (
            xp.sum(Xs * Xs, axis=1)[:, None]
            + xp.sum(Zs * Zs, axis=1)[None, :]
            - 2.0 * (Xs @ Zs.T)
        )
        return self.variance * xp.exp(-0.5 * xp.clip(sq, 0.0, None)) + self.bias

    def diag(self, X: Any) -> Any:
        """``diag K(X, X)`` without forming the matrix: ``v + b`` for every row."""
        xp = array_namespace(X)
        return xp.full((X.shape[0],), float(self.variance) + float(self.bias), dtype=xp.float64, device=device(X))
