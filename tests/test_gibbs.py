"""The Gibbs sampler (seed 003 §2) as the gold standard for the variational probit models."""

import numpy as np
import pytest

from mil_core import RBF, VGPMILPR, VGPMILPRGibbs, VGPMILPRI
from tests.conftest import make_toy_bags
from tests.test_distributed import client, cluster, write_store  # noqa: F401  (the real LocalCluster fixtures)
from tests.test_probit import chain_coords


@pytest.fixture(scope="module")
def tiny():
    return make_toy_bags(n_bags=16)


def test_gibbs_and_variational_agree_on_a_tiny_problem(tiny):
    """Mean-field q(v)q(m) vs the exact posterior, same model (the chain's zero prior mean), kernel and inducing points (a fixed kernel:
    kernel=None would choose a variance and an early stop for the variational fit only): the latent posterior
    means at the training instances agree to a fraction of their spread."""
    X, bags, y, _ = tiny
    variational = VGPMILPR(n_inducing=6, kernel=RBF(1.0), max_iter=300, tol=1e-10, prior_mean=0.0, random_state=0).fit(X, bags, y)
    gibbs = VGPMILPRGibbs(n_inducing=6, kernel=RBF(1.0), n_samples=2000, burn_in=300, thin=1, random_state=0).fit(X, bags, y)
    np.testing.assert_array_equal(gibbs.gp_.Z, variational.gp_.Z)
    f_vi, _ = variational.predict_latent(X)
    f_gibbs, _ = gibbs.predict_latent(X)
    assert np.corrcoef(f_vi, f_gibbs)[0, 1] > 0.98
    assert np.abs(f_vi - f_gibbs).max() < 0.35 * f_gibbs.std()
    # the sampled m respect the MIL constraint on average: negative bags below zero
    assert np.all(gibbs.m_mean_[y == 0] < 0)


def test_gibbs_with_coupling_prefers_the_mean_field_moments(tiny):
    X, bags, y, _ = tiny
    coords = chain_coords(bags)
    gibbs = VGPMILPRGibbs(lam=1.0, n_inducing=6, kernel=RBF(1.0), n_samples=2000, burn_in=300, thin=1, random_state=0).fit(X, bags, y, coords=coords)
    f_gibbs, _ = gibbs.predict_latent(X)
    errors = {}
    for moments in ("diagonal", "mean_field"):
        model = VGPMILPRI(lam=1.0, moments=moments, n_inducing=6, kernel=RBF(1.0), max_iter=300, tol=1e-10, prior_mean=0.0, random_state=0)
        f, _ = model.fit(X, bags, y, coords=coords).predict_latent(X)
        errors[moments] = np.abs(f - f_gibbs).max()
    assert errors["mean_field"] < errors["diagonal"]


def test_gibbs_is_seeded_and_validates_its_parameters(tiny):
    X, bags, y, _ = tiny
    a = VGPMILPRGibbs(n_inducing=4, kernel=RBF(4.0), n_samples=20, burn_in=5, thin=1, random_state=3).fit(X, bags, y)
    b = VGPMILPRGibbs(n_inducing=4, kernel=RBF(4.0), n_samples=20, burn_in=5, thin=1, random_state=3).fit(X, bags, y)
    np.testing.assert_array_equal(a.v_samples_, b.v_samples_)
    assert a.v_samples_.shape == (20, 4)
    other = VGPMILPRGibbs(n_inducing=4, kernel=RBF(4.0), n_samples=20, burn_in=5, thin=1, random_state=4).fit(X, bags, y)
    assert not np.any(np.isclose(other.v_samples_, a.v_samples_))
    with pytest.raises(ValueError, match="thin"):
        VGPMILPRGibbs(n_inducing=4, thin=0).fit(X, bags, y)


# ------------------------------------------------------------------ keyed draws: the chain on the cluster

CHAIN = dict(n_inducing=6, kernel=RBF(4.0), standardize=False, n_samples=15, burn_in=5, thin=1, random_state=0)  # the features as given


def chain_store(tmp_path, unlabelled=()):
    X, bags, y, _ = make_toy_bags(n_bags=16, seed=2)
    X = X.astype(np.float32).astype(np.float64)  # the store keeps float32 features
    path = write_store(tmp_path / "gibbs.zarr", X, bags, y, unlabelled=unlabelled)
    return path, X, bags, y, chain_coords(bags)  # the store's coords: each instance's index in its bag


