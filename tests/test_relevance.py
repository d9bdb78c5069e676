"""Per-feature length scales from the bag labels (``mil_core.relevance``) and the automatic kernel
choice that tries them (``VGPMIL._refined_candidates``)."""

import warnings

import numpy as np
import pytest
from scipy.stats import rankdata
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import roc_auc_score

import mil_core.models.base as base
from mil_core import VGPMIL
from mil_core.bags import BagIndex
from mil_core.metrics import binary_auc, column_aucs, ranked_aucs
from mil_core.relevance import RELEVANCE_FORMS, feature_evidence, relevance_length_scales

from conftest import bag_labels, make_toy_bags


def _sorted(X, bags, y):
    index = BagIndex.from_ids(bags)
    return X[index.order], index.offsets, y[index.order][index.offsets[:-1]]


def test_column_aucs_are_the_auc_of_each_column():
    rng = np.random.default_rng(0)
    labels, scores = rng.integers(0, 2, 30), rng.normal(size=(30, 4))
    scores[:, 2] = np.round(scores[:, 2])  # ties count one half
    np.testing.assert_allclose(column_aucs(labels, scores), [roc_auc_score(labels, s) for s in scores.T], rtol=1e-12)
    assert binary_auc(labels, scores[:, 1]) == roc_auc_score(labels, scores[:, 1])
    shuffled = rng.permutation(labels)  # several labellings of one ranking: one row each
    np.testing.assert_allclose(ranked_aucs(rankdata(scores, axis=0), np.column_stack([labels, shuffled])),
                               [column_aucs(labels, scores), column_aucs(shuffled, scores)], rtol=1e-12)


def test_the_feature_that_carries_the_witness_gets_the_shortest_length_scale():
    """One informative feature of 30: its evidence stands out, its length scale is the shortest,
    the mean squared weight is 1 (ℓ = √D keeps its meaning); a constant column and every feature
    at or below the median evidence get no weight (the floor, ℓ = 1000 √D)."""
    X, bags, y, _ = make_toy_bags(n_bags=60, n_features=30, seed=1)
    X[:, 5] = 0.0
    X_sorted, offsets, labels = _sorted(X, bags, y)
    z = feature_evidence(X_sorted, offsets, labels)
    assert z.argmax() == 0 and z[0] > 4 * np.median(z) and z[5] == 0.0
    ell = np.array(relevance_length_scales(X_sorted, offsets, labels))
    assert ell.argmin() == 0 and ell[5] == np.sqrt(30) * 1e3
    np.testing.assert_array_equal(ell == np.sqrt(30) * 1e3, z <= np.median(z))
    np.testing.assert_allclose(np.mean((np.sqrt(30) / ell) ** 2), 1.0, rtol=1e-5)


def test_evidence_that_bag_size_gives_every_feature_carries_no_weight():
    """Positive bags 8 instances larger: the maximum and minimum of every feature now tell the
    labels apart (median z above 3), and the weights still go to the witness's feature — most of
    Σ w² on feature 0, where weights proportional to z would give it about a tenth."""
    X, bags, y, _ = make_toy_bags(n_bags=60, n_features=30, seed=3)
    extra = np.repeat(np.unique(bags[y == 1]), 8)
    X = np.vstack([X, np.random.default_rng(3).normal(size=(extra.size, 30))])
    bags, y = np.r_[bags, extra], np.r_[y, np.ones(extra.size, dtype=y.dtype)]
    X_sorted, offsets, labels = _sorted(X, bags, y)
    z = feature_evidence(X_sorted, offsets, labels)
    assert np.median(z) > 3 and z[0] ** 2 / np.sum(z**2) < 0.15
    weights = np.sqrt(30) / np.array(relevance_length_scales(X_sorted, offsets, labels))
    assert weights[0] ** 2 / np.sum(weights**2) > 0.5


def test_without_a_feature_that_stands_out_every_feature_is_weighed_in_proportion():
    """Features unrelated to the labels: the top feature's excess over the median evidence is one
    that label permutations reach, so no feature is dropped — ``w = z / rms(z)``, the same for the
    same bags."""
    X, bags, y, _ = make_toy_bags(n_bags=60, n_features=30, seed=4)
    X = np.random.default_rng(4).normal(size=X.shape)
    X_sorted, offsets, labels = _sorted(X, bags, y)
    z = feature_evidence(X_sorted, offsets, labels)
    ell = relevance_length_scales(X_sorted, offsets, labels)
    np.testing.assert_allclose(np.sqrt(30) / np.array(ell), z / np.sqrt(np.mean(z**2)), rtol=1e-12)
    assert relevance_length_scales(X_sorted, offsets, labels) == ell


def test_the_proportional_form_weighs_every_feature_by_its_evidence_even_where_one_stands_out():
    """``form="proportional"``: ``w = z / rms(z)`` whatever the permutations say — on bags where one
    feature stands out (so the default form sharpens) every informative feature keeps its share; an
    unknown form is refused by name."""
    X, bags, y, _ = make_toy_bags(n_bags=60, n_features=30, seed=1)
    X_sorted, offsets, labels = _sorted(X, bags, y)
    z = feature_evidence(X_sorted, offsets, labels)
    proportional = np.sqrt(30) / np.array(relevance_length_scales(X_sorted, offsets, labels, "proportional"))
    np.testing.assert_allclose(proportional, z / np.sqrt(np.mean(z**2)), rtol=1e-12)
    assert not np.allclose(relevance_length_scales(X_sorted, offsets, labels, "sharpened"), np.sqrt(30) / proportional)
    with pytest.raises(ValueError, match="form must be one of proportional, sharpened, got 'sharp'"):
        relevance_length_scales(X_sorted, offsets, labels, "sharp")


