"""Array-namespace helpers: the same code runs on NumPy (CPU) and on any array-API namespace on
an accelerator (CuPy on GPUs; array-api-strict on an emulated device in CI).

The heavy linear algebra of a partition step (kernel block, triangular solve, Gram statistics)
runs in the namespace and on the device of its input; the small M×M algebra of the global
update and the O(N) bag-local logic run on the host in float64. Data crosses between the two
only through :func:`to_numpy` (device → host) and :func:`like` (host → the input's device), so
the transfers a model makes are exactly the calls it makes to these two.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import scipy.linalg
from array_api_compat import array_namespace, device, is_cupy_array, is_numpy_array

__all__ = [
    "array_namespace", "cholesky_with_jitter", "is_host_array", "like", "solve_lower", "solve_lower_transposed", "take_rows", "to_numpy",
]


def is_host_array(x: Any) -> bool:
    """Whether ``x`` is host data (a NumPy array, or anything that is not an array-API array).

    CuPy arrays are recognised by type: CuPy 14's ``ndarray`` has no ``__array_namespace__``
    (``array_api_compat`` supplies its namespace)."""
    return is_numpy_array(x) or not (is_cupy_array(x) or hasattr(x, "__array_namespace__"))


def to_numpy(x: Any) -> np.ndarray:
    """``x`` as a host NumPy array: ``cupy.asnumpy`` for CuPy, a DLPack copy to the CPU for any
    other array-API array on a device (one device → host transfer)."""
    if is_host_array(x):
        return np.asarray(x)
    if is_cupy_array(x):
        return x.get()
    return np.from_dlpack(x, device="cpu", copy=True)


def like(values: Any, reference: Any, dtype: Any = None) -> Any:
    """Host ``values`` as an array of ``reference``'s namespace on its device (identity for NumPy)."""
    if is_host_array(reference):
        return np.asarray(values, dtype=dtype)
    xp = array_namespace(reference)
    return xp.asarray(values, dtype=dtype, device=device(reference))


def take_rows(X: Any, rows: np.ndarray) -> Any:
    """``X[rows]`` for host row indices, with the indices moved to ``X``'s device when needed."""
    if is_host_array(X):
        return X[rows]
    xp = array_namespace(X)
    return xp.take(X, like(np.asarray(rows, dtype=np.int64), X), axis=0)


def solve_lower(L: Any, B: Any) -> Any:
    """Solve ``L X = B`` for lower-triangular ``L`` in the namespace of ``L``.

    The array-API standard has no triangular solve; other namespaces than NumPy and CuPy use
    the general ``linalg.solve`` (same result, more flops)."""
    if is_host_array(L):
        return scipy.linalg.solve_triangular(L, B, lower=True, check_finite=False)
    if is_cupy_array(L):
        import cupyx.scipy.linalg as cpx_linalg

        return cpx_linalg.solve_triangular(L, B, lower=True)
    return array_namespace(L).linalg.solve(L, B)


def solve_lower_transposed(L: Any, B: Any) -> Any:
    """Solve ``Lᵀ X = B`` for lower-triangular ``L`` in the namespace of ``L``."""
    if is_host_array(L):
        return scipy.linalg.solve_triangular(L, B, lower=True, trans=1, check_finite=False)
    if is_cupy_array(L):
        import cupyx.scipy.linalg as cpx_linalg

        return cpx_linalg.solve_triangular(L, B, lower=True, trans=1)
    xp = array_namespace(L)
    return xp.linalg.solve(xp.linalg.matrix_transpose(L), B)


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
