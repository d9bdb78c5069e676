"""AbSMIL (seed 004, Sec. III–IV): the forward–backward E-step, the gradient of Eq. 8, the
cardinality constraint, the two solvers and the estimator's predictions."""

import itertools

import numpy as np
import pytest
from scipy.special import log_softmax
from sklearn.base import clone

from mil_core import AbSMIL
from mil_core.models.absmil import AbSMILState, AbSMILUpdates, AttributeBags, count_chain, relevance_caps
from mil_core.random_features import RandomFourierFeatures


def symmetric_bags(n_bags: int = 40, seed: int = 0):
    """Positive bags hold 1–3 instances near (3, 0), negative bags 1–3 near (−3, 0); the other
    3–10 instances of every bag sit near (0, 3) (irrelevant). Returns X, bag ids, y and the
    true attribute group per instance (0 irrelevant, 1 positive, 2 negative)."""
    rng = np.random.default_rng(seed)
    X, bags, y, group = [], [], [], []
    for b in range(n_bags):
        label, n_rel = b % 2, int(rng.integers(1, 4))
        size = n_rel + int(rng.integers(3, 11))
        x = rng.normal(size=(size, 2))
        x[:n_rel, 0] += 3.0 if label else -3.0
        x[n_rel:, 1] += 3.0
        X.append(x)
        bags += [b] * size
        y += [label] * size
        group += [1 if label else 2] * n_rel + [0] * (size - n_rel)
    return np.concatenate(X), np.array(bags), np.array(y), np.array(group)


