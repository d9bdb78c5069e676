"""EmbeddedGPMIL and ABMIL: a small gated-attention network trained by PyTorch, GP-MIL on its embedding."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
from scipy.special import expit, logit
from sklearn.base import clone
from sklearn.metrics import roc_auc_score

from mil_core import ABMIL, RBF, VGPMIL, VWSGP, EmbeddedGPMIL
from mil_core.attention import (
    FITTED_LOSS_FRACTION,
    _single_bag_logit,
    attention_weights,
    bag_logits,
    instance_embedding,
    instance_logits,
    network_arrays,
    training_loss,
)
from mil_core.calibration import expected_calibration_error, fit_platt, reliability_bins
from mil_core.metrics import chance_auc_std
from mil_core.persist import load, save
from mil_core.validation import standardisation, standardise
from tests.conftest import bag_labels, make_toy_bags

torch = pytest.importorskip("torch", reason='PyTorch is the optional extra "torch": pip install -e ".[dev,torch]"')

NET = {"n_components": 4, "hidden": (16,), "attention_dim": 8, "learning_rate": 1e-2, "max_epochs": 15}


def small_model(**params) -> EmbeddedGPMIL:
    """The ensemble's mechanics on rows as given (``standardize=False``: the tests below rebuild its
    numbers from the networks and GPs on ``X``); the standardisation has its own tests. Its member
    GPs choose their kernel (the representation choice needs GPs that choose) but not H or the bag
    rule: those choices are VGPMIL's own (``test_defaults.py``) and took 40 % of each fit here."""
    gp = VGPMIL(n_inducing=10, max_iter=20, H=100.0, bag_rule="max")
    return EmbeddedGPMIL(gp, **(NET | {"random_state": 0, "standardize": False} | params))


def fixed_gp_model(**params) -> EmbeddedGPMIL:
    """:func:`small_model` with a fixed GP kernel, for the networks' and the ensemble's mechanics:
    the member GPs' kernel choice (tested with the defaults) made each of these fits 3–4 times slower."""
    gp = VGPMIL(kernel=RBF(variance=4.0, length_scale=1.0), n_inducing=10, max_iter=50, tol=1e-4)
    return EmbeddedGPMIL(gp, **(NET | {"random_state": 0, "standardize": False} | params))


@pytest.fixture(scope="module")
def data():
    train, test = make_toy_bags(40, seed=0), make_toy_bags(30, seed=1)
    return train, test


@pytest.fixture(scope="module")
def fitted(data):
    (X, bags, y, _), _ = data
    return small_model().fit(X, bags, y)


def test_a_bags_std_does_not_depend_on_the_bags_predicted_with_it(fitted, data):
    """The pooled std came from the member GPs' instance stds, drawn from one stream over the call:
    the same bag alone, in another cohort or partition of the pipeline, got another std (up to 5 %)."""
    _, (X, bags, _, _) = data
    keys, p, sd = fitted.predict_bag_proba(X, bags, return_std=True)
    for part in (keys[:1], keys[4:9], keys[-2:]):
        rows = np.isin(bags, part)
        _, p_part, sd_part = fitted.predict_bag_proba(X[rows], bags[rows], return_std=True)
        np.testing.assert_allclose(p_part, p[np.isin(keys, part)], rtol=1e-10)
        np.testing.assert_allclose(sd_part, sd[np.isin(keys, part)], rtol=1e-10)


def test_shapes_and_ranges(fitted, data):
    _, (X, bags, _, _) = data
    keys, p, sd = fitted.predict_bag_proba(X, bags, return_std=True)
    np.testing.assert_array_equal(keys, np.unique(bags))
    assert p.shape == sd.shape == keys.shape
    assert np.all((p >= 0) & (p <= 1)) and np.all(sd >= 0)
    p_inst, sd_inst = fitted.predict_instance_proba(X, return_std=True, method="probit")
    assert p_inst.shape == sd_inst.shape == (X.shape[0],)
    assert len(fitted.gps_) == len(fitted.network_states_) == 5
    assert fitted.transform(X).shape == (X.shape[0], 5 * NET["n_components"])
    np.testing.assert_array_equal(fitted.transform(X)[:, 4:8], fitted.member_transform(X, 1))
    # the GP's own rules are reachable too, with the GP's return convention
    assert len(fitted.predict_bag_proba(X, bags, rule="max", method="probit")) == 2


def test_held_out_bags_and_instances_are_found(fitted, data):
    _, (X, bags, y, instance_labels) = data
    keys, p = fitted.predict_bag_proba(X, bags)
    truth = np.array([y[bags == k][0] for k in keys])
    assert roc_auc_score(truth, p) > 0.9
    assert roc_auc_score(instance_labels, fitted.predict_instance_proba(X, method="probit")) > 0.9


def _per_bag(values, bags):
    return np.array([values(bags == k) for k in np.unique(bags)])


def _member_evidence(model, member, X, bags):
    """By hand, per bag: member ``member``'s network logit ℓ, attention-pooled GP probability p̄ and its std."""
    params = network_arrays(model.network_states_[member])
    p, sd = model.gps_[member].predict_instance_proba(model.member_transform(X, member), return_std=True, method="probit")

    def alpha(rows):
        return attention_weights(params, instance_embedding(params, X[rows]), np.array([0, rows.sum()]))

    logit = _per_bag(lambda rows: bag_logits(params, instance_embedding(params, X[rows]), np.array([0, rows.sum()]))[0], bags)
    pooled = _per_bag(lambda rows: np.sum(alpha(rows) * p[rows]), bags)
    pooled_sd = _per_bag(lambda rows: np.sqrt(np.sum((alpha(rows) * sd[rows]) ** 2)), bags)
    return logit, pooled, pooled_sd


def _member_score(model, member, X, bags):
    logit, pooled, _ = _member_evidence(model, member, X, bags)
    return 0.5 * (logit + np.log(pooled / (1 - pooled)))


def test_attention_rule_is_the_members_mean_of_attention_pooled_gp_probabilities(fitted, data):
    _, (X, bags, _, _) = data
    _, p, sd = fitted.predict_bag_proba(X, bags, rule="attention", return_std=True, method="probit")
    evidence = [_member_evidence(fitted, k, X, bags) for k in range(5)]
    np.testing.assert_allclose(p, np.mean([pooled for _, pooled, _ in evidence], axis=0), rtol=1e-10)
    np.testing.assert_allclose(sd, np.mean([pooled_sd for _, _, pooled_sd in evidence], axis=0), rtol=1e-10)