def assert_same_chain(distributed, serial):
    np.testing.assert_array_equal(distributed.gp_.Z, serial.gp_.Z)
    assert distributed.v_samples_.shape == serial.v_samples_.shape == (serial.n_samples, serial.n_inducing)
    np.testing.assert_allclose(distributed.v_samples_, serial.v_samples_, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(distributed.objective_, serial.objective_, rtol=1e-9)
    np.testing.assert_allclose(distributed.q_.cov, serial.q_.cov, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize(("mode", "lam"), [("persist", 0.0), ("stream", 0.5)])
def test_the_chain_on_the_cluster_draws_the_serial_chain(tmp_path, client, mode, lam):
    """Partitions of whole bags on two worker processes, unlabelled bags in the store between them: the
    keyed draws give the serial samples to round-off, and the cluster's predictions are the model's."""
    from tasks.training import fit_cohort, predict_cohort, read_predictions

    unlabelled = {1, 6}
    path, X, bags, y, coords = chain_store(tmp_path, unlabelled)
    labelled = ~np.isin(bags, list(unlabelled))
    serial = VGPMILPRGibbs(lam=lam, **CHAIN).fit(X[labelled], bags[labelled], y[labelled], coords=coords[labelled])
    model = VGPMILPRGibbs(lam=lam, **CHAIN)
    summary = fit_cohort(model, path, client, partition_bytes=400, mode=mode, resume=False)
    assert summary.n_partitions > 3 and summary.mode == mode and summary.n_iter == 20
    assert_same_chain(model, serial)
    predict_cohort(model, path, client, run="gibbs", partition_bytes=400)
    out = read_predictions(path, "gibbs")
    # coupled bags' exact orthant probabilities come from SciPy's randomised Genz integration (~1e-6 scatter)
    np.testing.assert_allclose(out["bags/proba"], serial.predict_bag_proba(X, bags, coords=coords)[1], rtol=1e-5 if lam else 1e-10)


def test_an_interrupted_chain_resumes_where_it_stopped(tmp_path, client):
    """The checkpoint holds the chain's state (v, sweep, kept samples; each partition's m): a resumed run
    draws the sweeps the interrupted one did not, with the same keys."""
    from tasks.training import fit_cohort

    path, X, bags, y, coords = chain_store(tmp_path)
    serial = VGPMILPRGibbs(**CHAIN).fit(X, bags, y, coords=coords)

    class Stop(Exception):
        pass

    def die(iteration, objective):
        if iteration == 11:
            raise Stop

    with pytest.raises(Stop):
        fit_cohort(VGPMILPRGibbs(**CHAIN), path, client, run="chain", partition_bytes=400, checkpoint_every=4, on_iteration=die)
    resumed = VGPMILPRGibbs(**CHAIN)
    summary = fit_cohort(resumed, path, client, run="chain", partition_bytes=400, checkpoint_every=4)
    assert summary.resumed_from == 8
    assert_same_chain(resumed, serial)


def test_draws_are_keyed_by_seed_sweep_and_bag():
    """What the equality above rests on: a bag's uniforms depend on (seed, sweep, bag) only, and different
    keys give different (independent-looking) streams."""
    from mil_core.models.gibbs import _uniforms

    sizes = np.array([3, 5, 2])
    whole, per_bag = _uniforms(7, 4, np.arange(3), sizes)
    parts = [_uniforms(7, 4, np.array([0, 1]), sizes[:2]), _uniforms(7, 4, np.array([2]), sizes[2:])]
    np.testing.assert_array_equal(np.r_[parts[0][0], parts[1][0]], whole)
    np.testing.assert_array_equal(np.r_[parts[0][1], parts[1][1]], per_bag)
    assert np.all((whole > 0) & (whole < 1)) and np.all((per_bag > 0) & (per_bag < 1))
    for other in (_uniforms(8, 4, np.arange(3), sizes), _uniforms(7, 5, np.arange(3), sizes), _uniforms(7, 4, np.array([1, 0, 2]), sizes)):
        assert not np.any(np.isclose(other[0][:3], whole[:3]))


def test_a_bag_without_neighbours_is_drawn_whole_from_its_exact_conditional():
    """The block draw of ``m_b | v, y_b`` against rejection sampling from ``N(μ_b, I)`` given "not all
    negative"; a negative bag stays below zero; a bag whose instances are all far below zero still draws
    its first non-negative instance by the right odds (log space)."""
    from scipy.special import log_ndtr

    from mil_core.models.gibbs import _uncoupled_bag_draws

    rng = np.random.default_rng(0)
    mu, n = np.array([-1.0, 0.3, -2.0]), 100_000
    m = _uncoupled_bag_draws(np.tile(mu, n), np.arange(0, 3 * n + 1, 3), np.ones(n, bool), rng.random(3 * n), rng.random(n)).reshape(n, 3)
    z = rng.normal(mu, 1.0, (4 * n, 3))
    z = z[(z >= 0).any(axis=1)]
    np.testing.assert_allclose((m >= 0).mean(axis=0), (z >= 0).mean(axis=0), atol=0.006)
    np.testing.assert_allclose(m.mean(axis=0), z.mean(axis=0), atol=0.015)
    np.testing.assert_allclose(m.std(axis=0), z.std(axis=0), atol=0.015)
    negative = _uncoupled_bag_draws(np.array([2.0, 5.0]), np.array([0, 2]), np.array([False]), np.array([0.3, 0.9]), np.array([0.5]))
    assert np.all(negative < 0)
    far = np.array([-8.0, -8.5, -7.9])  # P(J = j) ∝ Φ(μ_j) Π_{i<j} Φ(−μ_i) ≈ Φ(μ_j)
    m = _uncoupled_bag_draws(np.tile(far, n), np.arange(0, 3 * n + 1, 3), np.ones(n, bool), rng.random(3 * n), rng.random(n)).reshape(n, 3)
    odds = np.exp(log_ndtr(far) - np.logaddexp.reduce(log_ndtr(far)))
    np.testing.assert_allclose((m >= 0).mean(axis=0), odds, atol=0.006)
    assert np.all((m >= 0).sum(axis=1) >= 1)


def test_kernel_none_takes_the_variational_models_choice_of_kernel(tiny):
    """``kernel=None``: the sampler's prior is the one the variational fit of the same model chooses on the
    training bags (a λ = 0 chain needs no coords for it), by the same bag rule."""
    X, bags, y, _ = tiny
    gibbs = VGPMILPRGibbs(n_inducing=6, n_samples=5, burn_in=0, thin=1, bag_rule="orthant", random_state=0).fit(X, bags, y)
    variational = VGPMILPR(n_inducing=6, bag_rule="orthant", prior_mean=0.0, random_state=0).fit(X, bags, y)  # the chain's zero mean
    assert gibbs.kernel_selection_.shape == (4, 2) and gibbs.auto_max_iter_ is None  # the chain runs all its sweeps
    np.testing.assert_array_equal(gibbs.kernel_selection_, variational.kernel_selection_)
    assert gibbs.kernel_ == variational.kernel_
    assert gibbs.n_iter_ == 5