def test_equal_evidence_everywhere_is_the_isotropic_kernel():
    """Features that are copies of one another carry equal evidence: every ℓ_d = √D."""
    X, bags, y, _ = make_toy_bags(n_bags=30, n_features=1, seed=2)
    X_sorted, offsets, labels = _sorted(np.repeat(X, 4, axis=1), bags, y)
    np.testing.assert_allclose(relevance_length_scales(X_sorted, offsets, labels), [2.0] * 4, rtol=1e-12)


def test_the_choice_weighs_one_informative_feature_among_many_and_each_split_by_its_own_training_half(monkeypatch):
    """Sixty features, one informative: the default chooses the relevance kernel (its shortest
    length scale on feature 0) and ranks new bags better than the isotropic kernel of its first
    stage. The choice computes each split's weights from that split's training half only (half
    the bags), the final kernel's from all of them."""
    X, bags, y, _ = make_toy_bags(n_bags=60, n_features=60, seed=1)
    X_new, bags_new, y_new, _ = make_toy_bags(n_bags=60, n_features=60, seed=2)
    calls = []
    real = base.relevance_weightings
    monkeypatch.setattr(base, "relevance_weightings", lambda X_, offsets, labels: calls.append(offsets.size - 1) or real(X_, offsets, labels))
    model = VGPMIL(n_inducing=20, random_state=0).fit(X, bags, y)
    assert np.ndim(model.kernel_.length_scale) == 1 and int(np.argmin(model.kernel_.length_scale)) == 0
    assert [setting.get("relevance") for setting, _ in model.setting_selection_[-2:]] == list(RELEVANCE_FORMS)
    assert set(calls[:-1]) == {30} and calls[-1] == 60
    with warnings.catch_warnings():  # the chosen number of sweeps, not a convergence
        warnings.simplefilter("ignore", ConvergenceWarning)
        isotropic = VGPMIL(n_inducing=20, random_state=0, kernel=type(model.kernel_)(variance=model.kernel_.variance),
                           H=model.H_, max_iter=model.auto_max_iter_ or model.max_iter).fit(X, bags, y)
    truth = bag_labels(bags_new, y_new)
    weighed_auc = roc_auc_score(truth, model.predict_bag_proba(X_new, bags_new)[1])
    assert weighed_auc > roc_auc_score(truth, isotropic.predict_bag_proba(X_new, bags_new)[1]) and weighed_auc > 0.95


def test_relevance_forms_that_coincide_on_a_split_share_one_fit(monkeypatch, relevance_weightings):
    """The choice tries each relevance form at each variance near the chosen one, but where a
    split's forms give the same length scales (no feature stands out there) it fits them once:
    the relevance fits per split are its distinct weightings × those variances. With one
    informative feature every split sharpens (two fits per variance); with none, most do not."""
    fits = []
    real = VGPMIL._make_updates
    monkeypatch.setattr(VGPMIL, "_make_updates", lambda self, gp: fits.append(
        (gp.kernel.variance, np.ndim(gp.kernel.length_scale))) or real(self, gp))
    X, bags, y, _ = make_toy_bags(n_bags=60, n_features=30, seed=1)
    noise = np.random.default_rng(4).normal(size=X.shape)
    halves = []
    for features in (X, noise):
        fits.clear()
        with warnings.catch_warnings():  # 10 sweeps: a short fit, not a convergence
            warnings.simplefilter("ignore", ConvergenceWarning)
            VGPMIL(n_inducing=10, max_iter=10, random_state=0).fit(features, bags, y)
        weighed = [v for v, ndim in fits[:-1] if ndim == 1]
        halves.append(relevance_weightings(60))  # this fit's six split halves
        assert len(halves[-1]) == 6 and len(weighed) == sum(halves[-1]) * len(set(weighed))
    assert halves[0] == [2] * 6 and sum(halves[1]) < 12


def test_the_weights_do_not_depend_on_rounding_in_the_standardisation():
    """Integer features (MUSK's, counts, pixel values) give bag means that are equal in exact
    arithmetic; ranked by their last bits, two equivalent standardisations — the pipeline's and
    ``fit``'s — gave length scales 14 % (proportional) to 30× (sharpened) apart on MUSK1."""
    from mil_core.metrics import tie_aware_ranks
    from mil_core.relevance import relevance_weightings

    rng = np.random.default_rng(4)
    sizes = rng.integers(2, 7, size=60)
    bags = np.repeat(np.arange(60), sizes)
    X = rng.integers(0, 4, size=(bags.size, 12)).astype(float)
    y = np.repeat(np.arange(60) % 2, sizes)
    X[y == 1, 0] += rng.integers(0, 2, size=int((y == 1).sum()))  # a feature with evidence
    mean, std = X.mean(axis=0), X.std(axis=0)
    one, other = _sorted((X - mean) / std, bags, y), _sorted((X - mean) * (1.0 / std), bags, y)
    assert not np.array_equal(one[0], other[0])  # the two differ in last bits
    assert relevance_weightings(*one) == relevance_weightings(*other)
    np.testing.assert_array_equal(tie_aware_ranks(np.array([[1.0, 3.0], [1.0 + 1e-15, 2.0], [0.5, 2.0], [2.0, 1.0]])),
                                  [[2.5, 4.0], [2.5, 2.5], [1.0, 2.5], [4.0, 1.0]])
