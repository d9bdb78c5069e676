"""The GP-MIL estimators and AbSMIL standardise their features (``standardize=True``, the default): a fit on
features in any units — each column scaled and shifted, as raw public tables come — predicts what
the fit on the standardised features predicts. Before, every default scored bag AUC 0.5 on the raw
MUSK1 file (docs/BENCHMARKS.md, "Features in their own units")."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import bag_labels, make_toy_bags
from sklearn.base import clone

from mil_core import GVGPMIL, RBF, VGPMIL, VGPMILPR, VGPMILPRI, VWSGP, AbSMIL, PsiVGPMIL
from mil_core import persist
from mil_core.metrics import binary_auc
from mil_core.models.gibbs import VGPMILPRGibbs
from mil_core.validation import standardisation


def _units(X: np.ndarray) -> np.ndarray:
    """The same features in other units: columns scaled by 10⁻²…10³ and shifted, one constant."""
    scales = np.logspace(-2, 3, X.shape[1])
    raw = X * scales + np.linspace(-500.0, 800.0, X.shape[1])
    return np.hstack([raw, np.full((X.shape[0], 1), 42.0)])


def _standardised(X: np.ndarray) -> np.ndarray:
    mean, scale = standardisation(X)
    return (X - mean) / scale


MODELS = [
    VGPMIL(kernel=RBF(4.0), max_iter=15, random_state=0),
    GVGPMIL(kernel=RBF(1.0), max_iter=15, random_state=0),
    PsiVGPMIL(kernel=RBF(4.0), max_iter=10, random_state=0),
    VGPMILPR(kernel=RBF(4.0), max_iter=15, random_state=0),
    VWSGP(kernel=RBF(4.0), max_iter=15, random_state=0),
    VGPMILPRGibbs(kernel=RBF(4.0), n_samples=40, burn_in=10, thin=1, random_state=0),
]


@pytest.mark.parametrize("model", MODELS, ids=lambda m: type(m).__name__)
def test_a_fit_in_other_units_predicts_as_the_standardised_fit(model):
    X, bags, y, _ = make_toy_bags(n_bags=30, n_features=3, seed=1)
    test = bags >= 24
    Xs = _standardised(_units(X[~test]))  # what a user who standardises first passes
    raw = clone(model).fit(_units(X[~test]), bags[~test], y[~test])
    mean, scale = raw.feature_mean_.copy(), raw.feature_scale_.copy()
    scores = raw.predict_bag_proba(_units(X[test]), bags[test])[1]
    reference = clone(model).set_params(standardize=False).fit(Xs, bags[~test], y[~test])
    Xs_test = (_units(X[test]) - mean) / scale
    np.testing.assert_allclose(scores, reference.predict_bag_proba(Xs_test, bags[test])[1], atol=1e-8)
    assert scale[-1] == 1.0 and mean[-1] == 42.0  # the constant column is centred, not divided by ~0
    assert reference.feature_mean_ is None and reference.feature_scale_ is None
    instance = getattr(raw, "predict_instance_proba", None) or raw.predict_instance_evidence
    instance_ref = getattr(reference, "predict_instance_proba", None) or reference.predict_instance_evidence
    np.testing.assert_allclose(instance(_units(X[test])), instance_ref(Xs_test), atol=1e-8)
    np.testing.assert_allclose(raw.predict_latent(_units(X[test]))[0], reference.predict_latent(Xs_test)[0], atol=1e-8)


def test_coupled_predictions_standardise_once():
    """VGPMIL-PR-I's coupled instance and bag predictions (coords) go through the same scaling."""
    X, bags, y, _ = make_toy_bags(n_bags=20, n_features=2, seed=2)
    coords = np.stack([np.arange(X.shape[0]) % 4, np.arange(X.shape[0]) // 4], axis=1)
    model = VGPMILPRI(kernel=RBF(4.0), lam=0.3, max_iter=10, random_state=0)
    raw = model.fit(_units(X), bags, y, coords=coords)
    reference = VGPMILPRI(kernel=RBF(4.0), lam=0.3, max_iter=10, random_state=0, standardize=False)
    reference.fit(_standardised(_units(X)), bags, y, coords=coords)
    np.testing.assert_allclose(raw.predict_bag_proba(_units(X), bags, coords=coords)[1],
                               reference.predict_bag_proba(_standardised(_units(X)), bags, coords=coords)[1], atol=1e-8)
    np.testing.assert_allclose(raw.predict_instance_proba(_units(X), bag_ids=bags, coords=coords),
                               reference.predict_instance_proba(_standardised(_units(X)), bag_ids=bags, coords=coords), atol=1e-8)


@pytest.mark.parametrize("n_random_features", [None, 16])
def test_absmil_in_other_units_predicts_as_on_standardised_features(n_random_features):
    X, bags, y, _ = make_toy_bags(n_bags=30, n_features=3, seed=5)
    params = dict(n_random_features=n_random_features, max_iter=40, random_state=0)
    raw = AbSMIL(**params).fit(_units(X), bags, y)
    reference = AbSMIL(**params, standardize=False).fit(_standardised(_units(X)), bags, y)
    Xs = (_units(X) - raw.feature_mean_) / raw.feature_scale_
    np.testing.assert_allclose(raw.predict_bag_proba(_units(X), bags)[1], reference.predict_bag_proba(Xs, bags)[1], atol=1e-10)
    np.testing.assert_allclose(raw.predict_attribute_proba(_units(X), bags), reference.predict_attribute_proba(Xs, bags), atol=1e-10)
    np.testing.assert_allclose(raw.predict_instance_proba(_units(X)), reference.predict_instance_proba(Xs), atol=1e-10)


def test_the_default_learns_raw_features_that_defeat_it_unstandardised():
    """The point of the change: on features in large units the default still ranks held-out bags,
    where the same fit without standardisation sees a kernel of ~0 between a test instance and
    every inducing point and scores every test bag alike."""
    X, bags, y, _ = make_toy_bags(n_bags=60, n_features=4, seed=3)
    X_raw, test = X * 300.0 + 1000.0, bags >= 40
    labels = bag_labels(bags[test], y[test])

    def held_out_auc(model):
        model.fit(X_raw[~test], bags[~test], y[~test])
        return binary_auc(labels, model.predict_bag_proba(X_raw[test], bags[test])[1])

    assert held_out_auc(VGPMIL(random_state=0)) > 0.9
    assert held_out_auc(VGPMIL(random_state=0, standardize=False)) < 0.6


def test_the_scaling_is_saved_with_the_model(tmp_path):
    X, bags, y, _ = make_toy_bags(n_bags=20, n_features=2, seed=4)
    model = VGPMIL(kernel=RBF(4.0), max_iter=10, random_state=0).fit(_units(X), bags, y)
    loaded = persist.load(persist.save(model, tmp_path / "model.npz"))
    np.testing.assert_array_equal(loaded.feature_scale_, model.feature_scale_)
    np.testing.assert_array_equal(loaded.predict_bag_proba(_units(X), bags)[1], model.predict_bag_proba(_units(X), bags)[1])


@pytest.mark.parametrize("model", [VGPMIL(kernel=RBF(4.0), max_iter=5, random_state=0), AbSMIL(max_iter=5, random_state=0)],
                         ids=lambda m: type(m).__name__)
def test_standardising_leaves_the_callers_arrays_alone(model):
    """The fit standardises its own sorted copy of the rows in place; the caller's X stays as given."""
    X, bags, y, _ = make_toy_bags(n_bags=12, n_features=2, seed=6)
    X_raw = _units(X)
    given = X_raw.copy()
    fitted = clone(model).fit(X_raw, bags, y)
    fitted.predict_bag_proba(X_raw, bags)
    np.testing.assert_array_equal(X_raw, given)


@pytest.mark.parametrize("namespace", ["numpy", "emulated device"])
def test_features_whose_squares_overflow_are_standardised_as_in_smaller_units(namespace):
    """Columns beyond ~1e154 (squares overflow float64) had an infinite std, every z-score 0, and
    the default fit predicted one constant for every bag without a word."""
    from tests.emulated_device import to_emulated

    X, bags, y, _ = make_toy_bags(n_bags=20, n_features=3, seed=2)
    huge = X * np.array([1.0, 1e200, 1e300]) + np.array([0.0, 5e200, 0.0])
    convert = (lambda a: a) if namespace == "numpy" else to_emulated
    mean, scale = standardisation(convert(huge))
    reference_mean, reference_scale = standardisation(X)
    np.testing.assert_allclose(mean / [1.0, 1e200, 1e300], reference_mean + [0.0, 5.0, 0.0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(scale / [1.0, 1e200, 1e300], reference_scale, rtol=1e-12)

    fitted = VGPMIL(kernel=RBF(4.0), max_iter=10, random_state=0)
    scores = clone(fitted).fit(huge, bags, y).predict_bag_proba(huge, bags)[1]
    np.testing.assert_allclose(scores, clone(fitted).fit(X, bags, y).predict_bag_proba(X, bags)[1], atol=1e-8)
    assert np.ptp(scores) > 0.1


def test_a_constant_column_that_float_rounding_varies_stays_constant():
    """A constant 1e6 column jittered by one rounding step (std ~1e-10) was scaled to unit variance:
    the rounding noise became a full feature. Its std is below 1e-12 of its level: constant."""
    X, _, _, _ = make_toy_bags(n_bags=10, n_features=2, seed=3)
    level = np.full(X.shape[0], 1e6) + np.where(np.arange(X.shape[0]) % 2, np.spacing(1e6), 0.0)
    mean, scale = standardisation(np.column_stack([X, level]))
    assert 0 < level.std() < 1e-9 and scale[-1] == 1.0 and mean[-1] == pytest.approx(1e6)
    assert np.all(scale[:2] != 1.0)
