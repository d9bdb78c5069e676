"""Bag-aware model selection: whole bags per fold, scikit-learn search tools, the papers' protocol."""

import numpy as np
import pytest
from conftest import make_toy_bags
from sklearn.model_selection import GridSearchCV, cross_validate
from sklearn.preprocessing import StandardScaler

from mil_core import GVGPMIL, RBF, VGPMIL
from mil_core.model_selection import (
    BagwiseClassifier,
    StratifiedBagKFold,
    bag_scorers,
    cross_validate_bags,
    grid_search_bags,
    with_bag_ids,
)

# A fixed kernel: these tests are about the search and scoring tools, and a default model's kernel
# choice (its own tests: test_defaults.py) would make each fit of every fold sixty times slower.
FAST = dict(kernel=RBF(variance=4.0, length_scale=1.0), n_inducing=8, max_iter=100, tol=1e-4, random_state=0)


def test_folds_hold_whole_bags_are_stratified_and_cover_every_bag():
    X, bags, y, _ = make_toy_bags(n_bags=30)
    seen = []
    for train, test in StratifiedBagKFold(5, random_state=0).split(X, y, bags):
        assert not set(bags[train]) & set(bags[test])
        test_bags = np.unique(bags[test])
        seen += list(test_bags)
        labels = np.array([y[bags == b][0] for b in test_bags])
        assert abs(labels.mean() - 0.5) <= 1 / 6 + 1e-12
    assert sorted(seen) == sorted(np.unique(bags))


def test_grid_search_cv_with_groups_selects_by_bag_accuracy():
    X, bags, y, _ = make_toy_bags(n_bags=30)
    search = GridSearchCV(
        BagwiseClassifier(GVGPMIL(**FAST), predict_kwargs={"method": "probit"}),
        {"estimator__alpha": [0.5, 1.0], "estimator__n_inducing": [4, 8]},
        cv=StratifiedBagKFold(3, random_state=0),
        scoring=bag_scorers(),
        refit="bag_accuracy",
    ).fit(with_bag_ids(X, bags), y, groups=bags)
    scores = search.cv_results_["mean_test_bag_accuracy"]
    assert search.best_index_ == int(np.argmax(scores))
    assert search.best_score_ == pytest.approx(scores.max())
    keys, p = search.best_estimator_.predict_bag_proba(with_bag_ids(X, bags))
    assert keys.shape == (30,) and np.all((p >= 0) & (p <= 1))


def test_cross_validate_scores_bags_not_instances():
    """A scorer per instance row would weight bags by their size; the bag scorers must not."""
    X, bags, y, _ = make_toy_bags(n_bags=30)
    model = BagwiseClassifier(VGPMIL(**FAST), predict_kwargs={"method": "probit"})
    cv = StratifiedBagKFold(3, random_state=0)
    result = cross_validate(model, with_bag_ids(X, bags), y, groups=bags, cv=cv, scoring=bag_scorers())
    for fold, (train, test) in enumerate(cv.split(X, y, bags)):
        fitted = model.fit(with_bag_ids(X[train], bags[train]), y[train])
        keys, p = fitted.predict_bag_proba(with_bag_ids(X[test], bags[test]))
        truth = np.array([y[bags == k][0] for k in keys])
        assert result["test_bag_accuracy"][fold] == pytest.approx(np.mean((p >= 0.5) == truth))


def test_minus_one_plus_one_labels_score_and_predict_in_their_own_convention():
    X, bags, y, _ = make_toy_bags(n_bags=30)
    cv, Xb = StratifiedBagKFold(3, random_state=0), with_bag_ids(X, bags)
    model = BagwiseClassifier(VGPMIL(**FAST))
    zero_one = cross_validate(model, Xb, y, groups=bags, cv=cv, scoring={**bag_scorers(), "row_accuracy": "accuracy"})
    signed = cross_validate(model, Xb, 2 * y - 1, groups=bags, cv=cv, scoring={**bag_scorers(), "row_accuracy": "accuracy"})
    for metric in ("test_bag_auc", "test_bag_accuracy", "test_bag_f1", "test_row_accuracy"):
        np.testing.assert_array_equal(signed[metric], zero_one[metric])
    fitted = model.fit(Xb, 2 * y - 1)
    assert fitted.classes_.tolist() == [-1, 1] and set(fitted.predict(Xb)) <= {-1, 1}


def test_paper_protocol_grid_reports_the_configuration_with_the_best_bag_accuracy():
    X, bags, y, _ = make_toy_bags(n_bags=30)
    best, rows = grid_search_bags(
        GVGPMIL(**FAST, early_stopping=True, n_iter_no_change=3), {"alpha": [0.5, 1.0], "beta": [1.0, 4.0]},
        X, bags, y, n_splits=3, predict_kwargs={"method": "probit"},
    )
    assert len(rows) == 4
    assert best["mean_bag_accuracy"] == max(r["mean_bag_accuracy"] for r in rows)
    assert {"alpha", "beta", "mean_bag_auc", "std_bag_f1", "mean_fit_time"} <= set(best)


def test_train_scores_are_the_fitted_model_scored_on_its_own_training_bags():
    X, bags, y, _ = make_toy_bags(n_bags=30)
    folds = cross_validate_bags(VGPMIL(**FAST), X, bags, y, n_splits=3, predict_kwargs={"method": "probit"}, return_train_score=True)
    for fold, (train, _) in zip(folds, StratifiedBagKFold(3, random_state=0).split(X, y, bags)):
        scaler = StandardScaler().fit(X[train])
        keys, p = VGPMIL(**FAST).fit(scaler.transform(X[train]), bags[train], y[train]).predict_bag_proba(
            scaler.transform(X[train]), bags[train], method="probit")
        truth = np.array([y[bags == k][0] for k in keys])
        assert fold["train_bag_accuracy"] == pytest.approx(np.mean((p >= 0.5) == truth))
        assert {"bag_auc", "train_bag_auc", "train_bag_f1"} <= set(fold)
    assert "train_bag_auc" not in cross_validate_bags(VGPMIL(**FAST), X, bags, y, n_splits=3)[0]


def test_a_near_constant_column_is_left_unscaled_not_blown_up_to_unit_variance():
    """Public MIL tables hold columns with std ≈ 1e-17: z-scoring them turns rounding noise into a
    feature of full weight. Below 1e-12 the column keeps scale 1, so it changes nothing."""
    X, bags, y, _ = make_toy_bags(n_bags=30)
    noise = np.random.default_rng(1).normal(0.0, 1e-17, size=(X.shape[0], 1))
    model = VGPMIL(kernel=RBF(variance=4.0, length_scale=2.0), n_inducing=8, max_iter=15, random_state=0)
    plain = cross_validate_bags(model, X, bags, y, n_splits=3)
    padded = cross_validate_bags(model, np.hstack([X, noise]), bags, y, n_splits=3)
    assert [f["bag_auc"] for f in padded] == pytest.approx([f["bag_auc"] for f in plain], abs=1e-9)
    adapter = BagwiseClassifier(model).fit(with_bag_ids(np.hstack([X, noise]), bags), y)
    assert adapter.scale_[-1] == 1.0 and np.all(adapter.scale_[:-1] > 1e-3)


def test_adapter_rejects_features_without_the_bag_id_column():
    X, bags, y, _ = make_toy_bags(n_bags=10)
    with pytest.raises(ValueError, match="with_bag_ids"):
        BagwiseClassifier(VGPMIL(**FAST)).fit(X[:, :1], y)
