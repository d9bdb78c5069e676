"""The RBF kernel and the ψ functions of ψ-VGPMIL (seed 000, Eq. 14, 28, 38)."""

import numpy as np
import pytest
from scipy.special import expit, log_expit

from mil_core import RBF, GammaMixture, HyperbolicSecant, ThetaFunction
from mil_core._backend import cholesky_with_jitter
from mil_core.likelihoods import log_add_exp, log_sigmoids


def test_rbf_block_matches_the_definition_with_ard():
    rng = np.random.default_rng(0)
    X, Z = rng.normal(size=(7, 3)), rng.normal(size=(4, 3))
    ell = np.array([0.5, 1.0, 2.0])
    k = RBF(variance=1.7, length_scale=tuple(ell)).resolve(3)
    brute = 1.7 * np.exp(-0.5 * (((X[:, None, :] - Z[None, :, :]) / ell) ** 2).sum(-1))
    np.testing.assert_allclose(k(X, Z), brute, rtol=1e-12)
    np.testing.assert_allclose(k.diag(X), np.full(7, 1.7))


def test_a_constant_kernel_adds_its_bias_to_every_entry_and_is_kept_by_resolve():
    rng = np.random.default_rng(0)
    X, Z = rng.normal(size=(7, 3)), rng.normal(size=(4, 3))
    plain, biased = RBF(1.7).resolve(3), RBF(1.7, bias=0.6).resolve(3)
    assert biased.bias == 0.6 and biased.length_scale == plain.length_scale
    np.testing.assert_allclose(biased(X, Z), plain(X, Z) + 0.6, rtol=1e-12)
    np.testing.assert_allclose(biased.diag(X), np.full(7, 2.3))
    assert np.linalg.eigvalsh(biased(X, X)).min() > -1e-12  # a sum of covariances is one
    for bad in (-0.1, np.inf, "1", True):
        with pytest.raises(ValueError, match=f"kernel bias must be a finite number >= 0, got {bad!r}"):
            RBF(1.0, bias=bad).resolve(3)


def test_default_length_scale_is_sqrt_of_the_dimension():
    assert RBF().resolve(166).length_scale == pytest.approx(np.sqrt(166))


def test_ard_length_scale_resolves_to_sqrt_of_the_dimension_for_every_feature():
    assert RBF(4.0, "ard").resolve(3) == RBF(4.0, (np.sqrt(3),) * 3)
    with pytest.raises(ValueError, match="'ARD'"):
        RBF(1.0, "ARD").resolve(3)


def test_a_kernel_of_other_types_than_numbers_is_refused_by_name():
    with pytest.raises(ValueError, match="variance must be a positive finite number, got '4'"):
        RBF("4").resolve(2)
    with pytest.raises(ValueError, match=r"length_scale must be .* got \(1.0, 'a'\)"):
        RBF(1.0, (1.0, "a")).resolve(2)


def test_rbf_stays_accurate_and_finite_for_features_scaled_to_1e6():
    rng = np.random.default_rng(1)
    X = rng.normal(size=(5, 4))
    Z = X + 1e-3 * rng.normal(size=X.shape)
    k_small = RBF(1.0, 1.0).resolve(4)(X, Z)
    k_large = RBF(1.0, 1e6).resolve(4)(X * 1e6, Z * 1e6)
    np.testing.assert_allclose(k_large, k_small, rtol=1e-6)
    assert np.all(np.isfinite(RBF(1.0, 1.0).resolve(4)(X * 1e6, Z)))


@pytest.mark.parametrize("bad", [dict(variance=-1.0), dict(length_scale=0.0), dict(length_scale=(1.0, 2.0))])
def test_rbf_rejects_invalid_hyper_parameters(bad):
    with pytest.raises(ValueError):
        RBF(**bad).resolve(3)


def test_theta_pg_is_the_jaakkola_two_lambda():
    xi = np.array([1e-2, 0.3, 1.0, 5.0, 40.0, 1e6])  # where the naive formula has no cancellation
    jaakkola_two_lambda = (expit(xi) - 0.5) / xi
    np.testing.assert_allclose(HyperbolicSecant().theta(xi), jaakkola_two_lambda, rtol=1e-12)


def test_theta_pg_is_smooth_through_zero():
    c = np.array([0.0, 1e-12, 1e-6, 9.99e-4, 1.001e-3])
    theta = HyperbolicSecant().theta(c)
    np.testing.assert_allclose(theta, 0.25 - c**2 / 48, rtol=1e-12)
    assert HyperbolicSecant().theta(0.0) == 0.25 and HyperbolicSecant().theta(2.0) == pytest.approx(np.tanh(1.0) / 4.0)


@pytest.mark.parametrize("psi", [HyperbolicSecant(), GammaMixture(alpha=0.5, beta=4.0)])
def test_theta_is_minus_dlogpsi_over_c(psi):
    """Eq. 28: θ(c) = −ψ'(c)/(c ψ(c)), checked by central differences of log ψ."""
    c, h = np.linspace(0.2, 8.0, 25), 1e-5
    numeric = -(psi.log_psi(c + h) - psi.log_psi(c - h)) / (2 * h) / c
    np.testing.assert_allclose(psi.theta(c), numeric, rtol=1e-6)


@pytest.mark.parametrize("psi", [HyperbolicSecant(), GammaMixture(alpha=1.0, beta=2.5)])
def test_a_bare_theta_recovers_log_psi_up_to_a_constant(psi):
    c = np.linspace(0.0, 30.0, 50)
    from_theta = ThetaFunction(psi.theta).log_psi(c)
    np.testing.assert_allclose(from_theta - from_theta[0], psi.log_psi(c) - psi.log_psi(c)[:1], atol=1e-9)


def test_log_sigmoids_and_log_add_exp_match_scipy_and_numpy_in_the_tails():
    x = np.concatenate([[-1e4, -800.0, -40.0, -1e-12, 0.0, 1e-12, 40.0, 800.0, 1e4], np.linspace(-50, 50, 1001)])
    log_pos, log_neg = log_sigmoids(x)
    np.testing.assert_allclose(log_pos, log_expit(x), rtol=1e-14, atol=0)
    np.testing.assert_allclose(log_neg, log_expit(-x), rtol=1e-14, atol=0)
    assert log_pos[0] == -1e4 and log_neg[8] == -1e4  # x = ∓10⁴: no overflow, no log(0)
    y = x[::-1].copy()
    np.testing.assert_allclose(log_add_exp(x, y), np.logaddexp(x, y), rtol=1e-14, atol=1e-300)
    assert log_add_exp(np.array([-1e4]), np.array([-1e4]))[0] == pytest.approx(-1e4 + np.log(2.0), rel=1e-15)
    assert [float(v) for v in log_sigmoids(0.0)] == [-np.log(2.0)] * 2 and float(log_add_exp(0.0, 0.0)) == np.log(2.0)


def test_gamma_psi_rejects_non_positive_parameters():
    with pytest.raises(ValueError, match="alpha and beta"):
        GammaMixture(alpha=0.0)


def test_cholesky_adds_jitter_only_when_needed():
    A = np.array([[2.0, 1.0], [1.0, 2.0]])
    _, jitter = cholesky_with_jitter(A, initial_relative_jitter=0.0)
    assert jitter == 0.0
    singular = np.ones((3, 3))  # duplicate inducing points give exactly this
    L, jitter = cholesky_with_jitter(singular, initial_relative_jitter=0.0)
    assert jitter > 0 and np.all(np.isfinite(L))
    with pytest.raises(np.linalg.LinAlgError, match="not positive definite"):
        cholesky_with_jitter(-np.eye(2), max_tries=3)
