"""VGPMIL-PR and VGPMIL-PR-I as estimators (seed 002 Sec. 2.2–2.5, Algorithm 1)."""

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.metrics import roc_auc_score

from mil_core import RBF, VGPMIL, VGPMILPR, VGPMILPRI
from mil_core.engine import BagBlock, SerialExecutor, optimise
from tests.conftest import make_toy_bags


def chain_coords(bags):
    """Instances of each bag on a chain 0, 1, 2, … in their input order."""
    coords = np.empty(bags.shape[0], dtype=np.int64)
    for b in np.unique(bags):
        coords[bags == b] = np.arange(np.sum(bags == b))
    return coords


def test_vgpmil_pr_learns_instance_labels_from_bag_labels(toy_bags):
    X, bags, y, instance_labels = toy_bags
    model = VGPMILPR(n_inducing=10, max_iter=100, random_state=0).fit(X, bags, y)
    assert roc_auc_score(instance_labels, model.predict_instance_proba(X)) > 0.9
    keys, p = model.predict_bag_proba(X, bags)
    assert roc_auc_score([y[bags == k][0] for k in keys], p) > 0.95


def test_elbo_of_vgpmil_pr_never_decreases(toy_bags):
    """λ = 0: both updates and the learnt prior mean's steps are exact coordinate ascent on the ELBO, from the
    state after the bag-label start on (``elbo_[2]``: sweep 1 scores the prior, b is learnt on it, sweep 2 starts)."""
    X, bags, y, _ = toy_bags
    model = VGPMILPR(n_inducing=10, kernel=RBF(4.0), max_iter=60, tol=0.0, random_state=0).fit(X, bags, y)
    assert model.q_.prior_mean < -0.5  # learnt: rare witnesses
    assert np.all(np.diff(model.elbo_[2:]) >= -1e-9 * np.abs(model.elbo_[3:]))


def test_lambda_zero_reproduces_vgpmil_pr_exactly(toy_bags):
    X, bags, y, _ = toy_bags
    coords = chain_coords(bags)
    reference = VGPMILPR(n_inducing=10, kernel=RBF(1.0), max_iter=30, tol=0.0, random_state=0).fit(X, bags, y)
    for moments in ("diagonal", "mean_field"):
        zero = VGPMILPRI(lam=0.0, moments=moments, n_inducing=10, kernel=RBF(1.0), max_iter=30, tol=0.0, random_state=0)
        zero.fit(X, bags, y, coords=coords)
        np.testing.assert_array_equal(zero.q_.mean, reference.q_.mean)
        np.testing.assert_array_equal(zero.elbo_, reference.elbo_)
    tiny = VGPMILPRI(lam=1e-9, n_inducing=10, kernel=RBF(1.0), max_iter=30, tol=0.0, random_state=0).fit(X, bags, y, coords=coords)
    np.testing.assert_allclose(tiny.q_.mean, reference.q_.mean, atol=1e-6)


@pytest.mark.parametrize("moments", ["diagonal", "mean_field"])
def test_one_block_and_many_blocks_give_the_same_fit(toy_bags, moments):
    X, bags, y, _ = toy_bags
    coords = chain_coords(bags)
    fits = [
        VGPMILPRI(lam=1.0, moments=moments, n_inducing=10, kernel=RBF(1.0), max_iter=25, tol=0.0, block_size=size, random_state=0).fit(
            X, bags, y, coords=coords
        )
        for size in (1, 17, 10**6)
    ]
    for other in fits[1:]:
        np.testing.assert_allclose(other.q_.mean, fits[0].q_.mean, rtol=1e-10, atol=1e-10)
        np.testing.assert_allclose(other.elbo_, fits[0].elbo_, rtol=1e-10)


