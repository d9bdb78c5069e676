"""Learning the Ising strength λ of VGPMIL-PR-I (mil_core.models.ising_hyper): by the CAR likelihood of
the latent field (``lam_objective="field"``) and by the ELBO (``"bound"``), for the paper's coupling
(``coupling_form="ising"``) and the smoother form (``"smoother"``)."""

import numpy as np
import pytest
import scipy.optimize
from scipy.linalg import null_space
from scipy.stats import multivariate_normal
from sklearn.base import clone

from mil_core import RBF, VGPMILPR, VGPMILPRI
from mil_core.engine import BagBlock, GaussianQ, SerialExecutor, SparseGP
from mil_core.ising import laplacian, neighbour_edges
from mil_core.models.ising_hyper import LAM_MAX, LAM_MIN, FieldStats, IsingLamUpdates, LamProbe, select_lam_by_validation
from mil_core.models.probit_updates import ProbitLocal, ProbitMILUpdates


def _grid_coords(side):
    r, c = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    return np.column_stack([r.ravel(), c.ravel()])


def _grid_bags(n_bags=8, side=5, n_pos=5, seed=0, layout="compact", shift=2.0):
    """side×side tile bags; every other bag positive with n_pos lesion tiles, either one compact
    lesion (the tiles nearest a random centre) or scattered at random."""
    rng = np.random.default_rng(seed)
    coords = _grid_coords(side)
    X, h = [], []
    for b in range(n_bags):
        lesion = np.zeros(side * side, dtype=bool)
        if b % 2 and layout == "compact":
            lesion[np.argsort(np.hypot(*(coords - rng.uniform(0, side - 1, 2)).T))[:n_pos]] = True
        elif b % 2:
            lesion[rng.choice(side * side, n_pos, replace=False)] = True
        x = rng.normal(size=(side * side, 2))
        x[:, 0] += shift * lesion
        X.append(x), h.append(lesion)
    bags = np.repeat(np.arange(n_bags), side * side)
    return np.concatenate(X), bags, bags % 2, np.concatenate(h).astype(int), np.tile(coords, (n_bags, 1))


FORMS = ("ising", "smoother")
OBJECTIVES = ("field", "bound")


def _grid_laplacian(side):
    return laplacian(neighbour_edges(_grid_coords(side), np.array([0, side * side])), side * side).toarray()


def _setup(cuts, form="ising", objective="bound"):
    X, bags, y, _, coords = _grid_bags()
    n = 25
    rng = np.random.default_rng(1)
    gp = SparseGP.build(RBF(1.0, 1.2), X[rng.choice(X.shape[0], 8, replace=False)])
    updates = IsingLamUpdates(ProbitMILUpdates(gp=gp, lam=0.7, coupling_form=form), objective=objective)
    blocks = [BagBlock(X[a * n : b * n], np.arange(0, (b - a) * n + 1, n), y[a * n : b * n : n], coords[a * n : b * n])
              for a, b in zip(cuts[:-1], cuts[1:])]
    executor = SerialExecutor(updates, blocks)
    state = updates.init_global()
    for _ in range(3):
        state, _ = updates.global_update(executor.sweep(state), state)
    q = GaussianQ(state.q.mean + 0.3 * rng.normal(size=8), state.q.cov)
    return updates, executor, q


def test_field_objective_is_the_profiled_car_likelihood_of_the_bag_contrasts():
    """ℓ(λ) from the spectral sums equals the Gaussian density of each bag's contrasts (the field
    projected off the constant) under τ⁻¹(I + λC)⁻¹, at the profiled τ, computed densely."""
    rng = np.random.default_rng(0)
    C = _grid_laplacian(4)
    d, U = np.linalg.eigh(C)
    fields = [rng.normal(size=16) + 3.0 * rng.normal() for _ in range(3)]
    K = null_space(np.ones((1, 16)))  # orthonormal contrasts
    for lam in (0.0, 0.4, 5.0):
        stats = [FieldStats.from_spectrum(U.T @ z, np.clip(d, 0, None), lam) for z in fields]
        total = sum(stats[1:], stats[0])
        assert total.n_modes == 3 * 15
        np.testing.assert_allclose(total.roughness, sum(z @ C @ z for z in fields), rtol=1e-10)
        tau = total.n_modes / (total.spread + lam * total.roughness)
        cov = K.T @ np.linalg.solve(np.eye(16) + lam * C, K) / tau
        dense = sum(multivariate_normal(np.zeros(15), cov).logpdf(K.T @ z) for z in fields)
        np.testing.assert_allclose(total.value_and_grad(lam)[0], dense, rtol=1e-10)