def _member_instance_evidence(model, member, X):
    """By hand, per row: member ``member``'s network instance logit cᵀh + c₀ and its GP's probability and std."""
    params = network_arrays(model.network_states_[member])
    H = instance_embedding(params, X)
    logit = H @ params["classifier.weight"][0] + params["classifier.bias"][0]
    p, sd = model.gps_[member].predict_instance_proba(model.member_transform(X, member), return_std=True, method="probit")
    return logit, p, sd


def test_instance_probability_is_the_mixture_of_networks_and_gps(fitted, data):
    """Default: the equal mixture of the 2K members' experts, each network's σ(ℓ_n) (no std) and
    each GP's p_n ± sd_n; std sqrt(mean(sd² + p²) − p̄²)."""
    _, (X, _, _, instance_labels) = data
    p, sd = fitted.predict_instance_proba(X, return_std=True, method="probit")
    members = [_member_instance_evidence(fitted, k, X) for k in range(5)]
    experts = [(q, s) for _, q, s in members] + [(expit(logit), np.zeros_like(logit)) for logit, _, _ in members]
    np.testing.assert_allclose(p, np.mean([q for q, _ in experts], axis=0), rtol=1e-10)
    np.testing.assert_allclose(sd**2, np.mean([s**2 + q**2 for q, s in experts], axis=0) - p**2, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(fitted.predict_instance_proba(X, method="probit"), p, rtol=1e-12)
    # the two kinds of expert disagree here, so the mixture is neither alone
    gp, network = (np.mean([q for q, _ in experts[i:i + 5]], axis=0) for i in (0, 5))
    assert np.mean(np.abs(gp - network)) > 0.01
    assert roc_auc_score(instance_labels, p) > 0.9


def test_instance_rules_gp_and_network(fitted, data):
    """``rule="gp"``: the equal mixture of the members' GP probabilities; ``rule="network"``: the
    networks' mean instance logit through σ (ABMIL's instance probability)."""
    _, (X, _, _, _) = data
    p, sd = fitted.predict_instance_proba(X, return_std=True, rule="gp", method="probit")
    members = [_member_instance_evidence(fitted, k, X) for k in range(5)]
    np.testing.assert_allclose(p, np.mean([q for _, q, _ in members], axis=0), rtol=1e-12)
    np.testing.assert_allclose(sd**2, np.mean([s**2 + q**2 for _, q, s in members], axis=0) - p**2,
                               rtol=1e-8, atol=1e-12)
    network = fitted.predict_instance_proba(X, rule="network")
    np.testing.assert_allclose(network, expit(np.mean([logit for logit, _, _ in members], axis=0)), rtol=1e-6)
    with pytest.raises(ValueError, match="no std"):
        fitted.predict_instance_proba(X, rule="network", return_std=True)
    with pytest.raises(ValueError, match="rule must be"):
        fitted.predict_instance_proba(X, rule="max")


def test_members_hold_out_a_partition_of_the_training_bags(fitted, data):
    """Cross-fitting: each training bag is held out by exactly one member, stratified."""
    (_, bags, y, _), _ = data
    labels = np.array([y[bags == k][0] for k in np.unique(bags)])
    held_out = np.concatenate(fitted.validation_bags_)
    np.testing.assert_array_equal(np.sort(held_out), np.arange(labels.size))
    for val in fitted.validation_bags_:
        assert abs(labels[val].mean() - labels.mean()) < 0.15


def test_default_rule_is_platt_on_the_members_average_calibrated_out_of_fold(fitted, data):
    (X_train, bags_train, y_train, _), (X, bags, _, _) = data
    _, p = fitted.predict_bag_proba(X, bags)
    score = np.mean([_member_score(fitted, k, X, bags) for k in range(5)], axis=0)
    np.testing.assert_allclose(p, expit(fitted.calibration_slope_ * score + fitted.calibration_intercept_), rtol=1e-10)
    # the calibration is Platt scaling of each training bag's score by the member that held it out
    train_keys = np.unique(bags_train)
    oof_scores, oof_labels = [], []
    for k, val in enumerate(fitted.validation_bags_):
        rows = np.isin(bags_train, train_keys[val])
        oof_scores.append(_member_score(fitted, k, X_train[rows], bags_train[rows]))
        oof_labels.append([y_train[bags_train == key][0] for key in train_keys[val]])
    expected = fit_platt(np.concatenate(oof_scores), np.concatenate(oof_labels))
    assert (fitted.calibration_slope_, fitted.calibration_intercept_) == pytest.approx(expected, rel=1e-6)
    assert (fitted.calibration_slope_, fitted.calibration_intercept_) != (1.0, 0.0)
    with pytest.raises(ValueError, match="closed-form"):
        fitted.predict_bag_proba(X, bags, method="mc")
    logits = np.mean([_member_evidence(fitted, k, X, bags)[0] for k in range(5)], axis=0)
    np.testing.assert_allclose(fitted.predict_bag_proba(X, bags, rule="network")[1], expit(logits), rtol=1e-10)
    with pytest.raises(ValueError, match="no std"):
        fitted.predict_bag_proba(X, bags, rule="network", return_std=True)


def _best_fitted_epoch(model, y_bags: np.ndarray) -> int:
    """The early-stopping rule from a model's traces: the best held-out AUC (ties: loss) among the
    epochs from the first whose training loss is at most FITTED_LOSS_FRACTION of H(π)."""
    aucs, losses = model.network_validation_auc_, model.network_validation_loss_
    pi = y_bags.mean()
    entropy = -(pi * np.log(pi) + (1 - pi) * np.log(1 - pi))
    first = int(np.argmax(model.network_train_loss_ <= FITTED_LOSS_FRACTION * entropy))
    assert model.network_train_loss_[first] <= FITTED_LOSS_FRACTION * entropy  # the toy networks do fit
    return max(range(first, aucs.size), key=lambda i: (aucs[i], -losses[i])) + 1


def test_members_stop_together_on_the_pooled_out_of_fold_auc(fitted, data):
    """The kept epoch is the best of the pooled held-out bags' AUC (ties: loss) once the networks
    fit their training bags, the AUC its networks give all held-out bags together."""
    (X, bags, y, _), _ = data
    aucs = fitted.network_validation_auc_
    assert fitted.network_best_epoch_ == _best_fitted_epoch(fitted, bag_labels(bags, y))
    keys = np.unique(bags)
    logits, truth = [], []
    for k, val in enumerate(fitted.validation_bags_):
        rows = np.isin(bags, keys[val])
        logits.append(_member_evidence(fitted, k, X[rows], bags[rows])[0])
        truth.append([y[bags == key][0] for key in keys[val]])
    assert roc_auc_score(np.concatenate(truth), np.concatenate(logits)) == pytest.approx(aucs[fitted.network_best_epoch_ - 1],
                                                                                            abs=0.01)


def test_each_member_gp_trains_on_its_networks_training_bags_only(fitted, data):
    (X, bags, y, _), _ = data
    keys = np.unique(bags)
    for k in (0, 4):
        rows = np.isin(bags, keys[fitted.gp_training_bags(k, keys.size)])
        assert not np.any(np.isin(bags[rows], keys[fitted.validation_bags_[k]]))
        gp = clone(fitted.gps_[k]).fit(fitted.member_transform(X[rows], k), bags[rows], y[rows])
        np.testing.assert_allclose(gp.q_.mean, fitted.gps_[k].q_.mean, rtol=1e-10, atol=1e-12)
        everything = clone(fitted.gps_[k]).fit(fitted.member_transform(X, k), bags, y)
        assert not np.allclose(everything.q_.mean, fitted.gps_[k].q_.mean)


def test_bag_std_is_the_gp_std_through_the_calibration_map(fitted, data):
    _, (X, bags, _, _) = data
    _, p, sd = fitted.predict_bag_proba(X, bags, return_std=True)
    sensitivity = np.mean([pooled_sd / (pooled * (1 - pooled))
                           for _, pooled, pooled_sd in (_member_evidence(fitted, k, X, bags) for k in range(5))], axis=0)
    delta = p * (1 - p) * 0.5 * abs(fitted.calibration_slope_) * sensitivity
    np.testing.assert_allclose(sd, np.minimum(delta, np.sqrt(p * (1 - p))), rtol=1e-8)
    assert np.all(sd > 0) and np.all(sd <= np.sqrt(p * (1 - p)))


def test_one_network_holds_out_the_validation_fraction(data):
    (X, bags, y, _), (X_test, bags_test, _, _) = data
    model = fixed_gp_model(n_networks=1).fit(X, bags, y)
    assert len(model.network_states_) == len(model.gps_) == 1 and model.validation_bags_[0].size == 8  # 20 % of 40
    np.testing.assert_allclose(model.predict_bag_proba(X_test, bags_test)[1],
                               expit(model.calibration_slope_ * _member_score(model, 0, X_test, bags_test)
                                     + model.calibration_intercept_), rtol=1e-10)


def test_members_are_capped_at_the_smaller_class(data):
    X, bags, y, _ = make_toy_bags(12, seed=3)
    labels = np.array([y[bags == k][0] for k in np.unique(bags)])
    model = fixed_gp_model(n_networks=50, max_epochs=3).fit(X, bags, y)
    assert len(model.network_states_) == np.bincount(labels).min()


def test_without_calibration_the_score_is_the_plain_average(data):
    (X, bags, y, _), (X_test, bags_test, _, _) = data
    model = fixed_gp_model(calibration=None, n_networks=2).fit(X, bags, y)
    assert (model.calibration_slope_, model.calibration_intercept_) == (1.0, 0.0)
    score = np.mean([_member_score(model, k, X_test, bags_test) for k in range(2)], axis=0)
    np.testing.assert_allclose(model.predict_bag_proba(X_test, bags_test)[1], expit(score), rtol=1e-10)
    with pytest.raises(ValueError, match="calibration must be 'platt' or None"):
        small_model(calibration="isotonic").fit(X, bags, y)


def test_without_early_stopping_and_calibration_one_network_and_its_gp_train_on_every_bag(data):
    """The documented setting that holds no bag out (its empty held-out embedding failed in scikit-learn's check)."""
    (X, bags, y, _), (X_test, bags_test, _, _) = data
    model = fixed_gp_model(early_stopping=False, calibration=None, max_epochs=3).fit(X, bags, y)
    assert len(model.network_states_) == len(model.gps_) == 1 and model.validation_bags_[0].size == 0
    assert model.gp_training_bags(0, np.unique(bags).size).size == np.unique(bags).size
    score = _member_score(model, 0, X_test, bags_test)
    np.testing.assert_allclose(model.predict_bag_proba(X_test, bags_test)[1], expit(score), rtol=1e-10)


def test_deterministic_with_random_state(data):
    (X, bags, y, _), (X_test, bags_test, _, _) = data
    fitted, again = (fixed_gp_model(n_networks=2, max_epochs=4).fit(X, bags, y) for _ in range(2))  # cheap: 2 members in lockstep
    for state, state_again in zip(fitted.network_states_, again.network_states_, strict=True):
        assert state.keys() == state_again.keys()
        for name, value in state.items():
            np.testing.assert_array_equal(value, state_again[name], err_msg=name)
    np.testing.assert_array_equal(fitted.predict_bag_proba(X_test, bags_test)[1], again.predict_bag_proba(X_test, bags_test)[1])
    other = fixed_gp_model(random_state=1, n_networks=1, max_epochs=2).fit(X, bags, y)  # member 0 draws its weights first either way
    assert not np.array_equal(fitted.network_states_[0]["embed.0.weight"], other.network_states_[0]["embed.0.weight"])


def test_clone_and_constructor_store_params_only():
    model = small_model(n_components=8)
    copy = clone(model)
    assert copy.get_params()["n_components"] == 8 and copy.gp is not model.gp
    assert not any(k.endswith("_") for k in vars(copy))
    assert EmbeddedGPMIL().get_params()["gp"] is None


def test_predict_does_not_mutate(fitted, data):
    _, (X, bags, _, _) = data

    def copy(v):
        if isinstance(v, np.ndarray):
            return v.copy()
        if isinstance(v, dict):
            return {n: copy(a) for n, a in v.items()}
        return [copy(a) for a in v] if isinstance(v, list) and not any(hasattr(a, "get_params") for a in v) else v

    def check(before, after, where):
        if isinstance(before, np.ndarray):
            np.testing.assert_array_equal(after, before, err_msg=where)
        elif isinstance(before, dict):
            for n, a in before.items():
                check(a, after[n], f"{where}[{n}]")
        elif isinstance(before, list):
            for i, a in enumerate(before):
                check(a, after[i], f"{where}[{i}]")

    objects = [fitted, *fitted.gps_]
    before = [{k: copy(v) for k, v in vars(obj).items()} for obj in objects]
    fitted.predict_bag_proba(X, bags, return_std=True)
    fitted.predict_bag_proba(X, bags, rule="max", method="probit")
    fitted.predict_instance_proba(X)
    fitted.predict_attention(X, bags)
    fitted.transform(X)
    for before_state, obj in zip(before, objects, strict=True):
        assert vars(obj).keys() == before_state.keys()
        for k, v in before_state.items():
            check(v, vars(obj)[k], k)


def test_network_is_plain_arrays_and_saves_without_pickle(fitted, data, tmp_path):
    _, (X, bags, _, _) = data
    assert all(isinstance(v, np.ndarray) and v.dtype == np.float32 for state in fitted.network_states_ for v in state.values())
    path = save(fitted, tmp_path / "model")
    with np.load(path, allow_pickle=False) as archive:  # readable without executing anything
        assert len(archive.files) > 5 * len(fitted.network_states_[0])
    restored = load(path)
    assert isinstance(restored, EmbeddedGPMIL)
    np.testing.assert_array_equal(restored.predict_bag_proba(X, bags, return_std=True)[2],
                                  fitted.predict_bag_proba(X, bags, return_std=True)[2])


def test_numpy_prediction_matches_the_torch_network(fitted, data):
    """One formula, two namespaces: the NumPy forward pass is the network PyTorch trained."""
    _, (X, bags, _, _) = data
    rows = np.flatnonzero(bags == bags[0])
    state = {k: torch.from_numpy(v) for k, v in fitted.network_states_[0].items()}
    with torch.no_grad():
        torch_logit = float(_single_bag_logit(state, instance_embedding(state, torch.from_numpy(X[rows].astype(np.float32)))))
    params = network_arrays(fitted.network_states_[0])
    numpy_logit = bag_logits(params, instance_embedding(params, X[rows]), np.array([0, rows.size]))[0]
    assert numpy_logit == pytest.approx(torch_logit, abs=1e-4)


def test_abmil_baseline(data):
    (X, bags, y, _), (X_test, bags_test, y_test, instance_labels) = data
    model = ABMIL(**NET, random_state=0).fit(X, bags, y)
    keys, p = model.predict_bag_proba(X_test, bags_test)
    truth = np.array([y_test[bags_test == k][0] for k in keys])
    assert roc_auc_score(truth, p) > 0.9
    assert roc_auc_score(instance_labels, model.predict_instance_proba(X_test)) > 0.9
    alpha = model.predict_attention(X_test, bags_test)
    np.testing.assert_allclose([alpha[bags_test == k].sum() for k in keys], 1.0)
    assert model.network_train_loss_.shape == (NET["max_epochs"],) and model.network_validation_loss_.size == 0
    assert model.validation_bags_.size == 0 and (model.calibration_slope_, model.calibration_intercept_) == (1.0, 0.0)


def _abmil_bag_logits(model, X, bags):
    params = network_arrays(model.network_state_)
    return _per_bag(lambda rows: bag_logits(params, instance_embedding(params, X[rows]), np.array([0, rows.sum()]))[0], bags)


def test_abmil_platt_calibration_on_held_out_bags(data):
    (X, bags, y, _), (X_test, bags_test, _, _) = data
    model = ABMIL(**NET, calibration="platt", random_state=0).fit(X, bags, y)
    assert model.network_validation_loss_.size == 0  # held out for the calibration, not for stopping
    assert model.network_train_loss_.shape == (NET["max_epochs"],)
    val_keys = np.unique(bags)[model.validation_bags_]
    rows = np.isin(bags, val_keys)
    val_labels = np.array([y[bags == k][0] for k in val_keys])
    slope, intercept = fit_platt(_abmil_bag_logits(model, X[rows], bags[rows]), val_labels)
    assert (model.calibration_slope_, model.calibration_intercept_) == pytest.approx((slope, intercept), rel=1e-6)
    np.testing.assert_allclose(model.predict_bag_proba(X_test, bags_test)[1],
                               expit(slope * _abmil_bag_logits(model, X_test, bags_test) + intercept), rtol=1e-6)


def test_platt_recovers_a_known_map_and_stays_finite_on_separable_bags():
    rng = np.random.default_rng(0)
    s = rng.normal(size=20_000)
    y = (rng.random(s.size) < expit(2.0 * s - 1.0)).astype(int)
    assert fit_platt(s, y) == pytest.approx((2.0, -1.0), abs=0.1)  # the prior is negligible here
    slope, intercept = fit_platt(np.array([-3.0, -2.0, -1.0, 1.0, 2.0, 3.0]), np.array([0, 0, 0, 1, 1, 1]), slope_prior_std=None)
    assert 0 < slope < 10 and np.isfinite(intercept)  # Platt's smoothed targets: no runaway to infinity
    # smoothed targets 1/5 and 4/5 at scores ±1: σ(a ± c) hits them exactly; the prior on log a pulls towards 1
    separable = np.array([-1.0, -1.0, -1.0, 1.0, 1.0, 1.0]), np.array([0, 0, 0, 1, 1, 1])
    assert fit_platt(*separable, slope_prior_std=None) == pytest.approx((np.log(4.0), 0.0), abs=1e-6)
    assert 1.0 < fit_platt(*separable)[0] < np.log(4.0) - 0.05


def test_platt_never_reverses_the_ranking():
    """Four validation bags that happen to rank the wrong way must not flip the model's ranking."""
    slope, _ = fit_platt(np.array([1.0, 2.0, -1.0, -2.0]), np.array([0, 0, 1, 1]))
    assert slope > 0.1
    scores = np.array([-2.0, 0.0, 3.0])
    assert np.all(np.diff(expit(slope * scores)) > 0)
    with pytest.raises(ValueError, match="both classes"):
        fit_platt([0.1, 0.2], [1, 1])
    with pytest.raises(ValueError, match="finite"):
        fit_platt([0.1, np.nan], [0, 1])


def test_reliability_bins_and_ece_by_hand():
    p = np.array([0.05, 0.05, 0.15, 0.95, 0.95, 0.95, 0.95])
    y = np.array([0, 1, 0, 1, 1, 1, 0])
    assert reliability_bins(p, y) == [(2, pytest.approx(0.05), 0.5), (1, pytest.approx(0.15), 0.0), (4, pytest.approx(0.95), 0.75)]
    assert expected_calibration_error(p, y) == pytest.approx((2 * 0.45 + 1 * 0.15 + 4 * 0.2) / 7)


def _mean_cross_entropy(logits: np.ndarray, targets: np.ndarray) -> float:
    return float(np.mean(np.logaddexp(0.0, logits) - targets * logits))


def test_training_loss_adds_a_negative_bags_instances_as_negatives(fitted, data):
    """Seed 000 §2.1: a negative bag's instances are all negative, so its step adds their mean
    instance cross-entropy against 0; a positive bag's step is the bag cross-entropy alone."""
    (X, bags, y, _), _ = data
    params = network_arrays(fitted.network_states_[0])
    for b in (0, 1):
        assert y[bags == b][0] == b
        H = instance_embedding(params, X[bags == b])
        ell = bag_logits(params, H, np.array([0, H.shape[0]]))[0]
        bag = float(np.logaddexp(0.0, -ell if b else ell))
        instances = float(np.mean(np.logaddexp(0.0, instance_logits(params, H))))
        assert training_loss(params, H, b, _mean_cross_entropy, False) == pytest.approx((bag, bag))
        expected = (bag, bag) if b else (bag + instances, bag)
        assert training_loss(params, H, b, _mean_cross_entropy, True) == pytest.approx(expected)


def test_negative_instances_reach_the_networks_training(fitted, data):
    """The default ensemble trains its networks with the negative bags' instances
    (``negative_instances=True``); turned off, the same seed trains other networks, which score
    the negative training bags' instances higher."""
    (X, bags, y, _), _ = data
    assert fitted.negative_instances and not ABMIL().negative_instances
    plain = fixed_gp_model(negative_instances=False).fit(X, bags, y)
    negatives = X[y == 0]

    def mean_instance_logit(model):
        return np.mean([instance_logits(network_arrays(state), model._embed(negatives, k)).mean()
                        for k, state in enumerate(model.network_states_)])

    assert mean_instance_logit(fitted) < mean_instance_logit(plain) - 0.5


def test_early_stopping_keeps_the_best_validation_epoch(data):
    (X, bags, y, _), _ = data
    model = ABMIL(**(NET | {"max_epochs": 40}), early_stopping=True, n_epochs_no_change=3, random_state=0).fit(X, bags, y)
    losses, aucs = model.network_validation_loss_, model.network_validation_auc_
    assert losses.shape == aucs.shape == model.network_train_loss_.shape and np.all((aucs >= 0) & (aucs <= 1))
    # the best epoch: highest validation AUC, ties to the lower loss, then the earlier epoch, among
    # the epochs once the training loss has fallen to half the constant predictor's
    assert model.network_best_epoch_ == _best_fitted_epoch(model, bag_labels(bags, y))
    assert losses.size == 40 or losses.size == model.network_best_epoch_ + 3


def test_early_stopping_waits_until_the_networks_fit_their_training_bags(data):
    """Networks that do not learn (a learning rate of 1e-9) rank the held-out bags by noise: no
    epoch is kept for its held-out AUC, training runs all ``max_epochs`` and keeps the last (the
    AUC alone stopped such networks after ``n_epochs_no_change`` epochs at a noise peak)."""
    (X, bags, y, _), _ = data
    params = NET | {"max_epochs": 12, "learning_rate": 1e-9, "n_epochs_no_change": 2, "n_networks": 2, "random_state": 0}
    model = fixed_gp_model(**params).fit(X, bags, y)
    assert model.network_train_loss_.size == model.network_validation_auc_.size == 12
    assert model.network_best_epoch_ == 12
    assert np.all(model.network_train_loss_ > FITTED_LOSS_FRACTION * np.log(2))


@pytest.mark.parametrize(("params", "message"), [
    ({"n_components": 0}, "n_components"),
    ({"hidden": (16, -1)}, r"hidden\[1\]"),
    ({"learning_rate": 0.0}, "learning_rate"),
    ({"validation_fraction": 1.5}, "validation_fraction"),
    ({"n_networks": 0}, "n_networks"),
    ({"negative_instances": "yes"}, "negative_instances"),
])
def test_bad_parameters_are_named(data, params, message):
    (X, bags, y, _), _ = data
    with pytest.raises(ValueError, match=message):
        small_model(**params).fit(X, bags, y)


def test_too_few_bags_for_the_inner_validation_split():
    X, bags, y, _ = make_toy_bags(3, seed=0)
    with pytest.raises(ValueError, match="at least 2 training bags of each class"):
        small_model().fit(X, bags, y)


def test_without_torch_mil_core_imports_and_fit_says_how_to_install():
    code = (
        "import importlib.abc, sys\n"
        "class NoTorch(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name.split('.')[0] == 'torch':\n"
        "            raise ModuleNotFoundError(\"No module named 'torch'\")\n"
        "sys.meta_path.insert(0, NoTorch())\n"
        "import numpy as np, mil_core\n"
        "from tests.conftest import make_toy_bags\n"
        "X, b, y, _ = make_toy_bags(10)\n"
        "try:\n    mil_core.EmbeddedGPMIL().fit(X, b, y)\n"
        "except ImportError as e:\n    print(e)\n"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=root,
                         env={**os.environ, "PYTHONPATH": str(root)}).stdout
    assert 'pip install -e ".[torch]"' in out


def test_pipeline_fit_on_a_store_equals_fit_and_saves_as_a_trained_model(tmp_path, data):
    """The network trains on the client from the store's bags, the GP through the Dask executor on
    the embedded partitions: the same model as ``fit`` on the same bags."""
    from distributed import Client, LocalCluster

    from flows.config import ModelConfig, make_model
    from tasks.prefect_tasks import TrainedModel, load_model, save_model
    from tasks.training import predict_cohort, read_predictions
    from tasks.training.embedded import fit_cohort_embedded
    from tests.test_distributed import write_store

    (X, bags, y, _), _ = data
    X = X.astype(np.float32).astype(np.float64)  # the store keeps float32 features
    path = write_store(tmp_path / "toy.zarr", X, bags, y)
    config = ModelConfig(name="EmbeddedGPMIL", params={**NET, "random_state": 0, "n_networks": 2,
                                                       "gp": {"name": "VGPMIL", "params": {"n_inducing": 10, "max_iter": 20}}})
    model = make_model(config)
    serial = clone(model).fit(X, bags, y)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        summary = fit_cohort_embedded(model, path, client, run="emb", partition_bytes=2_000)
        for state, serial_state in zip(model.network_states_, serial.network_states_, strict=True):
            for name, value in serial_state.items():
                np.testing.assert_array_equal(state[name], value, err_msg=name)
        assert len(model.gps_) == len(serial.gps_) == 2
        for gp, serial_gp in zip(model.gps_, serial.gps_, strict=True):
            np.testing.assert_allclose(gp.q_.mean, serial_gp.q_.mean, rtol=1e-6, atol=1e-8)
        for val, serial_val in zip(model.validation_bags_, serial.validation_bags_, strict=True):
            np.testing.assert_array_equal(val, serial_val)
        assert (model.calibration_slope_, model.calibration_intercept_) == pytest.approx(
            (serial.calibration_slope_, serial.calibration_intercept_), rel=1e-6)
        save_model(tmp_path / "model", TrainedModel(model, summary.scaling))
        restored = load_model(tmp_path / "model").estimator
        predict_cohort(restored, path, client, run="p", partition_bytes=2_000, instance_kwargs={"method": "probit"})
    out = read_predictions(path, "p")
    np.testing.assert_allclose(out["bags/proba"], serial.predict_bag_proba(X, bags)[1], rtol=1e-6)
    assert np.all(np.isfinite(out["bags/std"]))


def test_pipeline_config_builds_the_nested_gp_and_names_a_bad_one():
    from flows.config import ModelConfig, make_model

    model = make_model(ModelConfig(name="EmbeddedGPMIL", params={"n_components": 8, "gp": {"name": "GVGPMIL", "params": {"n_inducing": 20}}}))
    assert isinstance(model, EmbeddedGPMIL) and type(model.gp).__name__ == "GVGPMIL" and model.gp.n_inducing == 20
    assert make_model(ModelConfig(name="EmbeddedGPMIL")).gp is None
    with pytest.raises(ValueError, match="unknown model 'NoSuchGP'"):
        ModelConfig(name="EmbeddedGPMIL", params={"gp": {"name": "NoSuchGP"}})
    with pytest.raises(ValueError, match="gp must be a model section"):
        ModelConfig(name="EmbeddedGPMIL", params={"gp": "VGPMIL"})
    for unusable in ("VWSGP", "AbSMIL", "EmbeddedGPMIL"):  # no instance probabilities with a std: failed after the networks trained
        with pytest.raises(ValueError, match=f"gp must be a GP-MIL model with instance probabilities and their std .*not {unusable}"):
            ModelConfig(name="EmbeddedGPMIL", params={"gp": {"name": unusable}})
    for params, message in (({"n_components": 0}, "n_components must be a positive integer, got 0"),  # read, not trained
                            ({"hidden": "16"}, r"hidden must be a list of layer widths \(positive integers\), e.g. \[128\], got '16'"),
                            ({"representation": "features"}, "representation must be one of"),
                            ({"gp": {"name": "VGPMIL", "params": {"n_inducing": 1}}}, "n_inducing must be an integer >= 2, got 1"),
                            ({"early_stopping": "false"}, "early_stopping must be true or false, got 'false'"),  # read as true
                            ({"random_state": "0"}, r"random_state must be a number, got the text '0' \(remove the quotes\)")):
        with pytest.raises(ValueError, match=message):
            ModelConfig(name="EmbeddedGPMIL", params=params)
    ModelConfig(name="EmbeddedGPMIL", params={"gp": {"name": "GVGPMIL", "params": {"H": "auto"}}})  # text a parameter takes
    X, bags, y, _ = make_toy_bags(8, seed=0)
    with pytest.raises(ValueError, match="not VWSGP"):  # the estimator, before its networks train
        EmbeddedGPMIL(VWSGP(), max_epochs=1).fit(X, bags, y)


# ------------------------------------------------ the representation: the embedding or the input features
def norm_witness_bags(n_bags: int, seed: int):
    """Bags of 4–9 instances in 4 dimensions, all N(0, I) but a positive bag's 1–2 witnesses, which
    are 3× longer (the ``hastie`` benchmark's kind of witness: the norm alone tells). Returns
    ``X, bag_ids, y, instance_labels`` as :func:`make_toy_bags`."""
    rng = np.random.default_rng(seed)
    X, bags, y, inst = [], [], [], []
    for b in range(n_bags):
        size, label = int(rng.integers(4, 10)), b % 2
        n_pos = int(rng.integers(1, 3)) if label else 0
        x = rng.normal(size=(size, 4))
        x[:n_pos] *= 3.0
        X.append(x)
        bags += [b] * size
        y += [label] * size
        inst += [1] * n_pos + [0] * (size - n_pos)
    return np.concatenate(X), np.array(bags), np.array(y), np.array(inst)


BLIND = {"learning_rate": 1e-6, "max_epochs": 3}  # networks that learn nothing: the embedding ranks near chance


@pytest.fixture(scope="module")
def on_features():
    X, bags, y, _ = norm_witness_bags(40, seed=0)
    return small_model(**BLIND).fit(X, bags, y), (X, bags, y)


def in_own_units(X):
    """``X`` with each column in its own units (scales 10⁻² … 10³, offsets of 50 such units)."""
    units = np.geomspace(1e-2, 1e3, X.shape[1])
    return X * units + 50.0 * units


def test_standardize_fits_standardised_rows_and_every_prediction_standardises_its_rows(data):
    """``standardize=True`` is the model fitted with ``standardize=False`` on rows standardised over
    the training instances (same networks, GPs and calibration), and each ``predict_*``,
    ``transform`` and ``predict_attention`` takes rows in their own units."""
    (X, bags, y, _), (X_test, bags_test, _, _) = data
    X, X_test = in_own_units(X), in_own_units(X_test)
    model = fixed_gp_model(n_networks=2, standardize=True).fit(X, bags, y)
    mean, scale = standardisation(X)
    np.testing.assert_allclose(model.feature_mean_, mean, rtol=1e-12)
    np.testing.assert_allclose(model.feature_scale_, scale, rtol=1e-12)
    plain = fixed_gp_model(n_networks=2).fit(standardise(X, mean, scale), bags, y)
    for state, plain_state in zip(model.network_states_, plain.network_states_, strict=True):
        for name, value in plain_state.items():
            np.testing.assert_allclose(state[name], value, rtol=1e-5, atol=1e-6, err_msg=name)
    for gp, plain_gp in zip(model.gps_, plain.gps_, strict=True):
        np.testing.assert_allclose(gp.q_.mean, plain_gp.q_.mean, rtol=1e-5, atol=1e-7)
    assert (model.calibration_slope_, model.calibration_intercept_) == pytest.approx(
        (plain.calibration_slope_, plain.calibration_intercept_), rel=1e-5)
    Z = standardise(X_test, mean, scale)
    X_before = X_test.copy()
    np.testing.assert_allclose(model.predict_bag_proba(X_test, bags_test, return_std=True)[1:],
                               plain.predict_bag_proba(Z, bags_test, return_std=True)[1:], rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(model.predict_instance_proba(X_test, return_std=True, method="probit"),
                               plain.predict_instance_proba(Z, return_std=True, method="probit"), rtol=1e-5, atol=1e-8)
    np.testing.assert_allclose(model.transform(X_test), plain.transform(Z), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.member_transform(X_test, 1), plain.member_transform(Z, 1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(model.predict_attention(X_test, bags_test), plain.predict_attention(Z, bags_test), rtol=1e-5)
    np.testing.assert_array_equal(X_test, X_before)  # the caller's rows are not overwritten
    np.testing.assert_array_equal(model.feature_mean_, mean)  # nor the model by predicting


def test_the_gps_on_the_input_features_see_them_standardised(on_features):
    """Where the networks learn nothing (``representation="auto"`` keeps GPs on the input features),
    those GPs fit on columns in their own units as on unit-scale ones: standardised once, on all
    training instances."""
    _, (X, bags, y) = on_features
    mean, scale = standardisation(in_own_units(X))
    standardised = small_model(**BLIND, n_networks=2, standardize=True).fit(in_own_units(X), bags, y)
    unit = small_model(**BLIND, n_networks=2).fit(standardise(in_own_units(X), mean, scale), bags, y)
    assert standardised.representation_ == unit.representation_ == "features"
    assert standardised.representation_auc_ == pytest.approx(unit.representation_auc_, rel=1e-6)
    for gp, unit_gp in zip(standardised.gps_, unit.gps_, strict=True):
        assert gp.standardize is False and gp.kernel_.variance == unit_gp.kernel_.variance
        np.testing.assert_allclose(gp.q_.mean, unit_gp.q_.mean, rtol=1e-5, atol=1e-7)
    X_test, bags_test, _, _ = norm_witness_bags(30, seed=1)
    np.testing.assert_allclose(standardised.predict_bag_proba(in_own_units(X_test), bags_test)[1],
                               unit.predict_bag_proba(standardise(in_own_units(X_test), mean, scale), bags_test)[1], rtol=1e-5)


def _features_evidence(gp, X, bags):
    """``logit p_b`` of a member GP on the input features, bags in ``np.unique`` order."""
    return logit(np.clip(gp.predict_bag_proba(X, bags)[1], 1e-9, 1 - 1e-9))


def test_auto_keeps_the_gps_on_the_input_features_where_they_score_higher_out_of_fold(on_features, tmp_path):
    model, (X, bags, y) = on_features
    assert model.representation == "auto" and model.representation_ == "features"
    keys, labels = np.unique(bags), bag_labels(bags, y)
    assert model.representation_auc_["embedding"] <= 0.5 + 2 * chance_auc_std(labels)  # within chance: look at X
    assert model.representation_auc_["features"] > model.representation_auc_["embedding"]
    assert len(model.gps_) == len(model.network_states_) == 5
    scores, truth = [], []
    for k, gp in enumerate(model.gps_):  # member k's GP trained on the input features of its training bags only
        assert gp.random_state == (model._seeds()[1] + 5 + k) % (2**31 - 1)  # seeded after the GPs on the embeddings
        rows = np.isin(bags, keys[model.gp_training_bags(k, keys.size)])
        expected = clone(model.gp).set_params(random_state=gp.random_state, standardize=False).fit(X[rows], bags[rows], y[rows])
        np.testing.assert_allclose(gp.q_.mean, expected.q_.mean, rtol=1e-10, atol=1e-12)
        held_out = np.isin(bags, keys[model.validation_bags_[k]])
        scores.append(_features_evidence(gp, X[held_out], bags[held_out]))
        truth.append(labels[model.validation_bags_[k]])
    scores, truth = np.concatenate(scores), np.concatenate(truth)
    assert model.representation_auc_["features"] == pytest.approx(roc_auc_score(truth, scores), rel=1e-12)
    assert (model.calibration_slope_, model.calibration_intercept_) == pytest.approx(fit_platt(scores, truth), rel=1e-6)

    X_test, bags_test, y_test, instance_labels = norm_witness_bags(30, seed=1)
    score = np.mean([_features_evidence(gp, X_test, bags_test) for gp in model.gps_], axis=0)
    keys_test, p, sd = model.predict_bag_proba(X_test, bags_test, return_std=True)
    np.testing.assert_allclose(p, expit(model.calibration_slope_ * score + model.calibration_intercept_), rtol=1e-10)
    assert np.all((sd > 0) & (sd <= np.sqrt(p * (1 - p)) + 1e-12))
    np.testing.assert_allclose(model.predict_bag_proba(X_test, bags_test, rule="max", method="probit")[1],
                               np.mean([gp.predict_bag_proba(X_test, bags_test, rule="max", method="probit")[1]
                                        for gp in model.gps_], axis=0), rtol=1e-12)
    np.testing.assert_allclose(model.predict_instance_proba(X_test),  # the GPs' mixture: the networks found less
                               np.mean([gp.predict_instance_proba(X_test) for gp in model.gps_], axis=0), rtol=1e-12)
    assert roc_auc_score(bag_labels(bags_test, y_test), p) > 0.8
    assert roc_auc_score(instance_labels, model.predict_instance_proba(X_test)) > 0.8
    # the networks are kept and still answer for themselves; attention pooling needs GPs on the embeddings
    assert not np.allclose(model.predict_bag_proba(X_test, bags_test, rule="network")[1], p)
    with pytest.raises(ValueError, match="representation_='features'"):
        model.predict_bag_proba(X_test, bags_test, rule="attention")
    restored = load(save(model, tmp_path / "model"))
    assert restored.representation_ == "features"
    np.testing.assert_array_equal(restored.predict_bag_proba(X_test, bags_test, return_std=True)[2], sd)


def test_auto_keeps_an_embedding_that_ranks_above_chance_without_fitting_gps_on_the_features(fitted, data):
    (X, bags, y, _), _ = data
    assert fitted.representation == "auto" and fitted.representation_ == "embedding"
    assert fitted.representation_auc_["embedding"] > 0.5 + 2 * chance_auc_std(bag_labels(bags, y))
    assert np.isnan(fitted.representation_auc_["features"]) and len(fitted.gps_) == 5


def test_representation_embedding_and_a_fixed_kernel_compare_nothing(on_features):
    """``representation="embedding"`` fits no GP on the input features; neither does ``"auto"`` with a
    GP of fixed kernel (it makes no choice of its own): both keep the ensemble, NaN for what was not measured."""
    model, (X, bags, y) = on_features
    embedding = clone(model).set_params(representation="embedding").fit(X, bags, y)
    fixed = clone(model).set_params(gp=VGPMIL(n_inducing=10, max_iter=20, kernel=RBF(variance=4.0))).fit(X, bags, y)
    keys, labels = np.unique(bags), bag_labels(bags, y)
    scores, truth = [], []  # the ensemble's out-of-fold scores, which its calibration is fitted on
    for k, val in enumerate(embedding.validation_bags_):
        rows = np.isin(bags, keys[val])
        scores.append(_member_score(embedding, k, X[rows], bags[rows]))
        truth.append(labels[val])
    assert embedding.representation_auc_["embedding"] == pytest.approx(roc_auc_score(np.concatenate(truth), np.concatenate(scores)))
    assert model.representation_auc_["embedding"] == embedding.representation_auc_["embedding"]  # the same ensemble
    for other in (embedding, fixed):
        assert other.representation_ == "embedding" and np.isnan(other.representation_auc_["features"])
        assert len(other.gps_) == len(other.network_states_) == 5
    with pytest.raises(ValueError, match="representation must be one of"):
        clone(model).set_params(representation="features").fit(X, bags, y)


def test_the_report_says_which_representation_was_kept(on_features, fitted):
    from tasks import report

    model, _ = on_features
    choices = report.model_choices(model)
    assert choices["representation"] == "features" and len(choices["members"]) == 5
    assert [m["kernel_variance"] for m in choices["members"]] == [gp.kernel_.variance for gp in model.gps_]
    assert choices["representation_held_out_auc"] == {k: round(v, 4) for k, v in model.representation_auc_.items()}
    assert report.choices_text(choices).startswith(
        "Its GPs see the input features, not the networks' embeddings (out-of-fold bag AUC of the networks "
        f"{model.representation_auc_['embedding']:.3f}, of GPs on the input features {model.representation_auc_['features']:.3f}). "
        "Its 5 member GPs chose from their training bags: kernel variances")
    ensemble = report.model_choices(fitted)
    assert ensemble["representation"] == "embedding" and len(ensemble["members"]) == 5
    assert report.choices_text(ensemble).startswith("Its GPs see the networks' embeddings (out-of-fold bag AUC of the networks ")


def test_pipeline_fit_on_a_store_keeps_the_gps_on_the_input_features_as_fit_does(tmp_path, on_features):
    """``fit_cohort_embedded`` makes the same choice as ``fit``: each member's GPs on the embeddings
    and on the input features through the Dask executor (runs ``…-member<k>``, ``…-features<k>``),
    the latter kept, predictions those of ``fit``."""
    from distributed import Client, LocalCluster

    from tasks.prefect_tasks import TrainedModel, load_model, save_model
    from tasks.training import predict_cohort, read_predictions
    from tasks.training.embedded import fit_cohort_embedded
    from tests.test_distributed import write_store

    _, (X, bags, y) = on_features
    X = X.astype(np.float32).astype(np.float64)  # the store keeps float32 features
    path = write_store(tmp_path / "norm.zarr", X, bags, y)
    serial = small_model(n_networks=2, **BLIND).fit(X, bags, y)
    assert serial.representation_ == "features"
    model = small_model(n_networks=2, **BLIND)
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        from tasks.training import fit_cohort

        # an interrupted earlier run's member GP (another seed: random_state=None draws one a run): no start for
        # this run's, and resuming from it failed every rerun ("written by another model configuration")
        leftover = VGPMIL(kernel=RBF(variance=4.0, length_scale=1.0), n_inducing=10, max_iter=1, random_state=7)
        fit_cohort(leftover, path, client, run="emb-features0", partition_bytes=2_000)
        summary = fit_cohort_embedded(model, path, client, run="emb", partition_bytes=2_000)
        assert model.representation_ == "features" and len(model.gps_) == 2
        assert model.representation_auc_ == pytest.approx(serial.representation_auc_, rel=1e-6)
        for gp, serial_gp in zip(model.gps_, serial.gps_, strict=True):
            np.testing.assert_allclose(gp.q_.mean, serial_gp.q_.mean, rtol=1e-6, atol=1e-8)
        assert (model.calibration_slope_, model.calibration_intercept_) == pytest.approx(
            (serial.calibration_slope_, serial.calibration_intercept_), rel=1e-6)
        assert all((tmp_path / "norm.zarr" / "training" / run).exists() for run in ("emb-member1", "emb-features1"))
        save_model(tmp_path / "model", TrainedModel(model, summary.scaling))
        predict_cohort(load_model(tmp_path / "model").estimator, path, client, run="p", partition_bytes=2_000)
    np.testing.assert_allclose(read_predictions(path, "p")["bags/proba"], serial.predict_bag_proba(X, bags)[1], rtol=1e-6)


def test_default_gp_fits_a_cohort_smaller_than_its_inducing_points():
    """A small cohort (16 bags, ~90 instances; each member's GP sees ~60) fits with the default GP's
    100 inducing points: every member's training instance becomes one, the documented exact GP,
    without a warning per member (nobody chose the 100)."""
    X, bags, y, instance_labels = make_toy_bags(16, seed=3)
    assert X.shape[0] * 0.8 < 100
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="n_inducing")
        model = EmbeddedGPMIL(**(NET | {"random_state": 0, "representation": "embedding"})).fit(X, bags, y)
    for k, gp in enumerate(model.gps_):
        assert gp.gp_.Z.shape[0] == np.isin(bags, np.unique(bags)[model.gp_training_bags(k, 16)]).sum()
    assert roc_auc_score(instance_labels, model.predict_instance_proba(X)) > 0.8