def test_updates_run_under_the_engine_protocol_with_grid_coords():
    """The partition-step protocol as a Dask executor would drive it: blocks carrying 2-D coords."""
    rng = np.random.default_rng(0)
    blocks, X_all = [], []
    for b in range(2):
        coords = np.column_stack([np.repeat(np.arange(3), 3), np.tile(np.arange(3), 3)])
        X = rng.normal(size=(9, 2))
        X_all.append(X)
        blocks.append(BagBlock(X=X, offsets=np.array([0, 9]), labels=np.array([b]), coords=coords))
    model = VGPMILPRI(lam=0.5, n_inducing=4, random_state=0)
    updates = model._start_fit(np.concatenate(X_all), np.repeat([0, 1], 9))
    executor = SerialExecutor(updates, blocks)
    trace = optimise(executor.sweep, updates, updates.init_global(), max_iter=5, tol=0.0)
    assert trace.n_iter == 5 and np.all(np.isfinite(trace.objective))


def test_coupling_smooths_instance_predictions_in_context(toy_bags):
    X, bags, y, _ = toy_bags
    coords = chain_coords(bags)
    model = VGPMILPRI(lam=1.0, n_inducing=10, kernel=RBF(1.0), max_iter=50, random_state=0, n_mc_samples=200).fit(X, bags, y, coords=coords)
    keys, p, sd = model.predict_bag_proba(X, bags, coords=coords, return_std=True)
    assert roc_auc_score([y[bags == k][0] for k in keys], p) > 0.9
    assert np.all((p >= 0) & (p <= 1)) and np.all(sd >= 0)
    # without coords the bag prediction is the independent (VGPMIL-PR) formula, which differs
    _, p_independent = model.predict_bag_proba(X, bags)
    assert not np.allclose(p_independent, p, atol=1e-3)


def test_instance_predictions_in_bag_context_are_the_marginals_of_eq_24(toy_bags):
    """Eq. 24–25: m* = Σ*f* + η, f*_i ~ N(μ_i, σ_i²) independent, η ~ N(0, Σ*); rows in input order."""
    from scipy.special import ndtr

    X, bags, y, _ = toy_bags
    coords = chain_coords(bags)
    model = VGPMILPRI(lam=1.5, n_inducing=10, kernel=RBF(1.0), max_iter=20, random_state=0).fit(X, bags, y, coords=coords)
    order = np.random.default_rng(1).permutation(X.shape[0])
    p, sd = model.predict_instance_proba(X[order], bag_ids=bags[order], coords=coords[order], return_std=True)
    rng = np.random.default_rng(2)
    rows = np.flatnonzero(bags[order] == bags[order][0])
    chain = np.argsort(coords[order][rows])  # the bag's rows along its chain
    rows = rows[chain]
    mean, var = model.predict_latent(X[order][rows])
    n = rows.size
    Sigma = np.linalg.inv(np.eye(n) + 1.5 * (2 * np.eye(n) - np.eye(n, k=1) - np.eye(n, k=-1) - np.diag([1] + [0] * (n - 2) + [1])))
    f = mean + np.sqrt(var) * rng.standard_normal((200_000, n))
    smoothed = f @ Sigma
    m = smoothed + rng.multivariate_normal(np.zeros(n), Sigma, size=200_000)
    np.testing.assert_allclose(p[rows], (m > 0).mean(axis=0), atol=4e-3)
    np.testing.assert_allclose(sd[rows], ndtr(smoothed / np.sqrt(np.diag(Sigma))).std(axis=0), atol=4e-3)
    # alone, the same instances are predicted differently; λ = 0 in context is the plain prediction
    assert not np.allclose(model.predict_instance_proba(X[order])[rows], p[rows], atol=1e-3)
    plain = VGPMILPR(n_inducing=10, max_iter=20, random_state=0).fit(X, bags, y)
    in_context = VGPMILPRI(lam=0.0, n_inducing=10, max_iter=20, random_state=0).fit(X, bags, y, coords=coords)
    np.testing.assert_allclose(in_context.predict_instance_proba(X, bag_ids=bags, coords=coords), plain.predict_instance_proba(X), atol=1e-12)
    with pytest.raises(ValueError, match="both bag_ids and coords"):
        model.predict_instance_proba(X, bag_ids=bags)