@pytest.mark.parametrize("lam_true", [0.3, 3.0])
def test_field_objective_recovers_the_strength_of_a_car_field(lam_true):
    """Fields drawn from N(c_b, τ⁻¹(I + λC)⁻¹) with a random level per bag: the maximiser of ℓ is
    close to the λ they were drawn with, and a white field gives λ ≈ 0."""
    rng = np.random.default_rng(1)
    C = _grid_laplacian(10)
    d, U = np.linalg.eigh(C)
    d = np.clip(d, 0, None)

    def estimate(lam):
        factor = np.linalg.cholesky(np.eye(100) + lam * C)
        coefficients = [U.T @ (2.0 * np.linalg.solve(factor.T, rng.normal(size=100)) + 5.0 * rng.normal()) for _ in range(30)]

        def negative(x):
            stats = [FieldStats.from_spectrum(w, d, np.exp(x[0])) for w in coefficients]
            value, grad = sum(stats[1:], stats[0]).value_and_grad(np.exp(x[0]))
            return -value, np.array([-grad])

        result = scipy.optimize.minimize(negative, [0.0], jac=True, method="L-BFGS-B", bounds=[(np.log(LAM_MIN), np.log(LAM_MAX))])
        return float(np.exp(result.x[0]))

    assert abs(np.log(estimate(lam_true) / lam_true)) < np.log(1.3)
    assert estimate(0.0) < 0.05


def test_constant_field_carries_no_information_on_lambda():
    stats = FieldStats.from_spectrum(np.zeros(16), np.linspace(0.0, 6.0, 16), 1.0)
    assert stats.value_and_grad(1.0) == (-np.inf, 0.0)


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("lam", [0.05, 0.7, 6.0])
def test_lam_gradient_matches_central_differences(lam, form, objective):
    updates, executor, q = _setup([0, 8], form, objective)
    _, grad = updates.evaluate(executor.sweep, q, np.log(lam))
    step = 1e-5
    numeric = (updates.evaluate(executor.sweep, q, np.log(lam) + step)[0] - updates.evaluate(executor.sweep, q, np.log(lam) - step)[0]) / (2 * step)
    np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("form", FORMS)
def test_lam_objective_is_the_tracked_elbo_data_term(form):
    """J(λ) equals the data part of the ELBO the fit tracks (ProbitMILUpdates) at the same λ and q."""
    updates, executor, q = _setup([0, 8], form)
    for lam in (0.3, 2.0):
        inner = ProbitMILUpdates(gp=updates.inner.gp, lam=lam, coupling_form=form)
        expected = sum(inner.partition_step(inner.prepare(b.block), ProbitLocal(warm=np.zeros(b.offsets[-1])), q)[0].elbo for b in executor.blocks)
        np.testing.assert_allclose(updates.evaluate(executor.sweep, q, np.log(lam))[0], expected, rtol=1e-10)


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("form", FORMS)
def test_one_block_equals_many_blocks(form, objective):
    one, ex_one, q = _setup([0, 8], form, objective)
    many, ex_many, _ = _setup([0, 3, 5, 8], form, objective)
    a, b = ex_one.sweep(LamProbe(q, 1.3)), ex_many.sweep(LamProbe(q, 1.3))
    np.testing.assert_allclose(a.value_and_grad(1.3), b.value_and_grad(1.3), rtol=1e-10)


@pytest.mark.parametrize("form", FORMS)
def test_changing_lambda_rebuilds_the_partition_from_its_spectra_exactly(form):
    """The learnt-λ fit rebuilds the inner partition from the Laplacian's spectra (no whitening or
    Cholesky); it must equal the inner model's own prepare at that λ."""
    updates, executor, _ = _setup([0, 3, 8], form)
    for block in executor.blocks:
        for lam in (0.2, 4.0):
            fast = updates.inner_bags(block, lam)
            slow = ProbitMILUpdates(gp=updates.inner.gp, lam=lam, coupling_form=form).prepare(block.block)
            for name in ("gram", "marginal_var", "logdet_precision", "mean_field_gap"):
                np.testing.assert_allclose(getattr(fast, name), getattr(slow, name), rtol=1e-9, atol=1e-12, err_msg=name)
            np.testing.assert_allclose(fast.fitc_trace, slow.fitc_trace, rtol=1e-10)
            assert (fast.coupling.precision != slow.coupling.precision).nnz == 0


def test_smoother_form_is_vgpmil_pr_at_lambda_zero_and_an_exact_monotone_bound():
    """m_b | f_b ~ N(Σ_b f_b, I): λ → 0 is VGPMIL-PR; q(m) is exact, so the ELBO never decreases."""
    X, bags, y, _, coords = _grid_bags()
    plain = VGPMILPR(n_inducing=8, kernel=RBF(1.0), max_iter=20, random_state=0).fit(X, bags, y)
    for lam in (0.0, 1e-9):
        model = VGPMILPRI(lam=lam, coupling_form="smoother", n_inducing=8, kernel=RBF(1.0), max_iter=20, random_state=0).fit(X, bags, y, coords=coords)
        np.testing.assert_allclose(model.q_.mean, plain.q_.mean, atol=1e-6)
        np.testing.assert_allclose(model.elbo_, plain.elbo_, atol=1e-5)
    coupled = VGPMILPRI(lam=2.0, coupling_form="smoother", n_inducing=8, max_iter=30, tol=0.0, random_state=0).fit(X, bags, y, coords=coords)
    assert np.all(np.diff(coupled.elbo_) >= -1e-9 * np.abs(coupled.elbo_[1:]))
    assert not np.allclose(coupled.q_.mean, plain.q_.mean, atol=1e-3)


