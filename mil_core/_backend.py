"""Array-namespace helpers: the same code runs on NumPy (CPU) and CuPy (GPU) arrays.

The heavy linear algebra of a partition step (kernel block, triangular solve, Gram statistics)
runs in the namespace of its input; the small M×M algebra of the global update and the O(N)
bag-local logic run on the host in float64.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.linalg
from array_api_compat import array_namespace, is_cupy_array

__all__ = ["array_namespace", "to_numpy", "solve_lower", "cholesky_with_jitter"]


def to_numpy(x: Any) -> np.ndarray:
    """Return ``x`` as a host NumPy array (``cupy.asnumpy`` for device arrays)."""
    if is_cupy_array(x):
        return x.get()
    return np.asarray(x)


def solve_lower(L: Any, B: Any) -> Any:
    """Solve ``L X = B`` for lower-triangular ``L`` in the namespace of ``L``."""
    if is_cupy_array(L):
        import cupyx.scipy.linalg as cpx_linalg

        return cpx_linalg.solve_triangular(L, B, lower=True)
    return scipy.linalg.solve_triangular(L, B, lower=True, check_finite=False)


def cholesky_with_jitter(
    K: np.ndarray, *, initial_relative_jitter: float = 1e-6, max_tries: int = 10
) -> tuple[np.ndarray, float]:
    """Lower Cholesky factor of ``K + jitter·I`` with adaptive jitter.

    The first attempt adds no jitter when ``initial_relative_jitter`` is 0; otherwise the
    jitter starts at ``initial_relative_jitter · mean(diag K)`` and grows ×10 until the
    factorisation succeeds. Returns ``(L, jitter_used)``.
    """
    K = np.asarray(K, dtype=np.float64)
    scale = float(np.mean(np.diag(K))) if K.size else 1.0
    scale = scale if np.isfinite(scale) and scale > 0 else 1.0
    jitter = initial_relative_jitter * scale
    eye = np.eye(K.shape[0])
    for _ in range(max_tries):
        try:
            L = np.linalg.cholesky(K + jitter * eye)
        except np.linalg.LinAlgError:
            L = None
        if L is not None and np.all(np.isfinite(L)):
            return L, jitter
        jitter = max(jitter * 10.0, 1e-12 * scale)
    raise np.linalg.LinAlgError(
        f"matrix is not positive definite even with jitter {jitter / 10:.3g} "
        f"(mean diagonal {scale:.3g}); check the kernel hyper-parameters and inducing points"
    )