def test_large_bags_use_monte_carlo_variances_close_to_the_exact_ones():
    rng = np.random.default_rng(0)
    side, n_bags = 12, 4
    grid = np.array([(r, c) for r in range(side) for c in range(side)])
    X = rng.normal(size=(n_bags * side * side, 3))
    bags, coords = np.repeat(np.arange(n_bags), side * side), np.tile(grid, (n_bags, 1))
    y = np.repeat(np.arange(n_bags) % 2, side * side)
    model = VGPMILPRI(lam=1.0, n_inducing=8, max_iter=5, random_state=0, n_mc_samples=4000, prior_mean=0.0).fit(X, bags, y, coords=coords)
    exact = model.predict_instance_proba(X, bag_ids=bags, coords=coords)
    probed = clone(model).set_params(exact_diag_max=50)
    probed.__dict__.update({k: v for k, v in model.__dict__.items() if k.endswith("_")})
    np.testing.assert_allclose(probed.predict_instance_proba(X, bag_ids=bags, coords=coords), exact, atol=5e-3)


def test_instance_std_matches_monte_carlo(toy_bags):
    X, bags, y, _ = toy_bags
    model = VGPMILPR(n_inducing=10, max_iter=30, random_state=0).fit(X, bags, y)
    p, sd = model.predict_instance_proba(X[:5], return_std=True)
    mean, var = model.predict_latent(X[:5])
    from scipy.special import ndtr

    f = mean[:, None] + np.sqrt(var)[:, None] * np.random.default_rng(0).normal(size=(5, 400_000))
    np.testing.assert_allclose(p, ndtr(f).mean(axis=1), atol=2e-3)
    np.testing.assert_allclose(sd, ndtr(f).std(axis=1), atol=2e-3)


