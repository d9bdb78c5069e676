"""Hyper-parameter learning by the ELBO (seed 000, Sec. 4, Eq. 29; Algorithm 1, step 8)."""

import numpy as np
import pytest
from conftest import make_toy_bags
from scipy.integrate import quad
from sklearn.base import clone

from mil_core import GVGPMIL, RBF, VGPMIL
from mil_core.bags import BagIndex
from mil_core.engine import BagBlock, GaussianQ, SerialExecutor, SparseGP
from mil_core.models.hyper import HyperMILUpdates, HyperSpace, HyperState, QuadratureNormaliser, RFFNormaliser, make_normaliser
from mil_core.likelihoods import GammaMixture, HyperbolicSecant, ThetaFunction
from mil_core.models.vgpmil import PsiMILUpdates


def _blocks(X, bags, y, cuts):
    index = BagIndex.from_ids(bags)
    Xs = X[index.order]
    labels = np.array([y[bags == k][0] for k in index.keys])
    return [
        BagBlock(Xs[index.offsets[a] : index.offsets[b]], index.offsets[a : b + 1] - index.offsets[a], labels[a:b])
        for a, b in zip(cuts[:-1], cuts[1:])
    ]


def _probe_setup(ard, learn_psi, learn_inducing, normaliser, cuts=(0, 7, 20)):
    """A state away from any optimum: three closed-form sweeps, then a perturbed q mean."""
    X, bags, y, _ = make_toy_bags(20, 3, seed=1)
    rng = np.random.default_rng(0)
    Z = X[rng.choice(X.shape[0], 6, replace=False)] + 0.1
    gp = SparseGP.build(RBF(0.9, (1.3, 0.8, 2.0) if ard else 1.4), Z)
    psi = GammaMixture(0.8, 1.7)
    inner = PsiMILUpdates(gp=gp, psi=psi, log_h=np.log(100.0), emax="exact")
    space = HyperSpace(3, 6, ard=ard, learn_inducing=learn_inducing, learn_psi=learn_psi)
    updates = HyperMILUpdates(inner, space, make_normaliser(normaliser, 3, ard, 0))
    executor = SerialExecutor(updates, _blocks(X, bags, y, list(cuts)))
    state = updates.init_global()
    for _ in range(3):
        state, _ = updates.global_update(executor.sweep(state), state)
    q = GaussianQ(state.q.mean + 0.3 * rng.normal(size=6), state.q.cov)
    return updates, executor, HyperState(q=q, gp=gp, psi=psi)


@pytest.mark.parametrize(
    "ard, learn_psi, learn_inducing, normaliser",
    [(False, False, False, "quadrature"), (True, True, True, "quadrature"), (False, True, False, "mc_rff")],
)
def test_analytic_gradient_matches_central_differences(ard, learn_psi, learn_inducing, normaliser):
    """∇J in unconstrained coordinates (log v, log ℓ or ARD log ℓ_d, log α, log β, Z), including
    the Kzz path through the Cholesky factor and the log-normaliser."""
    updates, executor, state = _probe_setup(ard, learn_psi, learn_inducing, normaliser)
    x0 = updates.space.pack(state.gp, state.psi)
    _, grad, _, _ = updates.evaluate(executor.sweep, state, x0)
    step = 1e-5
    numeric = np.array([
        (updates.evaluate(executor.sweep, state, x0 + step * e)[0] - updates.evaluate(executor.sweep, state, x0 - step * e)[0]) / (2 * step)
        for e in np.eye(x0.shape[0])
    ])
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-6 * np.abs(numeric).max())


