"""The GIL-free host BLAS/LAPACK calls (mil_core._native_blas) give SciPy's numbers to the last bit
and refuse arguments that would hand BLAS a wrong pointer or shape."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import scipy.linalg.blas

from mil_core._native_blas import cholesky_solve, upper_triangular_product


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (100, 300), (3, 0)])
def test_the_triangular_product_is_scipys_trmm(dtype, shape):
    rng = np.random.default_rng(0)
    m, n = shape
    full = np.asarray(rng.normal(size=(m, m)), dtype=dtype, order="F")  # its lower triangle must not be read
    b = np.asarray(rng.normal(size=(m, n)), dtype=dtype, order="F")
    trmm = scipy.linalg.blas.dtrmm if dtype == np.float64 else scipy.linalg.blas.strmm
    expected = trmm(1.0, full, b.copy(order="F"), side=0, lower=0) if n else b.copy()
    out = b.copy(order="F")
    result = upper_triangular_product(full, out)
    assert result is out and result.dtype == dtype
    np.testing.assert_array_equal(result, expected)
    np.testing.assert_allclose(result, np.triu(full).astype(np.float64) @ b, rtol=1e-4 if dtype == np.float32 else 1e-12, atol=1e-4)


def test_the_triangular_product_refuses_what_blas_would_misread():
    upper = np.asfortranarray(np.eye(3))
    with pytest.raises(ValueError, match="Fortran-ordered"):
        upper_triangular_product(upper, np.ones((3, 4)))  # C order
    with pytest.raises(ValueError, match="Fortran-ordered"):
        upper_triangular_product(np.ones((3, 3)) + np.tril(np.ones((3, 3))), np.asfortranarray(np.ones((3, 4))))
    with pytest.raises(TypeError, match="one dtype"):
        upper_triangular_product(upper, np.asfortranarray(np.ones((3, 4), dtype=np.float32)))
    with pytest.raises(TypeError, match="one dtype"):
        upper_triangular_product(np.asfortranarray(np.eye(3, dtype=int)), np.asfortranarray(np.ones((3, 4), dtype=int)))
    with pytest.raises(ValueError, match="shape"):
        upper_triangular_product(upper, np.asfortranarray(np.ones((4, 4))))
    frozen = np.asfortranarray(np.ones((3, 4)))
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        upper_triangular_product(upper, frozen)


@pytest.mark.parametrize("m", [1, 6, 100])
def test_the_cholesky_solve_is_scipys_cho_solve(m):
    rng = np.random.default_rng(m)
    A = rng.normal(size=(m, 2 * m))
    lower = np.linalg.cholesky(np.eye(m) + A @ A.T)  # C-ordered, as numpy returns it
    for b in (rng.normal(size=m), np.eye(m), rng.normal(size=(m, 3))):
        x = cholesky_solve(lower, b)
        np.testing.assert_array_equal(x, scipy.linalg.cho_solve((lower, True), b, check_finite=False))
        np.testing.assert_allclose(lower @ (lower.T @ x), b, atol=1e-10)
    b = rng.normal(size=m)
    before = b.copy()
    cholesky_solve(lower, b)
    np.testing.assert_array_equal(b, before)  # a new array: the right-hand side is not overwritten


def test_the_cholesky_solve_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="right-hand side"):
        cholesky_solve(np.eye(3), np.ones(4))
    with pytest.raises(ValueError, match="factor"):
        cholesky_solve(np.ones((3, 2)), np.ones(3))
    with pytest.raises(ValueError, match="right-hand side"):
        cholesky_solve(np.eye(3), np.ones((3, 2, 2)))