def test_validation_and_scikit_learn_conventions(toy_bags):
    X, bags, y, _ = toy_bags
    with pytest.raises(ValueError, match="needs instance coords"):
        VGPMILPRI(n_inducing=5).fit(X, bags, y)
    with pytest.raises(ValueError, match="shape"):
        VGPMILPRI(n_inducing=5).fit(X, bags, y, coords=np.zeros((X.shape[0], 3), dtype=int))
    duplicated = chain_coords(bags)
    duplicated[1] = duplicated[0]
    with pytest.raises(ValueError, match="unique within a bag"):
        VGPMILPRI(n_inducing=5).fit(X, bags, y, coords=duplicated)
    with pytest.raises(ValueError, match="does not use instance coordinates"):
        VGPMIL(n_inducing=5).fit(X, bags, y, coords=chain_coords(bags))
    with pytest.raises(ValueError, match="lam"):
        VGPMILPRI(lam=-1.0, n_inducing=5).fit(X, bags, y, coords=chain_coords(bags))
    with pytest.raises(ValueError, match="moments"):
        VGPMILPRI(moments="ep", n_inducing=5).fit(X, bags, y, coords=chain_coords(bags))
    # a tolerance no probing period reaches fitted forever; negative sizes were accepted silently
    for bad in ({"diag_tol": -1.0, "exact_diag_max": 2}, {"diag_tol": 0.0}, {"exact_diag_max": -1},
                {"exact_orthant_max": 1.5}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            VGPMILPRI(n_inducing=5, **bad).fit(X, bags, y, coords=chain_coords(bags))
    with pytest.raises(ValueError, match="prior_mean"):
        VGPMILPR(prior_mean="x", n_inducing=5).fit(X, bags, y)
    model = VGPMILPRI(lam=2.0, neighbourhood=8, n_inducing=7)
    assert clone(model).get_params() == model.get_params()


def _size_anti_predictive_bags(seed=0):
    """Negative bags large (40–60 instances), positive bags small (4–8) with one witness: the
    noisy-OR/orthant score of a negative bag grows with its many weak instances."""
    rng = np.random.default_rng(seed)
    X, bags, y = [], [], []
    for b in range(40):
        label = b % 2
        size = int(rng.integers(4, 9)) if label else int(rng.integers(40, 61))
        x = rng.normal(size=(size, 2))
        x[:label, 0] += 5.0
        X.append(x); bags += [b] * size; y += [label] * size
    return np.concatenate(X), np.array(bags), np.array(y)


def test_default_bag_rule_ranks_bags_where_the_papers_orthant_probability_follows_size():
    from scipy.stats import spearmanr

    # the paper's zero prior mean: a learnt one lowers the instance probabilities and with them the orthant
    # probability's growth with size (among the negatives here ρ = 0.14 with it)
    model = VGPMILPR(n_inducing=10, kernel=RBF(4.0), standardize=False, max_iter=50, prior_mean=0.0,
                     random_state=0).fit(*_size_anti_predictive_bags())
    X, bags, y = _size_anti_predictive_bags(seed=1)
    keys, p_default = model.predict_bag_proba(X, bags)
    _, p_orthant = model.predict_bag_proba(X, bags, rule="orthant")
    truth = np.array([y[bags == k][0] for k in keys])
    sizes = np.array([np.sum(bags == k) for k in keys])
    assert model.bag_rule_ == "top_fraction"  # "auto" with a fixed kernel
    assert roc_auc_score(truth, p_default) > 0.9
    assert roc_auc_score(truth, p_default) > roc_auc_score(truth, p_orthant) + 0.1
    negatives = truth == 0
    assert spearmanr(p_orthant[negatives], sizes[negatives])[0] > abs(spearmanr(p_default[negatives], sizes[negatives])[0]) + 0.2


def test_orthant_rule_is_eq_26_and_the_rules_score_instance_probabilities(toy_bags):
    from scipy.special import ndtr

    from mil_core.bags import bag_score
    from mil_core.models.probit import PROBIT_BAG_RULES

    X, bags, y, _ = toy_bags
    model = VGPMILPR(n_inducing=10, kernel=RBF(4.0), max_iter=20, random_state=0).fit(X, bags, y)
    keys, p_orthant = model.predict_bag_proba(X, bags, rule="orthant")
    mean, var = model.predict_latent(X)
    by_hand = np.array([1.0 - np.prod(ndtr(-mean[bags == k] / np.sqrt(1.0 + var[bags == k]))) for k in keys])  # Eq. 26, Σ* = I
    np.testing.assert_allclose(p_orthant, by_hand, rtol=1e-12)
    order = np.argsort(bags, kind="stable")
    offsets = np.r_[0, np.cumsum([np.sum(bags == k) for k in keys])]
    for rule in PROBIT_BAG_RULES[:-1]:
        np.testing.assert_allclose(model.predict_bag_proba(X, bags, rule=rule)[1],
                                   bag_score(model.predict_instance_proba(X)[order], offsets, rule), rtol=1e-12)
    with pytest.raises(ValueError, match="bag rule must be one of"):
        model.predict_bag_proba(X, bags, rule="median")
    with pytest.raises(ValueError, match="bag_rule must be 'auto' or one of"):
        clone(model).set_params(bag_rule="median").fit(X, bags, y)  # checked before the fit: validation scores bags too


def test_bag_score_std_is_the_spread_of_the_rule_over_latent_draws(toy_bags):
    from scipy.special import ndtr

    X, bags, y, _ = toy_bags
    model = VGPMILPR(n_inducing=10, kernel=RBF(4.0), max_iter=20, n_mc_samples=4000, random_state=0).fit(X, bags, y)
    keys, _, sd = model.predict_bag_proba(X, bags, rule="max", return_std=True)
    rng = np.random.default_rng(5)
    for k in keys[:3]:
        mean, var = model.predict_latent(X[bags == k])
        draws = ndtr(mean[:, None] + np.sqrt(var)[:, None] * rng.standard_normal((mean.size, 100_000))).max(axis=0)
        np.testing.assert_allclose(sd[keys == k], draws.std(), atol=0.02)
    assert np.all(sd > 0)


def test_coupled_bag_rules_use_the_in_context_instance_probabilities_in_validation_too(toy_bags):
    from mil_core.bags import bag_score

    X, bags, y, _ = toy_bags
    coords = chain_coords(bags)
    model = VGPMILPRI(lam=1.0, n_inducing=10, kernel=RBF(4.0), standardize=False, max_iter=15, bag_rule="mean", random_state=0)
    model.fit(X, bags, y, coords=coords)
    keys, p = model.predict_bag_proba(X, bags, coords=coords)
    order = np.argsort(bags, kind="stable")
    offsets = np.r_[0, np.cumsum([np.sum(bags == k) for k in keys])]
    in_context = model.predict_instance_proba(X, bag_ids=bags, coords=coords)[order]
    np.testing.assert_allclose(p, bag_score(in_context, offsets, "mean"), rtol=1e-12)
    assert not np.allclose(p, bag_score(model.predict_instance_proba(X)[order], offsets, "mean"), atol=1e-3)
    # what early stopping and the kernel choice score: the same rule on the same state
    state = model._bag_proba_from_state(model.gp_, model.q_, X[order], offsets, coords=coords[order][:, None])
    np.testing.assert_allclose(state, p, rtol=1e-12)
    context = model._held_out_context(offsets, coords=coords[order][:, None])  # the coupling built once, as they use it
    for _ in range(2):  # the second call reads the coupling's kept covariances
        np.testing.assert_array_equal(model._bag_proba_from_state(model.gp_, model.q_, X[order], offsets, **context), state)
    _, sd = model.predict_bag_proba(X, bags, coords=coords, return_std=True)[1:]
    assert np.all(np.isfinite(sd)) and np.all(sd > 0)


def test_vgpmil_pr_chooses_its_kernel_and_reads_no_coordinates(toy_bags):
    from mil_core.models.base import uses_coords

    X, bags, y, _ = toy_bags
    model = VGPMILPR(n_inducing=10, max_iter=10, random_state=0).fit(X, bags, y)
    assert model.kernel_selection_.shape == (4, 2)  # kernel=None chooses (it needs no coords)
    assert not uses_coords(model) and uses_coords(VGPMILPRI())
    with pytest.raises(ValueError, match="does not use instance coordinates"):
        VGPMILPR(n_inducing=5).fit(X, bags, y, coords=chain_coords(bags))


def test_a_coupled_bags_probes_and_draws_are_its_own_whatever_the_other_bags_of_the_call():
    """VGPMIL-PR-I probes diag(Σ* diag(σ*²) Σ*) of a bag above ``exact_diag_max`` and samples the
    orthant probability of one above ``exact_orthant_max`` with random numbers: drawn from one
    stream over the call's bags, a slide's *probability* (not only its std) changed with the bags
    predicted beside it — the pipeline's partition layout, a cohort against the slide alone."""
    X, bags, y, _ = make_toy_bags(n_bags=10, seed=4)
    coords = chain_coords(bags)
    model = VGPMILPRI(lam=0.5, n_inducing=8, kernel=RBF(4.0), max_iter=10, n_mc_samples=40, exact_diag_max=3,
                      exact_orthant_max=3, random_state=0).fit(X, bags, y, coords=coords)
    assert np.diff(np.unique(bags, return_counts=True)[1]).any() and np.unique(bags, return_counts=True)[1].max() > 3  # probed bags
    for rule in ("max", "orthant"):
        keys, p, std = model.predict_bag_proba(X, bags, coords=coords, return_std=True, rule=rule)
        instance = model.predict_instance_proba(X, bag_ids=bags, coords=coords, return_std=True)
        for part in (keys[:3], keys[3:7], keys[-1:]):
            rows = np.isin(bags, part)
            _, p_part, std_part = model.predict_bag_proba(X[rows], bags[rows], coords=coords[rows], return_std=True, rule=rule)
            np.testing.assert_allclose(p_part, p[np.isin(keys, part)], rtol=1e-12, err_msg=rule)
            np.testing.assert_allclose(std_part, std[np.isin(keys, part)], rtol=1e-12, err_msg=rule)
            for alone, together in zip(model.predict_instance_proba(X[rows], bag_ids=bags[rows], coords=coords[rows], return_std=True), instance):
                np.testing.assert_allclose(alone, together[rows], rtol=1e-12)