def test_objective_and_gradient_do_not_depend_on_the_partitioning():
    one = _probe_setup(True, True, True, "quadrature", cuts=(0, 20))
    many = _probe_setup(True, True, True, "quadrature", cuts=(0, 3, 4, 11, 20))
    x0 = one[0].space.pack(one[2].gp, one[2].psi)
    value_one, grad_one, _, _ = one[0].evaluate(one[1].sweep, one[2], x0)
    value_many, grad_many, _, _ = many[0].evaluate(many[1].sweep, many[2], x0)
    assert value_many == pytest.approx(value_one, rel=1e-10)
    np.testing.assert_allclose(grad_many, grad_one, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("variance", [0.3, 1.0, 5.0, 20.0])
def test_quadrature_log_normaliser_matches_direct_integration(variance):
    """log E_{N(0,v)}[ψ(f)·2cosh(f/2)] for the Gamma ψ, against adaptive quadrature in log space."""
    psi = GammaMixture(alpha=0.7, beta=1.5)
    value, _ = QuadratureNormaliser().log_z_per_instance(variance, psi, learn_psi=False)

    def integrand(f):
        return np.exp(psi.log_psi(abs(f)) + np.logaddexp(f / 2, -f / 2) - f * f / (2 * variance)) / np.sqrt(2 * np.pi * variance)

    reference = quad(integrand, -np.inf, np.inf, epsabs=0.0, epsrel=1e-12, limit=1000)[0]
    assert value == pytest.approx(np.log(reference), abs=5e-5)  # Gauss–Hermite converges slowly as v grows


def test_vgpmil_log_normaliser_is_constant_in_the_kernel_variance():
    """ψ = hyperbolic secant: ψ(f)·2cosh(f/2) is constant, so log Z does not depend on v (Eq. 20)."""
    normaliser = QuadratureNormaliser()
    generic = ThetaFunction(HyperbolicSecant().theta)  # forces the quadrature path
    values = [normaliser.log_z_per_instance(v, generic, learn_psi=False)[0] for v in (0.2, 1.0, 4.0, 10.0)]
    np.testing.assert_allclose(values, values[0], atol=1e-6)
    assert normaliser.log_z_per_instance(7.0, HyperbolicSecant(), learn_psi=False) == (0.0, pytest.approx(np.zeros(1)))


def test_monte_carlo_log_normaliser_agrees_with_quadrature_for_one_instance():
    """With a single instance the correlated and the factorised normaliser are the same integral."""
    psi = GammaMixture(1.0, 2.5)
    gp = SparseGP.build(RBF(2.0, 1.0), np.zeros((2, 1)) + [[0.0], [1.0]])
    space = HyperSpace(1, 2)
    rff = RFFNormaliser.sample(1, n_components=64, n_samples=20000, seed=3)
    log_weights, _ = rff.partition_terms(np.array([[0.3]]), gp, psi, space)
    monte_carlo = np.log(np.mean(np.exp(log_weights)))
    exact, _ = QuadratureNormaliser().log_z_per_instance(2.0, psi, learn_psi=False)
    assert monte_carlo == pytest.approx(exact, abs=0.03)


@pytest.mark.parametrize("model", [VGPMIL, GVGPMIL])
def test_hyper_steps_never_decrease_the_objective_and_keep_parameters_valid(model):
    X, bags, y, _ = make_toy_bags()
    fitted = model(n_inducing=10, max_iter=25, random_state=0, learn_kernel=True, hyper_steps=4).fit(5.0 * X, bags, y)
    before, after = fitted.hyper_objective_.T
    assert fitted.hyper_objective_.shape == (fitted.n_iter_, 2)
    assert np.all(after >= before)
    assert np.any(after > before + 1e-6)
    kernel = fitted.kernel_
    assert kernel.variance > 0 and np.isfinite(kernel.variance)
    assert kernel.length_scale > 0 and np.isfinite(kernel.length_scale)


def test_learnt_length_scale_follows_the_scale_of_the_features():
    """Features multiplied by 10: the default ℓ = √D is 10× too short; the ELBO moves ℓ up."""
    X, bags, y, _ = make_toy_bags()
    fitted = {}
    for scale in (1.0, 10.0):
        fitted[scale] = VGPMIL(n_inducing=10, max_iter=30, random_state=0, learn_kernel=True, hyper_steps=4,
                               standardize=False).fit(scale * X, bags, y)
    start = np.sqrt(X.shape[1])
    assert fitted[10.0].kernel_.length_scale > 3 * start
    assert fitted[10.0].kernel_.length_scale > 4 * fitted[1.0].kernel_.length_scale


def test_ard_learns_that_only_the_first_feature_matters():
    X, bags, y, _ = make_toy_bags(n_features=3)
    fitted = VGPMIL(
        n_inducing=10, max_iter=30, random_state=0, kernel=RBF(1.0, (2.0, 2.0, 2.0)), learn_kernel=True, hyper_steps=4
    ).fit(X, bags, y)
    ell = np.asarray(fitted.kernel_.length_scale)
    assert ell[0] < ell[1] and ell[0] < ell[2]


def test_ard_started_from_sqrt_d_finds_the_informative_feature_among_noise():
    """``RBF(length_scale="ard")``: one ℓ_d = √D per feature at the start, whatever D is."""
    X, bags, y, _ = make_toy_bags(n_features=1)
    X = np.hstack([X, np.random.default_rng(0).standard_normal((X.shape[0], 7))])  # seven pure-noise features
    fitted = VGPMIL(n_inducing=10, max_iter=30, random_state=0, kernel=RBF(1.0, "ard"), learn_kernel=True, hyper_steps=4).fit(X, bags, y)
    ell = np.asarray(fitted.kernel_.length_scale)
    assert ell.shape == (8,) and fitted.kernel == RBF(1.0, "ard")  # the parameter stays as given
    assert np.argmin(ell) == 0 and ell[0] < 0.5 * np.min(ell[1:])


def test_g_vgpmil_learns_alpha_and_beta_within_their_domain():
    X, bags, y, _ = make_toy_bags()
    fitted = GVGPMIL(n_inducing=10, max_iter=20, random_state=0, learn_kernel=True, learn_psi=True, hyper_steps=4).fit(X, bags, y)
    assert (fitted.psi_.alpha, fitted.psi_.beta) != (1.0, 2.5)
    assert fitted.psi_.alpha > 0 and fitted.psi_.beta > 0
    assert np.all(np.diff(fitted.hyper_objective_, axis=1) >= 0)


def test_learning_switched_on_but_never_stepping_is_the_fixed_kernel_fit(monkeypatch):
    """The wrapper (raw blocks, whitened every sweep) reproduces the cached-whitening fit."""
    X, bags, y, _ = make_toy_bags()
    monkeypatch.setattr(GVGPMIL, "_relevance_reach", None)  # with learnt hyper-parameters the choice tries no relevance kernel
    fixed = GVGPMIL(n_inducing=10, max_iter=15, tol=0.0, random_state=0).fit(X, bags, y)
    wrapped = GVGPMIL(n_inducing=10, max_iter=15, tol=0.0, random_state=0, learn_kernel=True, hyper_every=100).fit(X, bags, y)
    np.testing.assert_allclose(wrapped.q_.mean, fixed.q_.mean, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(wrapped.elbo_, fixed.elbo_, rtol=1e-10)
    assert wrapped.kernel_ == fixed.kernel_


def test_learning_gives_the_same_fit_on_one_block_or_many():
    X, bags, y, _ = make_toy_bags()
    params = dict(n_inducing=10, max_iter=10, tol=0.0, random_state=0, learn_kernel=True, hyper_steps=3)
    one = VGPMIL(**params).fit(X, bags, y)
    many = VGPMIL(**params, block_size=20).fit(X, bags, y)
    np.testing.assert_allclose(many.q_.mean, one.q_.mean, rtol=1e-8, atol=1e-10)
    assert many.kernel_.variance == pytest.approx(one.kernel_.variance, rel=1e-8)


def test_learning_parameters_are_validated_and_cloneable():
    X, bags, y, _ = make_toy_bags()
    model = GVGPMIL(learn_kernel=True, hyper_every=3, log_normaliser="mc_rff")
    assert clone(model).get_params()["log_normaliser"] == "mc_rff"
    with pytest.raises(ValueError, match="hyper_every"):
        VGPMIL(n_inducing=10, learn_kernel=True, hyper_every=0).fit(X, bags, y)
    with pytest.raises(ValueError, match="log_normaliser"):
        GVGPMIL(n_inducing=10, learn_kernel=True, log_normaliser="laplace").fit(X, bags, y)
