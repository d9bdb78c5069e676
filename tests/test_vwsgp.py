"""VWSGP (seed 001, Sec. 3): closed-form updates of S, m and ξ_b on accumulated bag evidence."""

import numpy as np
import pytest
from scipy.special import expit, log_expit
from sklearn.base import clone
from sklearn.metrics import roc_auc_score

from mil_core import RBF, VWSGP, BagBlock
from mil_core.bags import BagIndex
from tests.conftest import make_toy_bags

FAST = dict(n_inducing=10, max_iter=20, tol=0.0, random_state=0)
HERMITE_X, HERMITE_W = np.polynomial.hermite_e.hermegauss(80)  # ∫ g(t) N(t|0,1) dt ≈ Σ w g(x) / √(2π)


def gaussian_expectation(function, mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    t = mean[:, None] + np.sqrt(var)[:, None] * HERMITE_X[None, :]
    return function(t) @ HERMITE_W / np.sqrt(2 * np.pi)


def bag_labels(y: np.ndarray, bags: np.ndarray, keys: np.ndarray) -> np.ndarray:
    return np.array([y[bags == k][0] for k in keys])


def test_fit_does_not_depend_on_how_bags_are_grouped_into_blocks(toy_bags):
    X, bags, y, _ = toy_bags
    fits = [VWSGP(**FAST, block_size=size).fit(X, bags, y) for size in (65536, 13, 1)]
    for other in fits[1:]:
        np.testing.assert_allclose(other.q_.mean, fits[0].q_.mean, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(other.q_.cov, fits[0].q_.cov, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(other.elbo_, fits[0].elbo_, rtol=1e-10)


def test_the_elbo_never_decreases(toy_bags):
    """The ξ step and the q step each maximise the Jaakkola bound exactly (coordinate ascent)."""
    X, bags, y, _ = toy_bags
    model = VWSGP(n_inducing=10, kernel=RBF(2.0, 1.5), max_iter=100, tol=1e-12, random_state=0).fit(X, bags, y)
    assert model.n_iter_ > 5
    assert np.all(np.diff(model.elbo_) >= -1e-10 * np.abs(model.elbo_[1:]))


def test_updates_equal_the_papers_unwhitened_equations(toy_bags):
    """Three sweeps of the Sec. 3 updates written with K_ZZ⁻¹ (explicitly, fine for M = 6):
    ξ_b² = tr(11ᵀK_bZK⁻¹(mmᵀ + S)K⁻¹K_Zb) + tr(11ᵀ diag(K_bb − K_bZK⁻¹K_Zb)),
    S = (Σ_b 2λ(ξ_b) a_b a_bᵀ + K⁻¹)⁻¹, m = S Σ_b (T_b − ½) a_b with a_b = K⁻¹K_Zb 1."""
    X, bags, y, _ = toy_bags
    model = VWSGP(n_inducing=6, max_iter=3, tol=0.0, standardize=False, random_state=0).fit(X, bags, y)
    gp = model.gp_
    Kzz = gp.chol @ gp.chol.T
    Kzz_inv = np.linalg.inv(Kzz)
    index = BagIndex.from_ids(bags)
    labels = np.array([y[bags == k][0] for k in index.keys])
    A = np.stack([Kzz_inv @ gp.kernel(gp.Z, X[bags == k]).sum(axis=1) for k in index.keys])  # rows a_b
    residual = np.array(
        [np.sum(gp.kernel.diag(X[bags == k]) - np.sum(gp.kernel(gp.Z, X[bags == k]) * (Kzz_inv @ gp.kernel(gp.Z, X[bags == k])), axis=0)) for k in index.keys]
    )
    m, S = np.zeros(6), Kzz.copy()
    for _ in range(3):
        xi = np.sqrt(np.einsum("bi,ij,bj->b", A, np.outer(m, m) + S, A) + residual)
        two_lambda = (expit(xi) - 0.5) / xi
        S = np.linalg.inv(A.T @ (A * two_lambda[:, None]) + Kzz_inv)
        m = S @ (A.T @ (labels - 0.5))
    np.testing.assert_allclose(gp.chol @ model.q_.mean, m, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(gp.chol @ model.q_.cov @ gp.chol.T, S, rtol=1e-6, atol=1e-8)


def test_the_elbo_is_below_the_exact_expected_log_likelihood(toy_bags):
    """Jaakkola: E_q log σ((2T − 1)s_b) − KL ≥ ELBO, the expectation by quadrature over the exact
    q(s_b) = N(E s_b, Var s_b)."""
    X, bags, y, _ = toy_bags
    model = VWSGP(**FAST).fit(X, bags, y)
    updates = model._make_updates(model.gp_)
    index = BagIndex.from_ids(bags)
    labels = np.array([y[bags == k][0] for k in index.keys])
    block = updates.prepare(BagBlock(X=X[index.order], offsets=index.offsets, labels=labels))
    stats, xi = updates.partition_step(block, updates.init_local(block), model.q_)
    mean, var = block.evidence_moments(model.q_)
    sign = 2.0 * labels - 1.0
    exact = np.sum(gaussian_expectation(lambda s: log_expit(sign[:, None] * s), mean, var))
    assert np.all(xi > 0)
    assert stats.elbo <= exact


def test_predicts_bag_labels_and_evidence_points_at_the_witnesses(toy_bags):
    X, bags, y, instance_labels = toy_bags
    X_test, bags_test, y_test, _ = make_toy_bags(seed=1)
    model = VWSGP(n_inducing=10, max_iter=50, random_state=0).fit(X, bags, y)
    keys, p, sd = model.predict_bag_proba(X_test, bags_test, return_std=True)
    assert roc_auc_score(bag_labels(y_test, bags_test, keys), p) > 0.95
    assert np.all((sd > 0) & (sd < 0.5))
    # Not instance labels, but the positive instances carry the largest evidence.
    assert roc_auc_score(instance_labels, model.predict_instance_evidence(X)) > 0.9


def test_monte_carlo_bag_probability_matches_quadrature(toy_bags):
    """p = E σ(s*) with s* ~ N(Σμₙ, Σσₙ²) (the paper's diagonal predictive)."""
    X, bags, y, _ = toy_bags
    model = VWSGP(**FAST, n_mc_samples=4000).fit(X, bags, y)
    keys, p_mc, sd = model.predict_bag_proba(X, bags, return_std=True, method="mc")
    _, p_probit = model.predict_bag_proba(X, bags)  # the default: the closed form
    mean, std = model.predict_instance_evidence(X, return_std=True)
    index = BagIndex.from_ids(bags)
    s_mean = np.add.reduceat(mean[index.order], index.offsets[:-1])
    s_var = np.add.reduceat(std[index.order] ** 2, index.offsets[:-1])
    expected = gaussian_expectation(expit, s_mean, s_var)
    assert np.all(np.abs(p_mc - expected) <= 5 * sd / np.sqrt(4000) + 1e-12)
    np.testing.assert_allclose(p_probit, expected, atol=0.02)
    np.testing.assert_array_equal(keys, np.unique(bags))


def test_a_bag_of_twenty_thousand_instances_gives_finite_predictions(toy_bags):
    X, bags, y, _ = toy_bags
    model = VWSGP(**FAST).fit(X, bags, y)
    rng = np.random.default_rng(0)
    huge = rng.normal(size=(20000, X.shape[1])) + [3.0, 0.0]
    keys, p, sd = model.predict_bag_proba(huge, np.zeros(20000, dtype=int), return_std=True)
    assert np.all(np.isfinite(p)) and np.all(np.isfinite(sd)) and p[0] > 0.99


def test_clone_and_get_params_follow_scikit_learn(toy_bags):
    model = VWSGP(n_inducing=7, kernel=RBF(2.0, 1.0), random_state=3)
    copy = clone(model)
    assert copy.get_params() == model.get_params()
    assert not hasattr(copy, "q_")
    assert not hasattr(VWSGP(), "predict_instance_proba")  # evidences are not instance labels


def test_bad_input_is_rejected_with_a_message_naming_the_problem(toy_bags):
    X, bags, y, _ = toy_bags
    with pytest.warns(UserWarning, match="exceeds the number of training instances"):
        assert VWSGP(n_inducing=10_000).fit(X, bags, y).gp_.Z.shape == X.shape
    with pytest.raises(ValueError, match="bag labels must be 0 or 1"):
        VWSGP(n_inducing=5).fit(X, bags, 2 * y)
    with pytest.raises(ValueError, match="NaN"):
        VWSGP(n_inducing=5).fit(np.where(np.arange(X.size).reshape(X.shape) == 3, np.nan, X), bags, y)
    model = VWSGP(**FAST).fit(X, bags, y)
    with pytest.raises(ValueError, match="features"):
        model.predict_bag_proba(np.ones((3, 5)), np.zeros(3))
    with pytest.raises(ValueError, match="method must be"):
        model.predict_bag_proba(X, bags, method="exact")
