"""The Gibbs sampler (seed 003 §2) as the gold standard for the variational probit models."""

import numpy as np
import pytest

from mil_core import RBF, VGPMILPR, VGPMILPRGibbs, VGPMILPRI
from tests.conftest import make_toy_bags
from tests.test_probit import chain_coords


@pytest.fixture(scope="module")
def tiny():
    return make_toy_bags(n_bags=16)


def test_gibbs_and_variational_agree_on_a_tiny_problem(tiny):
    """Mean-field q(v)q(m) vs the exact posterior, same kernel and inducing points (a fixed kernel:
    kernel=None would choose a variance and an early stop for the variational fit only): the latent posterior
    means at the training instances agree to a fraction of their spread."""
    X, bags, y, _ = tiny
    variational = VGPMILPR(n_inducing=6, kernel=RBF(1.0), max_iter=300, tol=1e-10, random_state=0).fit(X, bags, y)
    gibbs = VGPMILPRGibbs(n_inducing=6, kernel=RBF(1.0), n_samples=2000, burn_in=300, random_state=0).fit(X, bags, y)
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
    gibbs = VGPMILPRGibbs(lam=1.0, n_inducing=6, kernel=RBF(1.0), n_samples=2000, burn_in=300, random_state=0).fit(X, bags, y, coords=coords)
    f_gibbs, _ = gibbs.predict_latent(X)
    errors = {}
    for moments in ("diagonal", "mean_field"):
        model = VGPMILPRI(lam=1.0, moments=moments, n_inducing=6, kernel=RBF(1.0), max_iter=300, tol=1e-10, random_state=0)
        f, _ = model.fit(X, bags, y, coords=coords).predict_latent(X)
        errors[moments] = np.abs(f - f_gibbs).max()
    assert errors["mean_field"] < errors["diagonal"]


def test_gibbs_is_seeded_and_validates_its_parameters(tiny):
    X, bags, y, _ = tiny
    a = VGPMILPRGibbs(n_inducing=4, n_samples=20, burn_in=5, random_state=3).fit(X, bags, y)
    b = VGPMILPRGibbs(n_inducing=4, n_samples=20, burn_in=5, random_state=3).fit(X, bags, y)
    np.testing.assert_array_equal(a.v_samples_, b.v_samples_)
    assert a.v_samples_.shape == (20, 4)
    with pytest.raises(ValueError, match="thin"):
        VGPMILPRGibbs(n_inducing=4, thin=0).fit(X, bags, y)
