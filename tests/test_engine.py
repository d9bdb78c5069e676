"""The map → sum → small-solve engine (DESIGN §1) and the bag-local operations."""

import numpy as np
import pytest
from scipy.special import expit

from mil_core import RBF, VGPMIL, GVGPMIL, GaussianQ, HyperbolicSecant, SparseGP
from mil_core.bags import BagIndex, expected_max_of_others, split_into_blocks
from mil_core.engine import BagBlock, HeldOutRows, gaussian_update
from mil_core.models.vgpmil import PsiMILUpdates


@pytest.mark.parametrize("model", [VGPMIL, GVGPMIL])
def test_fit_does_not_depend_on_how_bags_are_grouped_into_blocks(toy_bags, model):
    X, bags, y, _ = toy_bags
    fits = [
        model(n_inducing=10, block_size=size, max_iter=15, tol=0.0, random_state=0).fit(X, bags, y)
        for size in (1, 7, 10**6)
    ]
    for other in fits[1:]:
        np.testing.assert_allclose(other.q_.mean, fits[0].q_.mean, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(other.q_.cov, fits[0].q_.cov, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(other.elbo_, fits[0].elbo_, rtol=1e-10)


def test_whitened_update_equals_the_papers_equations_26_27(toy_bags):
    """S = (Kzz⁻¹KzxΘKxzKzz⁻¹ + Kzz⁻¹)⁻¹, m = S Kzz⁻¹Kzx(π − ½), mapped through u = L v."""
    X, bags, y, _ = toy_bags
    index = BagIndex.from_ids(bags)
    labels = np.array([y[bags == k][0] for k in index.keys])
    kernel = RBF(1.0, 1.5).resolve(2)
    gp = SparseGP.build(kernel, X[::9])
    updates = PsiMILUpdates(gp=gp, psi=HyperbolicSecant(), log_h=np.log(100.0), emax="exact")
    block = updates.prepare(BagBlock(X=X[index.order], offsets=index.offsets, labels=labels))
    rng = np.random.default_rng(0)
    M = gp.n_inducing
    B = rng.normal(size=(M, M))
    q = GaussianQ(mean=rng.normal(size=M), cov=B @ B.T / M + np.eye(M))
    stats, logits = updates.partition_step(block, updates.init_local(block), q)
    new_q, _ = updates.global_update(stats, q)

    mean, var = block.features.latent_moments(q)
    theta = HyperbolicSecant().theta(np.sqrt(mean**2 + var))
    pi = expit(logits)
    Kzz = kernel(gp.Z, gp.Z) + gp.jitter * np.eye(M)
    Kzx = kernel(gp.Z, X[index.order])
    Kinv = np.linalg.inv(Kzz)
    S_paper = np.linalg.inv(Kinv @ Kzx @ np.diag(theta) @ Kzx.T @ Kinv + Kinv)
    m_paper = S_paper @ Kinv @ Kzx @ (pi - 0.5)
    L = gp.chol
    np.testing.assert_allclose(L @ new_q.cov @ L.T, S_paper, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(L @ new_q.mean, m_paper, rtol=1e-6, atol=1e-8)


def test_global_update_solves_with_cholesky_and_keeps_symmetry():
    rng = np.random.default_rng(3)
    A = rng.normal(size=(50, 6))
    G, r = A.T @ A, rng.normal(size=6)
    q = gaussian_update(G, r)
    np.testing.assert_allclose(q.cov, np.linalg.inv(np.eye(6) + G), rtol=1e-10)
    np.testing.assert_allclose(q.mean, np.linalg.solve(np.eye(6) + G, r), rtol=1e-10)
    assert np.array_equal(q.cov, q.cov.T)


def test_kl_of_the_prior_to_itself_is_zero():
    assert GaussianQ.prior(5).kl_to_prior() == pytest.approx(0.0, abs=1e-12)


def _brute_force_emax(pi, offsets, rule):
    out = np.empty_like(pi)
    for b in range(len(offsets) - 1):
        for n in range(offsets[b], offsets[b + 1]):
            others = np.delete(pi[offsets[b] : offsets[b + 1]], n - offsets[b])
            if others.size == 0:
                out[n] = 0.0
            elif rule == "max":
                out[n] = others.max()
            else:
                out[n] = 1 - np.prod(1 - others)
    return out


@pytest.mark.parametrize("rule", ["exact", "max"])
def test_expected_max_of_others_matches_brute_force(rule):
    rng = np.random.default_rng(4)
    offsets = np.array([0, 1, 4, 4 + 6, 12])  # includes a singleton bag
    pi = rng.uniform(size=12)
    pi[5] = pi[6]  # a tie for the maximum
    got = expected_max_of_others(pi, np.log1p(-pi), offsets, rule)
    np.testing.assert_allclose(got, _brute_force_emax(pi, offsets, rule), rtol=1e-12, atol=1e-15)


def test_exact_emax_is_finite_when_probabilities_saturate():
    logits = np.array([800.0, -800.0, 40.0, 800.0])
    pi = expit(logits)
    log1m = -np.logaddexp(0.0, logits)
    got = expected_max_of_others(pi, log1m, np.array([0, 4]), "exact")
    assert np.all(np.isfinite(got)) and np.all((got >= 0) & (got <= 1))


def test_blocks_hold_whole_bags_and_cover_every_bag():
    offsets = np.array([0, 3, 4, 10, 12, 13])
    blocks = split_into_blocks(offsets, block_size=4)
    assert blocks[0][0] == 0 and blocks[-1][1] == 5
    assert all(a < b for a, b in blocks) and all(b1 == a2 for (_, b1), (a2, _) in zip(blocks, blocks[1:]))
    with pytest.raises(ValueError):
        split_into_blocks(offsets, 0)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_whitening_and_sweep_statistics_in_row_chunks_equal_the_one_shot_formulas(monkeypatch, dtype):
    """A' = K(X, Z)L⁻ᵀ, the FITC residual, E f, Var f = diag(A'S'A'ᵀ) + resid and Σ w a'a'ᵀ (weights of
    both signs) computed chunk by chunk (a last, shorter chunk included) equal the formulas on all rows."""
    import scipy.linalg

    from mil_core import engine

    monkeypatch.setattr(engine, "ROWS", 64)
    rng = np.random.default_rng(3)
    X, M = rng.normal(size=(150, 3)), 12
    gp = SparseGP.build(RBF(1.3, 1.1).resolve(3), X[::13][:M])
    whitened = gp.whiten(X.astype(dtype))
    A = scipy.linalg.solve_triangular(gp.chol, gp.kernel(gp.Z, X), lower=True).T
    tol = {"rtol": 1e-10, "atol": 1e-12} if dtype == np.float64 else {"rtol": 1e-5, "atol": 1e-6}
    assert whitened.A.dtype == dtype and whitened.A.flags.c_contiguous
    np.testing.assert_allclose(whitened.A, A, **tol)
    np.testing.assert_allclose(whitened.resid, np.clip(1.3 - np.sum(A * A, axis=1), 0, None), **tol)

    B = rng.normal(size=(M, M))
    q = GaussianQ(mean=rng.normal(size=M), cov=B @ B.T / M + 0.1 * np.eye(M))
    mean, var = whitened.latent_moments(q)
    np.testing.assert_allclose(mean, A @ q.mean, **tol)
    np.testing.assert_allclose(var, np.einsum("ij,jk,ik->i", A, q.cov, A) + whitened.resid, **tol)
    for weights in (rng.random(150), rng.normal(size=150)):
        np.testing.assert_allclose(whitened.weighted_gram(weights), A.T @ (A * weights[:, None]), **tol)


def test_held_out_rows_are_whitened_once_per_gp():
    """``SparseGP.whiten(HeldOutRows(X))`` equals ``whiten(X)``; under the same GP object the same
    whitening comes back (the kernel choice's checkpoints, early stopping's sweeps), under another
    GP it is recomputed, and a pickled copy carries the rows without any GP's whitening."""
    import pickle

    rng = np.random.default_rng(0)
    X, Z = rng.normal(size=(40, 3)), rng.normal(size=(6, 3))
    gp, other = SparseGP.build(RBF(1.0).resolve(3), Z), SparseGP.build(RBF(4.0).resolve(3), Z)
    rows = HeldOutRows(X)
    first = gp.whiten(rows)
    np.testing.assert_array_equal(first.A, gp.whiten(X).A)
    np.testing.assert_array_equal(first.resid, gp.whiten(X).resid)
    assert gp.whiten(rows) is first
    assert other.whiten(rows) is not first
    np.testing.assert_array_equal(other.whiten(rows).A, other.whiten(X).A)
    copy = pickle.loads(pickle.dumps(rows))
    assert copy._last is None and np.array_equal(copy.X, X)