def test_smoother_bag_probability_monte_carlo_matches_the_exact_orthant():
    X, bags, y, _, coords = _grid_bags()
    params = dict(lam=1.0, coupling_form="smoother", n_inducing=8, kernel=RBF(1.0), max_iter=10, random_state=0, n_mc_samples=4000)
    exact = VGPMILPRI(exact_orthant_max=25, **params).fit(X, bags, y, coords=coords)
    sampled = VGPMILPRI(exact_orthant_max=0, **params).fit(X, bags, y, coords=coords)
    _, p_exact, error_exact = exact.predict_bag_proba(X, bags, coords=coords, return_orthant_error=True, rule="orthant")
    _, p_sampled, error_sampled = sampled.predict_bag_proba(X, bags, coords=coords, return_orthant_error=True, rule="orthant")
    assert np.all(error_exact == 0) and np.all(error_sampled > 0)
    assert np.all(np.abs(p_sampled - p_exact) <= 5 * error_sampled)


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("form", FORMS)
def test_fit_learns_a_positive_lambda_and_never_decreases_its_objective(form, objective):
    X, bags, y, _, coords = _grid_bags()
    model = VGPMILPRI(lam=0.5, learn_lam=True, lam_objective=objective, coupling_form=form, n_inducing=8, max_iter=15,
                      random_state=0).fit(X, bags, y, coords=coords)
    assert LAM_MIN <= model.lam_ <= LAM_MAX
    history = model.lam_history_
    assert history.shape == (model.n_iter_, 3) and np.all(history[:, 2] > 0)
    assert np.all(history[:, 1] >= history[:, 0])
    # the fitted model predicts with the learnt λ, and clone forgets it
    assert model._fitted_lam() == model.lam_
    assert not hasattr(clone(model), "lam_")


def test_field_learnt_lambda_is_larger_for_compact_than_for_scattered_lesions():
    """The answer is known here: the same features and lesion counts, one compact lesion per
    positive bag or the same number of tiles scattered at random."""
    learnt = {}
    for layout in ("compact", "scattered"):
        X, bags, y, _, coords = _grid_bags(n_bags=12, side=8, n_pos=8, layout=layout, shift=3.0)
        learnt[layout] = VGPMILPRI(lam=0.5, learn_lam=True, n_inducing=8, max_iter=15, random_state=0).fit(X, bags, y, coords=coords).lam_
    assert learnt["compact"] > 0.2 and learnt["scattered"] < 0.05


def test_fixed_lambda_reports_lam_and_bad_settings_are_rejected():
    X, bags, y, _, coords = _grid_bags()
    assert VGPMILPRI(lam=0.5, n_inducing=8, max_iter=3).fit(X, bags, y, coords=coords).lam_ == 0.5
    with pytest.raises(ValueError, match="starting value"):
        VGPMILPRI(lam=0.0, learn_lam=True, n_inducing=8, max_iter=3).fit(X, bags, y, coords=coords)
    with pytest.raises(ValueError, match="diagonal"):
        VGPMILPRI(lam=0.5, learn_lam=True, lam_objective="bound", moments="mean_field", n_inducing=8, max_iter=3).fit(X, bags, y, coords=coords)
    with pytest.raises(ValueError, match="lam_objective"):
        VGPMILPRI(lam=0.5, learn_lam=True, lam_objective="elbo", n_inducing=8, max_iter=3).fit(X, bags, y, coords=coords)
    with pytest.raises(ValueError, match="coupling_form"):
        VGPMILPRI(lam=0.5, coupling_form="car", n_inducing=8, max_iter=3).fit(X, bags, y, coords=coords)
    with pytest.raises(ValueError, match="exact_diag_max"):
        VGPMILPRI(lam=0.5, coupling_form="smoother", exact_diag_max=10, n_inducing=8, max_iter=3).fit(X, bags, y, coords=coords)


def test_validation_fallback_picks_the_grid_value_with_the_best_validation_auc():
    X, bags, y, h, coords = _grid_bags(n_bags=12)
    selection = select_lam_by_validation(VGPMILPRI(n_inducing=8, max_iter=10, random_state=0), X, bags, y, coords,
                                         grid=(0.0, 1.0), instance_labels=h, validation_fraction=0.5)
    assert selection.metric == "instance_auc" and len(selection.scores) == 2
    assert selection.lam == (0.0, 1.0)[int(np.argmax(selection.scores))]
    assert selection.estimator.lam_ == selection.lam
    from tests.emulated_device import to_emulated  # features on a device give the host selection

    on_device = select_lam_by_validation(VGPMILPRI(n_inducing=8, max_iter=10, random_state=0), to_emulated(X), bags, y,
                                         coords, grid=(0.0, 1.0), instance_labels=h, validation_fraction=0.5)
    np.testing.assert_allclose(on_device.scores, selection.scores, rtol=1e-9)
