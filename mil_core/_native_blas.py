"""Host BLAS/LAPACK routines that release the GIL while they run.

SciPy's Python wrappers of BLAS and LAPACK (``scipy.linalg.blas``, ``.lapack``, and the
``cho_solve`` built on them) hold the GIL for the whole call, so two
Python threads that each multiply by a triangular factor take turns instead of running side by
side (:func:`mil_core.threadpools.concurrent_parts`: the kernel choice's splits). The same
routines are exported for compiled code by ``scipy.linalg.cython_blas`` and ``cython_lapack``,
whose function pointers are public (SciPy's Cython BLAS/LAPACK API, documented since 0.16);
calling them through :mod:`ctypes` releases the GIL during the call, as any foreign call does.
Same library, same arguments, the same numbers to the last bit as SciPy's Python wrappers.

Arguments are checked here (dtype, memory order, shapes) before a pointer goes to BLAS: a wrong
one would be memory corruption, not an exception.
"""

from __future__ import annotations

import ctypes
from functools import cache
from typing import Any

import numpy as np
import scipy.linalg.cython_blas
import scipy.linalg.cython_lapack

__all__ = ["cholesky_solve", "upper_triangular_product"]

_CAPSULE_NAME = ctypes.pythonapi.PyCapsule_GetName
_CAPSULE_NAME.restype, _CAPSULE_NAME.argtypes = ctypes.c_char_p, [ctypes.py_object]
_CAPSULE_POINTER = ctypes.pythonapi.PyCapsule_GetPointer
_CAPSULE_POINTER.restype, _CAPSULE_POINTER.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]

_SCALAR = {np.dtype(np.float64): ctypes.c_double, np.dtype(np.float32): ctypes.c_float}
_PREFIX = {np.dtype(np.float64): "d", np.dtype(np.float32): "s"}


def _foreign(module: Any, name: str, *argtypes: Any) -> Any:
    """The routine ``name`` of SciPy's Cython BLAS/LAPACK ``module`` as a ctypes function (a
    foreign call: the GIL is released while it runs)."""
    capsule = module.__pyx_capi__[name]
    return ctypes.CFUNCTYPE(None, *argtypes)(_CAPSULE_POINTER(capsule, _CAPSULE_NAME(capsule)))


_CHAR, _INT, _POINTER = ctypes.c_char_p, ctypes.POINTER(ctypes.c_int), ctypes.c_void_p


@cache
def _trmm(dtype: np.dtype) -> Any:
    """``?trmm(side, uplo, transa, diag, m, n, alpha, a, lda, b, ldb)``."""
    return _foreign(scipy.linalg.cython_blas, f"{_PREFIX[dtype]}trmm", _CHAR, _CHAR, _CHAR, _CHAR, _INT, _INT,
                    ctypes.POINTER(_SCALAR[dtype]), _POINTER, _INT, _POINTER, _INT)


@cache
def _potrs() -> Any:
    """``dpotrs(uplo, n, nrhs, a, lda, b, ldb, info)``."""
    return _foreign(scipy.linalg.cython_lapack, "dpotrs", _CHAR, _INT, _INT, _POINTER, _INT, _POINTER, _INT, _INT)


def upper_triangular_product(upper: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``b ← U b`` in place and returned, for the upper triangle ``U`` of ``upper`` (M, M) and
    ``b`` (M, n), both Fortran-ordered, of one dtype (float32 or float64); the strictly lower
    triangle of ``upper`` is not read (BLAS TRMM, left side, no transpose)."""
    dtype = np.dtype(b.dtype)
    if dtype not in _SCALAR or upper.dtype != dtype:
        raise TypeError(f"upper_triangular_product needs float32 or float64 arrays of one dtype, got {upper.dtype} and {b.dtype}")
    if not (upper.flags.f_contiguous and b.flags.f_contiguous and b.flags.writeable):
        raise ValueError("upper_triangular_product needs Fortran-ordered arrays and a writeable b")
    m, n = b.shape
    if upper.shape != (m, m):
        raise ValueError(f"upper_triangular_product: upper has shape {upper.shape}, b has {b.shape}")
    if m and n:
        rows, columns, alpha = ctypes.c_int(m), ctypes.c_int(n), _SCALAR[dtype](1.0)
        _trmm(dtype)(b"L", b"U", b"N", b"N", ctypes.byref(rows), ctypes.byref(columns), ctypes.byref(alpha),
                     upper.ctypes.data, ctypes.byref(rows), b.ctypes.data, ctypes.byref(rows))
    return b


def cholesky_solve(lower: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``x`` with ``L Lᵀ x = b`` for the lower-triangular float64 factor ``L`` (M, M) and ``b`` (M,)
    or (M, k), as ``scipy.linalg.cho_solve((L, True), b)`` (LAPACK POTRS); a new array."""
    lower = np.asarray(lower, dtype=np.float64, order="F")
    x = np.array(b, dtype=np.float64, order="F", ndmin=1)
    m = lower.shape[0]
    if lower.shape != (m, m) or x.shape[0] != m or x.ndim > 2:
        raise ValueError(f"cholesky_solve: factor of shape {lower.shape}, right-hand side of shape {x.shape}")
    if m and x.size:
        size, columns, info = ctypes.c_int(m), ctypes.c_int(x.size // m), ctypes.c_int(0)
        _potrs()(b"L", ctypes.byref(size), ctypes.byref(columns), lower.ctypes.data, ctypes.byref(size), x.ctypes.data,
                 ctypes.byref(size), ctypes.byref(info))
        if info.value != 0:
            raise ValueError(f"cholesky_solve: LAPACK potrs argument {-info.value} is invalid")
    return x
