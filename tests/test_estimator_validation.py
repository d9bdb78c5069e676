"""Validation at the boundary, the same for every public mil_core estimator: bad input to ``fit``
or a predict method fails at once with a ``ValueError`` naming what is wrong (and the bag, where
one bag is the problem), before any work; the constructor stores its parameters and nothing else."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from test_predict_purity import ESTIMATORS, USES_COORDS, _same, fitted

from tests.conftest import make_toy_bags

X, BAGS, Y, _ = make_toy_bags(n_bags=12)
COORDS = np.concatenate([np.arange(n) for n in np.unique(BAGS, return_counts=True)[1]])


def _with_nan(X, bags, y):
    X = X.copy()
    X[4, 1] = np.nan
    return X, bags, y


def _mixed_labels(X, bags, y):
    y = y.copy()
    y[np.flatnonzero(bags == 3)[0]] = 0  # bag 3 is positive: one of its instances now says 0
    return X, bags, y


def _mixed_labels_text_ids(X, bags, y):
    """As :func:`_mixed_labels`, the bag ids text in an object array (as a CSV table gives them)."""
    X, _, y = _mixed_labels(X, bags, y)
    return X, np.array([f"slide-{b}" for b in bags], dtype=object), y


BAD_FIT_INPUT = {
    "nan-feature": (_with_nan, rf"X contains NaN at row 4, column 1, bag {BAGS[4].item()} \(1 row\(s\) with NaN or infinity\)"),
    "infinite-feature": (lambda X, b, y: (np.where(np.arange(X.size).reshape(X.shape) == 3, np.inf, X), b, y),
                         rf"X contains infinity at row {3 // X.shape[1]}, column {3 % X.shape[1]}, bag {BAGS[3 // X.shape[1]].item()}"),
    "bag-ids-length": (lambda X, b, y: (X, b[:-1], y), "bag_ids must be 1-D with one entry per instance"),
    "bag-ids-nan": (lambda X, b, y: (X, np.where(np.arange(b.size) == 2, np.nan, b.astype(float)), y), "bag_ids contains NaN"),
    "bag-ids-none": (lambda X, b, y: (X, np.where(np.arange(b.size) == 5, None, b.astype(str).astype(object)), y),
                     r"bag_ids has no bag id at row\(s\) \[5\]"),
    "bag-ids-mixed-types": (lambda X, b, y: (X, np.where(b == 0, "zero", b.astype(object)), y), r"bag_ids mixes types \(integer, text\)"),
    "bag-ids-pandas-na": (lambda X, b, y: (X, np.where(np.arange(b.size) == 5, pd.NA, b.astype(str).astype(object)), y),
                          r"bag_ids has no bag id at row\(s\) \[5\] \(<NA>\)"),
    "label-not-constant-in-a-bag": (_mixed_labels, "bag 3 has instances with different bag labels"),
    "label-not-constant-in-a-bag-with-text-ids": (_mixed_labels_text_ids, "bag 'slide-3' has instances with different bag labels"),
    "label-not-binary": (lambda X, b, y: (X, b, 2 * y), r"bag labels must be 0 or 1 \(or -1 and 1; 1 is positive\), found \[2\] "
                         rf"\(the first: bag {BAGS[np.flatnonzero(Y)[0]].item()}, row {np.flatnonzero(Y)[0]}\)"),
    "label-mixes-conventions": (lambda X, b, y: (X, b, np.where(b == 0, -1, y)),
                                rf"bag labels mix -1 \(bag 0, row 0\) and 0 \(bag {BAGS[np.flatnonzero((BAGS != 0) & (Y == 0))[0]].item()}, "
                                rf"row {np.flatnonzero((BAGS != 0) & (Y == 0))[0]}\)"),
    "label-strings": (lambda X, b, y: (X, b, np.where(y == 1, "tumour", "normal")), r"found \['normal', 'tumour'\]"),
    "single-class": (lambda X, b, y: (X, b, np.zeros_like(y)), "need bags of both classes"),
    "labels-length": (lambda X, b, y: (X, b, y[:-1]), "y must be 1-D with one bag label per instance"),
}


def _fit_kwargs(name):
    return {"coords": COORDS} if name in USES_COORDS else {}


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_constructor_stores_its_parameters_only(name):
    estimator = ESTIMATORS[name]()
    assert set(vars(estimator)) == set(estimator.get_params(deep=False))
    fresh = type(estimator)()
    assert set(vars(fresh)) == set(fresh.get_params(deep=False))


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
@pytest.mark.parametrize("problem", sorted(BAD_FIT_INPUT))
def test_fit_refuses_bad_input_with_a_clear_message_and_learns_nothing(name, problem):
    corrupt, message = BAD_FIT_INPUT[problem]
    estimator = ESTIMATORS[name]()
    before = dict(vars(estimator))
    with pytest.raises(ValueError, match=message):
        estimator.fit(*corrupt(X, BAGS, Y), **_fit_kwargs(name))
    assert _same(vars(estimator), before), "a refused fit left fitted attributes behind"


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_minus_one_plus_one_labels_fit_what_zero_one_labels_fit(name):
    """The MIL benchmarks' other label convention: -1/+1 (and booleans) are the same bags as 0/1."""
    context = {"coords": COORDS} if name in USES_COORDS else {}
    reference = ESTIMATORS[name]().fit(X, BAGS, Y, **context)
    for labels in (2 * Y - 1, Y.astype(bool), Y.astype(float)):
        other = ESTIMATORS[name]().fit(X, BAGS, labels, **context)
        assert _same(vars(other), vars(reference)), f"labels {labels[:3]} fitted another model"


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_predict_refuses_wrong_width_nan_and_an_unfitted_model(name):
    from sklearn.exceptions import NotFittedError

    with pytest.raises(NotFittedError):
        ESTIMATORS[name]().predict_bag_proba(X, BAGS)
    estimator = fitted(name)  # fitted on the same toy bags
    context = {"coords": COORDS} if name in USES_COORDS else {}
    with pytest.raises(ValueError, match="features"):
        estimator.predict_bag_proba(np.hstack([X, X]), BAGS, **context)
    with pytest.raises(ValueError, match="NaN at row 4, column 1"):
        estimator.predict_bag_proba(_with_nan(X, BAGS, Y)[0], BAGS, **context)
    with pytest.raises(ValueError, match="bag_ids must be 1-D"):
        estimator.predict_bag_proba(X, BAGS[:-1], **context)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_numbers_in_an_object_array_are_labels_and_numpy_scalar_ids_are_their_python_kind(name):
    """A mixed DataFrame's .values gives object columns: labels [0, 1] were refused as 'found [0, 1]',
    ids mixing str and np.str_ as 'mixes types (str, str_)'."""
    reference = ESTIMATORS[name]().fit(X, BAGS, Y, **_fit_kwargs(name))
    text_ids = np.array([f"b{b:02d}" if b % 2 else np.str_(f"b{b:02d}") for b in BAGS], dtype=object)  # sorted as BAGS
    other = ESTIMATORS[name]().fit(X, text_ids, Y.astype(object), **_fit_kwargs(name))
    np.testing.assert_allclose(other.predict_bag_proba(X, text_ids, **_fit_kwargs(name))[1],
                               reference.predict_bag_proba(X, BAGS, **_fit_kwargs(name))[1], atol=1e-10)


