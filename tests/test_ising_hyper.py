"""Learning the Ising strength λ of VGPMIL-PR-I by the ELBO (mil_core.ising_hyper)."""

import numpy as np
import pytest
from sklearn.base import clone

from mil_core import RBF, VGPMILPRI
from mil_core.engine import BagBlock, GaussianQ, SerialExecutor, SparseGP
from mil_core.ising_hyper import LAM_MAX, LAM_MIN, IsingLamUpdates, LamProbe, select_lam_by_validation
from mil_core.probit import ProbitMILUpdates


def _grid_bags(n_bags=8, side=5, n_pos=5, seed=0):
    """side×side tile bags; every other bag positive with a compact lesion of n_pos tiles."""
    rng = np.random.default_rng(seed)
    r, c = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    coords = np.column_stack([r.ravel(), c.ravel()])
    X, h = [], []
    for b in range(n_bags):
        lesion = np.zeros(side * side, dtype=bool)
        if b % 2:
            lesion[np.argsort(np.hypot(*(coords - rng.uniform(0, side - 1, 2)).T))[:n_pos]] = True
        x = rng.normal(size=(side * side, 2))
        x[:, 0] += 2.0 * lesion
        X.append(x), h.append(lesion)
    bags = np.repeat(np.arange(n_bags), side * side)
    return np.concatenate(X), bags, bags % 2, np.concatenate(h).astype(int), np.tile(coords, (n_bags, 1))


def _setup(cuts):
    X, bags, y, _, coords = _grid_bags()
    n = 25
    rng = np.random.default_rng(1)
    gp = SparseGP.build(RBF(1.0, 1.2), X[rng.choice(X.shape[0], 8, replace=False)])
    updates = IsingLamUpdates(ProbitMILUpdates(gp=gp, lam=0.7))
    blocks = [BagBlock(X[a * n : b * n], np.arange(0, (b - a) * n + 1, n), y[a * n : b * n : n], coords[a * n : b * n])
              for a, b in zip(cuts[:-1], cuts[1:])]
    executor = SerialExecutor(updates, blocks)
    state = updates.init_global()
    for _ in range(3):
        state, _ = updates.global_update(executor.sweep(state), state)
    q = GaussianQ(state.q.mean + 0.3 * rng.normal(size=8), state.q.cov)
    return updates, executor, q


@pytest.mark.parametrize("lam", [0.05, 0.7, 6.0])
def test_lam_gradient_matches_central_differences(lam):
    updates, executor, q = _setup([0, 8])
    _, grad = updates.evaluate(executor.sweep, q, np.log(lam))
    step = 1e-5
    numeric = (updates.evaluate(executor.sweep, q, np.log(lam) + step)[0] - updates.evaluate(executor.sweep, q, np.log(lam) - step)[0]) / (2 * step)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


def test_lam_objective_is_the_tracked_elbo_data_term():
    """J(λ) equals the data part of the ELBO the fit tracks (ProbitMILUpdates) at the same λ and q."""
    updates, executor, q = _setup([0, 8])
    for lam in (0.3, 2.0):
        inner = ProbitMILUpdates(gp=updates.inner.gp, lam=lam)
        expected = sum(inner.partition_step(inner.prepare(b.block), np.zeros(b.offsets[-1]), q)[0].elbo for b in executor.blocks)
        np.testing.assert_allclose(updates.evaluate(executor.sweep, q, np.log(lam))[0], expected, rtol=1e-10)


def test_one_block_equals_many_blocks():
    one, ex_one, q = _setup([0, 8])
    many, ex_many, _ = _setup([0, 3, 5, 8])
    a, b = ex_one.sweep(LamProbe(q, 1.3)), ex_many.sweep(LamProbe(q, 1.3))
    np.testing.assert_allclose([a.value, a.grad], [b.value, b.grad], rtol=1e-10)


def test_fit_learns_a_positive_lambda_and_never_decreases_the_bound():
    X, bags, y, _, coords = _grid_bags()
    model = VGPMILPRI(lam=0.5, learn_lam=True, n_inducing=8, max_iter=15, random_state=0).fit(X, bags, y, coords=coords)
    assert LAM_MIN <= model.lam_ <= LAM_MAX
    history = model.lam_history_
    assert history.shape == (model.n_iter_, 3) and np.all(history[:, 2] > 0)
    assert np.all(history[:, 1] >= history[:, 0])
    # the fitted model predicts with the learnt λ, and clone forgets it
    assert model._coupling(np.array([0, 25]), coords[:25]).lam == model.lam_
    assert not hasattr(clone(model), "lam_")


def test_fixed_lambda_reports_lam_and_bad_settings_are_rejected():
    X, bags, y, _, coords = _grid_bags()
    assert VGPMILPRI(lam=0.5, n_inducing=8, max_iter=3).fit(X, bags, y, coords=coords).lam_ == 0.5
    with pytest.raises(ValueError, match="starting value"):
        VGPMILPRI(lam=0.0, learn_lam=True, n_inducing=8, max_iter=3).fit(X, bags, y, coords=coords)
    with pytest.raises(ValueError, match="diagonal"):
        VGPMILPRI(lam=0.5, learn_lam=True, moments="mean_field", n_inducing=8, max_iter=3).fit(X, bags, y, coords=coords)


def test_validation_fallback_picks_the_grid_value_with_the_best_validation_auc():
    X, bags, y, h, coords = _grid_bags(n_bags=12)
    selection = select_lam_by_validation(VGPMILPRI(n_inducing=8, max_iter=10, random_state=0), X, bags, y, coords,
                                         grid=(0.0, 1.0), instance_labels=h, validation_fraction=0.5)
    assert selection.metric == "instance_auc" and len(selection.scores) == 2
    assert selection.lam == (0.0, 1.0)[int(np.argmax(selection.scores))]
    assert selection.estimator.lam_ == selection.lam