def attribute_group(z: np.ndarray, n_attributes: int) -> np.ndarray:
    return np.where(z == 0, 0, np.where(z <= n_attributes // 2, 1, 2))


def brute_force(log_p: np.ndarray, label: int, cap: int, n_attributes: int):
    """``log P(Y, T = 1 | X_b)`` and the posteriors P(z_i = c | Y, T, X_b) by enumerating
    every z_b ∈ {0 … C}^{n_b}."""
    half = n_attributes // 2
    side = set(range(1, half + 1)) if label == 1 else set(range(half + 1, n_attributes + 1))
    posterior, total = np.zeros_like(log_p), 0.0
    for z in itertools.product(range(n_attributes + 1), repeat=log_p.shape[0]):
        relevant = [c for c in z if c != 0]
        if not relevant or len(relevant) > cap or not set(relevant) <= side:
            continue
        weight = np.exp(sum(log_p[i, c] for i, c in enumerate(z)))
        total += weight
        posterior[np.arange(len(z)), z] += weight
    return np.log(total), posterior / total


def updates_for(n_attributes: int, n_max, width: int, lambda_q: float = 1e-3, lambda_e: float = 0.1) -> AbSMILUpdates:
    return AbSMILUpdates(
        n_attributes=n_attributes, n_max=n_max, lambda_q=lambda_q, lambda_e=lambda_e,
        initial_weights=np.zeros((width, n_attributes + 1)), fit_intercept=False,
    )


@pytest.mark.parametrize("n_attributes", [2, 4])
@pytest.mark.parametrize("n_max", [1, 2, None])
def test_forward_backward_equals_brute_force_enumeration(n_attributes, n_max):
    rng = np.random.default_rng(n_attributes + 10 * (n_max or 0))
    sizes = np.array([1, 2, 3, 4, 3])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    log_p = log_softmax(2.0 * rng.normal(size=(offsets[-1], n_attributes + 1)), axis=1)
    updates = updates_for(n_attributes, n_max, width=1)
    caps = relevance_caps(sizes, n_max)
    for labels in (np.array([1, 0, 1, 0, 1]), np.array([0, 1, 0, 1, 0])):
        posterior, log_lik = updates.attribute_posteriors(log_p, AttributeBags(None, offsets, labels, caps), labels)
        for b, (start, stop) in enumerate(zip(offsets[:-1], offsets[1:])):
            expected_lik, expected_post = brute_force(log_p[start:stop], labels[b], n_max or sizes[b], n_attributes)
            assert log_lik[b] == pytest.approx(expected_lik, abs=1e-12)
            np.testing.assert_allclose(posterior[start:stop], expected_post, atol=1e-12)


def test_bag_probability_uses_both_sides_of_the_chain():
    """P(Y = m, T = 1 | X_b) from the forward messages (Sec. IV-D) equals enumeration for m = 0, 1."""
    rng = np.random.default_rng(3)
    offsets = np.array([0, 3, 7])
    log_p = log_softmax(rng.normal(size=(7, 5)), axis=1)
    updates = updates_for(4, 2, width=1)
    for m in (0, 1):
        log_lik, _, _ = count_chain(log_p[:, 0], updates.side_log_proba(log_p, bool(m)), offsets, relevance_caps(np.diff(offsets), 2), posteriors=False)
        for b in range(2):
            expected, _ = brute_force(log_p[offsets[b] : offsets[b + 1]], m, 2, 4)
            assert log_lik[b] == pytest.approx(expected, abs=1e-12)


def test_cardinality_n_max_equal_to_bag_size_is_the_unconstrained_model():
    rng = np.random.default_rng(1)
    sizes = rng.integers(1, 40, size=12)
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    log_irrelevant = np.log(rng.uniform(0.05, 1.0, size=offsets[-1]))
    log_relevant = np.log(rng.uniform(0.0, 1.0, size=offsets[-1])) + log_irrelevant
    constrained = count_chain(log_irrelevant, log_relevant, offsets, sizes.copy())
    unconstrained = count_chain(log_irrelevant, log_relevant, offsets, None)
    for a, b in zip(constrained, unconstrained):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)

    X, bags, y, _ = symmetric_bags(n_bags=16)
    fits = [AbSMIL(n_max=n_max, max_iter=25, tol=0.0, random_state=0).fit(X, bags, y) for n_max in (1.0, None)]
    np.testing.assert_allclose(fits[0].weights_, fits[1].weights_, rtol=1e-8, atol=1e-10)


def test_a_bag_of_thousands_of_instances_does_not_underflow():
    """P(Y, T) of a 3000-instance bag is ~e^{-3000}: the log-space chain stays exact."""
    rng = np.random.default_rng(2)
    n = 3000
    offsets = np.array([0, n])
    log_p = log_softmax(rng.normal(size=(n, 3)) + [0.0, -1.0, -1.0], axis=1)
    log_irrelevant, log_relevant = log_p[:, 0], log_p[:, 1]
    full, closed = count_chain(log_irrelevant, log_relevant, offsets, np.array([n])), count_chain(log_irrelevant, log_relevant, offsets, None)
    assert full[0][0] < -700.0
    np.testing.assert_allclose(full[0], closed[0], rtol=1e-12)
    np.testing.assert_allclose(np.exp(full[1]), np.exp(closed[1]), atol=1e-9)
    np.testing.assert_allclose(np.exp(full[2]), np.exp(closed[2]), atol=1e-9)

    log_lik, post0, post_rel = count_chain(log_irrelevant, log_relevant, offsets, np.array([10]))
    assert np.isfinite(log_lik[0])
    np.testing.assert_allclose(np.exp(post0) + np.exp(post_rel), 1.0, atol=1e-9)
    assert np.exp(post_rel).sum() <= 10.0 + 1e-9  # at most n_max relevant instances in expectation


def test_saturated_logits_give_finite_posteriors_in_the_closed_form():
    """Every instance almost surely irrelevant (P^side ~ e^{-800}): no 0·∞, no NaN."""
    offsets = np.array([0, 4, 5])
    log_irrelevant = np.zeros(5)
    log_relevant = np.array([-800.0, -900.0, -1000.0, -850.0, -30.0])
    log_lik, post0, post_rel = count_chain(log_irrelevant, log_relevant, offsets, None)
    assert log_lik[0] == pytest.approx(-800.0, abs=1e-9) and log_lik[1] == pytest.approx(-30.0, abs=1e-12)
    np.testing.assert_allclose(np.exp(post_rel), [1.0, 0.0, 0.0, 0.0, 1.0], atol=1e-12)
    np.testing.assert_allclose(np.exp(post0) + np.exp(post_rel), 1.0, atol=1e-12)


@pytest.mark.parametrize("n_max", [2, None])
def test_gradient_matches_finite_differences_of_the_objective(n_max):
    """Eq. 8 (Fisher's identity plus the entropy and quadratic terms) is the gradient of Eq. 3."""
    rng = np.random.default_rng(4)
    X, bags, y, _ = symmetric_bags(n_bags=6, seed=4)
    features = np.column_stack([X, np.ones(X.shape[0])])
    offsets = np.concatenate([[0], np.flatnonzero(np.diff(bags)) + 1, [X.shape[0]]])
    labels = y[offsets[:-1]]
    updates = updates_for(4, n_max, width=3, lambda_q=0.05, lambda_e=0.3)
    block = AttributeBags(features, offsets, labels, relevance_caps(np.diff(offsets), n_max))
    weights = 0.5 * rng.normal(size=(3, 5))

    def objective_and_gradient(w):
        stats, _ = updates.partition_step(block, None, AbSMILState(w))
        return updates.objective_and_gradient(stats, w)

    _, gradient = objective_and_gradient(weights)
    numeric = np.zeros_like(weights)
    h = 1e-6
    for index in np.ndindex(weights.shape):
        step = np.zeros_like(weights)
        step[index] = h
        numeric[index] = (objective_and_gradient(weights + step)[0] - objective_and_gradient(weights - step)[0]) / (2 * h)
    np.testing.assert_allclose(gradient, numeric, rtol=1e-6, atol=1e-8)


def test_batch_fit_does_not_depend_on_how_bags_are_grouped_into_blocks():
    X, bags, y, _ = symmetric_bags()
    fits = [AbSMIL(n_attributes=4, n_max=3, block_size=size, max_iter=30, tol=0.0, random_state=0).fit(X, bags, y) for size in (65536, 17)]
    np.testing.assert_allclose(fits[0].weights_, fits[1].weights_, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(fits[0].objective_, fits[1].objective_, rtol=1e-10)


def test_batch_solver_reaches_a_stationary_point():
    X, bags, y, _ = symmetric_bags()
    model = AbSMIL(n_max=3, lambda_q=1e-2, max_iter=2000, tol=1e-10, standardize=False, random_state=0).fit(X, bags, y)
    updates = model._updates()
    features = updates.features(X[np.argsort(bags, kind="stable")])
    offsets = np.concatenate([[0], np.cumsum(np.bincount(bags))])
    block = AttributeBags(features, offsets, np.array([0, 1] * 20), relevance_caps(np.diff(offsets), 3))

    def gradient_norm(w):
        stats, _ = updates.partition_step(block, None, AbSMILState(w))
        return np.linalg.norm(updates.objective_and_gradient(stats, w)[1])

    assert gradient_norm(model.weights_) < 1e-3 * gradient_norm(np.zeros_like(model.weights_))
    assert model.objective_.min() < model.objective_[0]


@pytest.mark.parametrize("solver, max_iter", [("batch", 300), ("pegasos", 20)])
def test_recovers_bag_labels_and_instance_attributes(solver, max_iter):
    X, bags, y, group = symmetric_bags()
    X_test, bags_test, y_test, group_test = symmetric_bags(seed=1)
    model = AbSMIL(n_max=3, lambda_q=1e-3, solver=solver, max_iter=max_iter, random_state=0).fit(X, bags, y)
    keys, p = model.predict_bag_proba(X_test, bags_test)
    truth = np.array([y_test[bags_test == k][0] for k in keys])
    assert np.mean((p >= 0.5) == truth) >= 0.95
    assert np.mean(attribute_group(model.predict_attributes(X_test), 2) == group_test) >= 0.9
    with_context = model.predict_attribute_proba(X_test, bags_test)
    np.testing.assert_allclose(with_context.sum(axis=1), 1.0, atol=1e-12)
    assert np.mean(attribute_group(np.argmax(with_context, axis=1), 2) == group_test) >= 0.9


def test_random_fourier_features_approximate_the_rbf_kernel():
    rng = np.random.default_rng(5)
    X = rng.normal(size=(6, 3))
    phi = RandomFourierFeatures.sample(3, 20000, scale=0.7, random_state=0)(X)
    sq = ((X[:, None, :] - X[None, :, :]) ** 2).sum(-1)
    np.testing.assert_allclose(phi @ phi.T, np.exp(-0.49 * sq / 2.0), atol=0.03)


def test_random_features_solve_a_problem_no_linear_model_can():
    """Relevant positives on a ring of radius 3, relevant negatives at the centre, irrelevant
    instances far out: the attribute classes are not linearly separable."""
    rng = np.random.default_rng(6)
    X, bags, y = [], [], []
    for b in range(60):
        label, n_rel = b % 2, int(rng.integers(1, 3))
        angles = rng.uniform(0, 2 * np.pi, size=n_rel)
        relevant = 3.0 * np.column_stack([np.cos(angles), np.sin(angles)]) if label else 0.5 * rng.normal(size=(n_rel, 2))
        irrelevant = rng.normal(size=(4, 2)) * 0.5 + [7.0, 0.0]
        X.append(np.vstack([relevant, irrelevant]))
        bags += [b] * (n_rel + 4)
        y += [label] * (n_rel + 4)
    X, bags, y = np.vstack(X), np.array(bags), np.array(y)
    accuracy = {}
    for k in (None, 100):
        model = AbSMIL(n_max=2, n_random_features=k, rff_scale=0.7, lambda_q=1e-4, max_iter=400, random_state=0).fit(X, bags, y)
        keys, p = model.predict_bag_proba(X, bags)
        accuracy[k] = np.mean((p >= 0.5) == (keys % 2))
    assert accuracy[100] >= 0.95 and accuracy[100] > accuracy[None]


def test_clone_and_get_params_follow_scikit_learn():
    model = AbSMIL(n_attributes=4, n_max=0.2, solver="pegasos", random_state=1)
    copy = clone(model)
    assert copy.get_params() == model.get_params()
    assert not hasattr(copy, "weights_")


@pytest.mark.parametrize(
    "params, message",
    [
        ({"n_attributes": 3}, "even integer"),
        ({"n_max": 0}, "n_max must be >= 1"),
        ({"n_max": 1.5}, "fraction in \\(0, 1\\]"),
        ({"n_max": True}, "n_max must be"),
        ({"lambda_q": 0.0}, "lambda_q must be > 0"),
        ({"lambda_e": -1.0}, "lambda_e must be >= 0"),
        ({"solver": "adam"}, "solver must be"),
        ({"batch_size": 0}, "batch_size must be"),
        ({"n_random_features": 0}, "n_random_features"),
    ],
)
def test_bad_parameters_are_rejected_with_a_message_naming_them(params, message):
    X, bags, y, _ = symmetric_bags(n_bags=4)
    with pytest.raises(ValueError, match=message):
        AbSMIL(**params).fit(X, bags, y)


def test_bad_prediction_input_is_rejected():
    X, bags, y, _ = symmetric_bags(n_bags=6)
    model = AbSMIL(max_iter=3).fit(X, bags, y)
    with pytest.raises(ValueError, match="3 features"):
        model.predict_bag_proba(np.ones((4, 3)), np.zeros(4))
    with pytest.raises(ValueError, match="point estimate"):
        model.predict_bag_proba(X, bags, return_std=True)
    with pytest.raises(ValueError, match="different bag labels"):
        AbSMIL().fit(X, bags, np.where(np.arange(X.shape[0]) == 0, 1 - y[0], y))