BAD_PARAMS = {
    "max_iter": (2.5, r"max_iter must be an integer >= 1, got 2.5"),
    "n_mc_samples": (0, r"n_mc_samples must be an integer >= 1, got 0"),
    "kernel": ("rbf", r"kernel must be None \(chosen from the training bags\) or a kernel such as RBF\(4.0\), got 'rbf'"),
}


@pytest.mark.parametrize("name, param", [(name, param) for name in sorted(ESTIMATORS) for param in sorted(BAD_PARAMS)
                                          if {param, "n_mc_samples"} <= set(ESTIMATORS[name]().get_params())])
def test_a_bad_parameter_is_refused_at_fit_naming_it(name, param):
    """n_mc_samples=0 fitted and then failed in predict with a ZeroDivisionError (VWSGP: NaN std);
    kernel='rbf' with "'str' object has no attribute 'resolve'"; max_iter=2.5 ran."""
    value, message = BAD_PARAMS[param]
    with pytest.raises(ValueError, match=message):
        ESTIMATORS[name]().set_params(**{param: value}).fit(X, BAGS, Y, **_fit_kwargs(name))
    if "early_stopping" in ESTIMATORS[name]().get_params():
        with pytest.raises(ValueError, match=r"n_iter_no_change must be an integer >= 1, got 0"):
            ESTIMATORS[name]().set_params(early_stopping=True, n_iter_no_change=0).fit(X, BAGS, Y, **_fit_kwargs(name))
        few = BAGS < 4
        with pytest.raises(ValueError, match=r"early_stopping holds out validation_fraction=0.2 of the 4 bags \(\[2, 2\] negative/positive\)"):
            ESTIMATORS[name]().set_params(early_stopping=True).fit(X[few], BAGS[few], Y[few], **_fit_kwargs(name) and
                                                                   {"coords": COORDS[few]})


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_a_refit_keeps_no_fitted_attribute_of_the_earlier_fit(name):
    """A refit with other settings (early stopping off, no kernel learning …) kept attributes only
    the first fit set, e.g. best_iteration_ and validation_auc_ beside the new n_iter_."""
    estimator = ESTIMATORS[name]().fit(X, BAGS, Y, **_fit_kwargs(name))
    vars(estimator)["stale_"] = "from the first fit"
    estimator.fit(X, BAGS, Y, **_fit_kwargs(name))
    assert "stale_" not in vars(estimator)
    fresh = ESTIMATORS[name]().fit(X, BAGS, Y, **_fit_kwargs(name))
    assert set(vars(estimator)) == set(vars(fresh))


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_a_dataframe_fit_predicts_only_frames_with_its_columns_in_order(name):
    """Reordered DataFrame columns were read by position: other probabilities, no word. As in
    scikit-learn, a fit on named columns keeps feature_names_in_ and predictions check them."""
    frame = pd.DataFrame(X, columns=[f"f{j}" for j in range(X.shape[1])])
    estimator = ESTIMATORS[name]().fit(frame, BAGS, Y, **_fit_kwargs(name))
    assert estimator.feature_names_in_.tolist() == list(frame.columns)
    same = estimator.predict_bag_proba(frame, BAGS, **_fit_kwargs(name))[1]
    np.testing.assert_allclose(same, estimator.predict_bag_proba(X, BAGS, **_fit_kwargs(name))[1])  # arrays: by position
    with pytest.raises(ValueError, match=r"X's columns differ from those the model was fitted on: in another order"):
        estimator.predict_bag_proba(frame[frame.columns[::-1]], BAGS, **_fit_kwargs(name))
    with pytest.raises(ValueError, match=r"missing \['f0'\], not fitted on \['other'\]"):
        estimator.predict_bag_proba(frame.rename(columns={"f0": "other"}), BAGS, **_fit_kwargs(name))
    assert not hasattr(ESTIMATORS[name]().fit(X, BAGS, Y, **_fit_kwargs(name)), "feature_names_in_")
