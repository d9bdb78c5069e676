"""The automatic defaults of issue 15: kernel variance and stopping chosen from the training bags,
damped q(y) updates that converge with H = 1e12, and a bag rule whose ranking does not follow
bag size. Accuracy numbers belong in ``benchmarks/bench_accuracy.py``; these are fast checks."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from scipy.stats import spearmanr
from sklearn.base import clone
from sklearn.exceptions import ConvergenceWarning
from sklearn.metrics import roc_auc_score

from mil_core import GVGPMIL, RBF, VGPMIL, VGPMILPR, VWSGP, VGPMILPRGibbs
from mil_core.bags import BAG_RULES, bag_score
from mil_core.metrics import binary_auc, chance_auc_std
from mil_core.models.base import AUTO_VARIANCES, best_candidate, choice_bags, clearly_better_rule
from mil_core.models.vgpmil import AUTO_H, LARGE_BAGS, VGPMIL_VARIANCES, PsiVGPMIL

from tests.conftest import make_toy_bags


def _split(X, bags, y, inst):
    train = bags < bags.max() // 2 + 1
    return (X[train], bags[train], y[train]), (X[~train], bags[~train], y[~train], inst[~train])


@pytest.mark.parametrize("model", [VGPMIL(random_state=0), GVGPMIL(random_state=0), VWSGP(random_state=0), VGPMILPR(random_state=0)],
                         ids=lambda m: type(m).__name__)
def test_defaults_are_well_above_chance_on_held_out_bags(model):
    X, bags, y, inst = make_toy_bags(n_bags=60, n_features=3, seed=1)
    (Xtr, btr, ytr), (Xte, bte, yte, _) = _split(X, bags, y, inst)
    fitted = clone(model).fit(Xtr, btr, ytr)
    keys, p = fitted.predict_bag_proba(Xte, bte)[:2]
    truth = np.array([yte[bte == k][0] for k in keys])
    assert roc_auc_score(truth, p) > 0.8


def test_kernel_none_chooses_variance_and_stopping_on_training_bags_and_leaves_params_alone(toy_bags):
    X, bags, y, _ = toy_bags
    model = VGPMIL(n_inducing=10, random_state=0)
    model.fit(X, bags, y)
    assert model.kernel is None and model.max_iter == 200  # parameters untouched (scikit-learn)
    np.testing.assert_array_equal(model.kernel_selection_[:, 0], VGPMIL_VARIANCES)
    assert np.all((model.kernel_selection_[:, 1] >= 0) & (model.kernel_selection_[:, 1] <= 1))
    assert model.kernel_.variance in VGPMIL_VARIANCES
    assert model.auto_max_iter_ is None or 1 <= model.n_iter_ <= model.auto_max_iter_
    again = VGPMIL(n_inducing=10, random_state=0).fit(X, bags, y)  # deterministic given the seed
    np.testing.assert_array_equal(again.q_.mean, model.q_.mean)
    fixed = VGPMIL(n_inducing=10, kernel=RBF(2.0), random_state=0).fit(X, bags, y)
    assert fixed.kernel_.variance == 2.0 and fixed.kernel_selection_.shape == (0, 2) and fixed.auto_max_iter_ is None


def test_h_auto_tries_each_h_beside_every_variance_then_the_constant_kernel_at_the_chosen_one(monkeypatch, relevance_weightings):
    """``H="auto"``: every split fits each (variance, H) candidate, then (the second stage) b = v
    with each H at the variance that first stage chose; ``H_`` and ``kernel_`` are the best point's,
    ``kernel_selection_`` is under the first stage's H, and the final fit is the fixed-parameter
    fit at the chosen kernel, H and sweeps. On these bags 1e12 scores higher than the fallback 100."""
    X, bags, y, _ = make_toy_bags(n_bags=24, n_features=2, seed=3)
    seen = []
    real = VGPMIL._make_updates
    monkeypatch.setattr(VGPMIL, "_make_updates", lambda self, gp: seen.append(
        (self.H_, gp.kernel.variance, gp.kernel.bias, np.ndim(gp.kernel.length_scale) == 1)) or real(self, gp))
    model = VGPMIL(n_inducing=10, random_state=0).fit(X, bags, y)
    assert model.H == "auto" and model.H_ in AUTO_H
    first = [h for h, _, b, weighed in seen[:-1] if b == 0.0 and not weighed]
    second = [(h, v, b) for h, v, b, _ in seen[:-1] if b > 0.0]
    weighed = [(h, v) for h, v, _, w in seen[:-1] if w]
    assert first.count(AUTO_H[0]) == first.count(AUTO_H[1]) == 6 * len(VGPMIL_VARIANCES)
    assert seen[-1][:3] == (model.H_, model.kernel_.variance, model.kernel_.bias)
    assert len(second) == 6 * len(AUTO_H) and len({v for _, v, _ in second}) == 1 and all(b == v for _, v, b in second)
    chosen_first = second[0][1]  # the relevance kernel: the first stage's H, its variance and the grid neighbours
    i = VGPMIL_VARIANCES.index(chosen_first)
    per_variance = sum(relevance_weightings(24))  # each split half's distinct relevance weightings, one fit each
    assert sorted(weighed) == sorted((1e12, v) for v in VGPMIL_VARIANCES[max(i - 1, 0): i + 2] for _ in range(per_variance))
    settings, aucs = zip(*model.setting_selection_)
    assert list(settings) == [{"H": 100.0}, {"H": 1e12}, {"H": 100.0, "kernel_bias": 1.0}, {"H": 1e12, "kernel_bias": 1.0},
                              {"H": 1e12, "relevance": "proportional"}, {"H": 1e12, "relevance": "sharpened"}]
    assert aucs[1] > aucs[0] and aucs[1] == np.nanmax(model.kernel_selection_[:, 1])  # the first stage chose 1e12
    sweeps = model.auto_max_iter_ or model.max_iter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        fixed = VGPMIL(n_inducing=10, kernel=model.kernel_, H=model.H_, max_iter=sweeps, random_state=0).fit(X, bags, y)
    np.testing.assert_allclose(fixed.q_.mean, model.q_.mean, rtol=1e-10, atol=1e-12)


def _large_bags(n_bags: int, size: tuple[int, int], seed: int = 0):
    """Bags of ``size`` instances (negatives ~ N(0, I); every other bag positive, with 1–3 at 3·e₁)."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(*size, size=n_bags)
    X = rng.normal(size=(sizes.sum(), 2))
    bags, y = np.repeat(np.arange(n_bags), sizes), np.repeat(np.arange(n_bags) % 2, sizes)
    starts = np.r_[0, np.cumsum(sizes)[:-1]]
    for b in range(1, n_bags, 2):
        X[starts[b]: starts[b] + int(rng.integers(1, 4)), 0] += 3.0
    return X, bags, y


def test_in_large_bags_h_auto_tries_the_hard_likelihood_only_with_the_constant_kernel(monkeypatch):
    """Where the choice's median bag holds ``LARGE_BAGS`` instances or more, no candidate of
    ``H="auto"`` fits H = 1e12 without b = v (docs/BENCHMARKS.md, session 29); the same instances
    in bags of half the size are chosen from as before, every (variance, H) with b = 0 first."""
    X, bags, y = _large_bags(16, (LARGE_BAGS, LARGE_BAGS + 30))
    seen = []
    real = VGPMIL._make_updates

    def spy(self, gp):
        if np.ndim(gp.kernel.length_scale) == 0:  # the relevance kernel's fits are not what this test counts
            seen.append((self.H_, gp.kernel.bias))
        return real(self, gp)

    monkeypatch.setattr(VGPMIL, "_make_updates", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        large = VGPMIL(n_inducing=10, max_iter=10, random_state=0).fit(X, bags, y)
        tried_large, seen[:] = list(seen), []
        halves = 2 * bags + (np.arange(bags.size) % 2)  # every bag split in two: median 50–65
        small = VGPMIL(n_inducing=10, max_iter=10, random_state=0).fit(X, halves, y)
        tried_small = list(seen)
    assert (1e12, 0.0) not in tried_large
    assert tried_large[:-1].count((100.0, 0.0)) == 6 * len(VGPMIL_VARIANCES)  # the first stage's other setting
    assert [s for s, _ in large.setting_selection_][:3] == [{"H": 100.0}, {"H": 1e12, "kernel_bias": 1.0}, {"H": 100.0, "kernel_bias": 1.0}]
    if large.H_ == 1e12:
        assert large.kernel_.bias == large.kernel_.variance
    assert tried_small[:-1].count((1e12, 0.0)) == 6 * len(VGPMIL_VARIANCES)
    assert [s for s, _ in small.setting_selection_][:2] == [{"H": 100.0}, {"H": 1e12}]


H_AUTO, B = ({"H": 100.0}, {"H": 1e12}), {"kernel_bias": 1.0}


@pytest.mark.parametrize("model, plain, large", [
    (VGPMIL(), H_AUTO, ({"H": 100.0}, {"H": 1e12, **B})), (GVGPMIL(), ({},), (B,)), (VGPMIL(H=1e12), ({},), (B,)),
    (VGPMIL(H=100.0), ({},), ({},)), (PsiVGPMIL(), H_AUTO, H_AUTO), (VGPMIL(learn_kernel=True), H_AUTO, H_AUTO),
    (GVGPMIL(learn_psi=True), ({},), ({},)),
], ids=["VGPMIL", "GVGPMIL", "fixed-hard-H", "fixed-soft-H", "psi-no-constant-kernel", "learnt-kernel", "learnt-psi"])
def test_in_large_bags_the_hard_likelihood_is_tried_with_the_constant_kernel_where_one_is_on_offer(model, plain, large):
    """The first stage's settings of each model; the choice's median bag size decides."""
    assert model._auto_settings(np.array([3, 8, 5000])) == plain  # median 8
    assert model._auto_settings(np.array([LARGE_BAGS - 1] * 3 + [10**4])) == plain
    assert model._auto_settings(np.array([2, LARGE_BAGS, LARGE_BAGS])) == large


def test_gvgpmil_in_large_bags_fits_every_candidate_with_the_constant_kernel(monkeypatch):
    """G-VGPMIL's one H is the hard one: in large bags each variance is tried with b = v, and the
    second stage has nothing left to add."""
    X, bags, y = _large_bags(16, (LARGE_BAGS, LARGE_BAGS + 30))
    seen = []
    real = GVGPMIL._make_updates
    monkeypatch.setattr(GVGPMIL, "_make_updates", lambda self, gp: seen.append(
        (gp.kernel.variance, gp.kernel.bias, np.ndim(gp.kernel.length_scale) == 1)) or real(self, gp))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model = GVGPMIL(n_inducing=10, max_iter=10, random_state=0).fit(X, bags, y)
    isotropic = [(v, b) for v, b, weighed in seen[:-1] if not weighed]
    assert len(isotropic) == 6 * len(model._auto_variances()) and all(b == v for v, b, _ in seen)
    assert model.kernel_.bias == model.kernel_.variance
    assert [s for s, _ in model.setting_selection_] == [B, {**B, "relevance": "proportional"}, {**B, "relevance": "sharpened"}]  # the second stage: the relevance kernel only


class _Renamed(VGPMIL):
    """The second stage offers the first stage's point twice: as it is, and with b = 0 spelled out."""

    fits = 0

    def _refined_candidates(self, variance, setting, settings):
        return ((variance, setting), (variance, {**setting, "kernel_bias": 0.0}))

    def _make_updates(self, gp):
        type(self).fits += 1
        return super()._make_updates(gp)


class _FirstStageOnly(VGPMIL):
    def _refined_candidates(self, variance, setting, settings):
        return ()


def test_the_second_stage_keeps_the_first_stages_point_on_a_tie_and_refits_nothing_already_fitted(toy_bags):
    """A second-stage candidate that is the first stage's point under another name scores the same
    on every split and is not chosen; one the first stage already fitted is not fitted again."""
    X, bags, y, _ = toy_bags
    _Renamed.fits = 0  # counted per run of this test
    renamed = _Renamed(n_inducing=10, random_state=0).fit(X, bags, y)
    plain = _FirstStageOnly(n_inducing=10, random_state=0).fit(X, bags, y)
    assert _Renamed.fits == 6 * len(VGPMIL_VARIANCES) * len(AUTO_H) + 6 + 1  # one new candidate per split, then the final fit
    assert renamed.kernel_ == plain.kernel_ and renamed.H_ == plain.H_ and renamed.auto_max_iter_ == plain.auto_max_iter_
    np.testing.assert_array_equal(renamed.kernel_selection_, plain.kernel_selection_)
    np.testing.assert_array_equal(renamed.q_.mean, plain.q_.mean)
    (spelled_out, auc), = renamed.setting_selection_[len(plain.setting_selection_):]
    assert spelled_out == {"H": plain.H_, "kernel_bias": 0.0} and auc == np.nanmax(plain.kernel_selection_[:, 1])


def test_h_auto_with_a_fixed_kernel_is_100_and_gvgpmil_keeps_the_papers_h(toy_bags):
    X, bags, y, _ = toy_bags
    fixed = VGPMIL(n_inducing=10, kernel=RBF(2.0), max_iter=5, random_state=0).fit(X, bags, y)
    assert fixed.H_ == 100.0 and fixed.setting_selection_ == []
    gv = GVGPMIL(n_inducing=10, max_iter=10, random_state=0).fit(X, bags, y)
    assert gv.H == 1e12 and gv.H_ == 1e12  # one H: nothing to choose but the constant kernel


def test_gvgpmil_tries_the_constant_kernel_at_the_chosen_variance_and_its_neighbours_and_fits_the_chosen_one(monkeypatch, relevance_weightings):
    """G-VGPMIL's ``kernel=None``: every split fits each variance with b = 0, then b = v at the
    chosen variance and its neighbours on the grid; ``kernel_.bias`` is the best point's,
    ``setting_selection_`` holds each setting's best mean held-out AUC, and the final fit is the
    fixed-parameter fit at the chosen kernel and sweeps."""
    X, bags, y, _ = make_toy_bags(n_bags=24, n_features=2, seed=3)
    seen = []
    real = GVGPMIL._make_updates
    monkeypatch.setattr(GVGPMIL, "_make_updates", lambda self, gp: seen.append(
        (gp.kernel.variance, gp.kernel.bias / gp.kernel.variance, np.ndim(gp.kernel.length_scale) == 1)) or real(self, gp))
    model = GVGPMIL(n_inducing=10, random_state=0).fit(X, bags, y)
    grid = model._auto_variances()
    assert [v for v, ratio, weighed in seen[:-1] if ratio == 0.0 and not weighed] == [v for _ in range(6) for v in grid]
    second = sorted({v for v, ratio, _ in seen[:-1] if ratio == 1.0})
    weighed = sorted({v for v, ratio, w in seen[:-1] if w and ratio == 0.0})  # the relevance kernel, at the same variances
    i = grid.index(second[0])
    assert second == list(grid[i : i + len(second)]) and len(second) in (2, 3) and weighed == second
    assert len(seen) - 1 == 6 * (len(grid) + len(second)) + sum(relevance_weightings(24)) * len(second)
    assert seen[-1] == (model.kernel_.variance, model.kernel_.bias / model.kernel_.variance, np.ndim(model.kernel_.length_scale) == 1)
    settings, aucs = zip(*model.setting_selection_)
    assert list(settings) == [{}, {"kernel_bias": 1.0}, {"relevance": "proportional"}, {"relevance": "sharpened"}]
    assert np.nanmax(model.kernel_selection_[:, 1]) == aucs[0]  # under the first stage's setting
    sweeps = model.auto_max_iter_ or model.max_iter
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        fixed = GVGPMIL(n_inducing=10, kernel=model.kernel_, max_iter=sweeps, random_state=0).fit(X, bags, y)
    np.testing.assert_allclose(fixed.q_.mean, model.q_.mean, rtol=1e-10, atol=1e-12)


def test_with_the_constant_kernel_far_from_the_data_the_latent_reverts_to_a_learnt_shift_not_to_zero(toy_bags):
    """What ``RBF(v, bias=b)`` is for: most instances are negative, so the fit learns a negative
    shift shared by every latent; an instance far from every training row gets that shift (and
    the prior variance v + b less what the data told about it), where the RBF alone gives 0 and
    variance v, i.e. π = ½."""
    X, bags, y, _ = toy_bags
    far = np.full((1, X.shape[1]), 1e3)
    plain = VGPMIL(n_inducing=10, kernel=RBF(4.0), random_state=0).fit(X, bags, y)
    shifted = VGPMIL(n_inducing=10, kernel=RBF(4.0, bias=4.0), random_state=0).fit(X, bags, y)
    (m0,), (v0,) = plain.predict_latent(far)
    (m1,), (v1,) = shifted.predict_latent(far)
    assert abs(m0) < 1e-9 and v0 == pytest.approx(4.0)
    assert m1 < -0.5 and 4.0 < v1 < 8.0
    assert shifted.predict_instance_proba(far)[0] < 0.4 < plain.predict_instance_proba(far)[0]


def test_the_constant_kernel_is_not_a_candidate_when_hyper_parameters_are_learnt(toy_bags):
    """The ELBO gradients of ``learn_kernel`` / ``learn_inducing`` / ``learn_psi`` take the RBF
    alone: ``kernel=None`` then chooses without the constant kernel, and a kernel with one is
    refused by name."""
    X, bags, y, _ = toy_bags
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        learnt = GVGPMIL(n_inducing=10, learn_kernel=True, max_iter=5, random_state=0).fit(X, bags, y)
        psi = GVGPMIL(n_inducing=10, learn_psi=True, max_iter=5, random_state=0).fit(X, bags, y)
    assert learnt.setting_selection_ == [] and psi.setting_selection_ == []
    assert learnt.kernel_.bias == 0.0 and psi.kernel_.bias == 0.0
    with pytest.raises(ValueError, match=r"learn_kernel: hyper-parameter learning takes an RBF without a constant term \(bias=0\), got bias=2"):
        VGPMIL(n_inducing=10, kernel=RBF(2.0, bias=2.0), learn_kernel=True, max_iter=2).fit(X, bags, y)


def test_without_two_bags_of_each_class_the_kernel_is_the_middle_of_the_grid(toy_bags):
    """The choice needs two bags of each class; without them the variance is the middle of the
    model's grid (the lower of two): 4 for VGPMIL's five and VGPMILPR's four, ⅛ for G-VGPMIL's."""
    X, bags, y, _ = toy_bags
    keep = np.isin(bags, [*np.unique(bags[y == 0]), np.unique(bags[y == 1])[0]])  # one positive bag
    X, bags, y = X[keep], bags[keep], y[keep]
    for model, variance in ((VGPMIL(), 4.0), (VGPMILPR(), 4.0), (GVGPMIL(), 0.125)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.set_params(n_inducing=10, max_iter=3, random_state=0).fit(X, bags, y)
        assert model.kernel_.variance == variance and model.kernel_selection_.shape == (0, 2), type(model).__name__


@pytest.mark.parametrize("H", [1.0, 0.5, -3, "big", None])
def test_h_must_be_auto_or_above_one(H, toy_bags):
    X, bags, y, _ = toy_bags
    with pytest.raises(ValueError, match="H must be 'auto' or a number > 1"):
        VGPMIL(H=H, max_iter=2).fit(X, bags, y)


def _consecutive_bag_scores(model, X, bags, y, n_iter):
    """Bag scores after ``n_iter`` and ``n_iter + 1`` sweeps of the same deterministic fit."""
    scores = []
    for it in (n_iter, n_iter + 1):
        fitted = clone(model).set_params(max_iter=it, tol=0.0).fit(X, bags, y)
        scores.append(fitted.predict_bag_proba(X, bags, method="probit", rule="max")[1])
    return np.abs(scores[1] - scores[0]).max()


@pytest.mark.parametrize("emax", ["max", "exact"])
def test_damped_updates_converge_with_huge_h_where_undamped_ones_cycle(emax):
    """Two strong witnesses per positive bag: undamped, they swap "the positive one" every sweep."""
    rng = np.random.default_rng(0)
    X, bags, y = [], [], []
    for b in range(30):
        x = rng.normal(size=(6, 2))
        if b % 2:
            x[:2, 0] += 3.0
        X.append(x); bags += [b] * 6; y += [b % 2] * 6
    X, bags, y = np.concatenate(X), np.array(bags), np.array(y)
    base = VGPMIL(n_inducing=10, kernel=RBF(4.0), H=1e12, emax=emax, random_state=0)
    if emax == "max":  # the failure the damping removes is real on this set
        assert _consecutive_bag_scores(base.set_params(damping=0.0), X, bags, y, 60) > 0.05
    assert _consecutive_bag_scores(base.set_params(damping=0.5), X, bags, y, 60) < 1e-3


def _size_anti_predictive_bags(seed=0, shift=5.0):
    """Negative bags are large (40–60 instances), positive bags small (4–8) with one witness."""
    rng = np.random.default_rng(seed)
    X, bags, y, inst = [], [], [], []
    for b in range(40):
        label = b % 2
        size = int(rng.integers(4, 9)) if label else int(rng.integers(40, 61))
        x = rng.normal(size=(size, 2))
        x[:label, 0] += shift
        X.append(x); bags += [b] * size; y += [label] * size; inst += [1] * label + [0] * (size - label)
    return np.concatenate(X), np.array(bags), np.array(y), np.array(inst)


def test_default_bag_rule_does_not_follow_bag_size_where_size_is_anti_predictive():
    X, bags, y, inst = _size_anti_predictive_bags()
    model = VGPMIL(n_inducing=10, random_state=0).fit(X, bags, y)
    Xte, bte, yte, _ = _size_anti_predictive_bags(seed=1)
    keys, p_default = model.predict_bag_proba(Xte, bte, method="probit")
    _, p_noisy_or = model.predict_bag_proba(Xte, bte, method="probit", rule="noisy_or")
    truth = np.array([yte[bte == k][0] for k in keys])
    sizes = np.array([np.sum(bte == k) for k in keys])
    assert roc_auc_score(truth, p_default) > 0.9
    assert roc_auc_score(truth, p_default) > roc_auc_score(truth, p_noisy_or) + 0.1
    negatives = truth == 0  # within a class, the default score hardly follows size; noisy-OR does
    assert spearmanr(p_noisy_or[negatives], sizes[negatives])[0] > abs(spearmanr(p_default[negatives], sizes[negatives])[0])


def test_bag_rules_on_known_probabilities():
    p = np.r_[np.full(19, 0.1), 0.9, np.full(40, 0.2)]
    offsets = np.array([0, 20, 60])
    np.testing.assert_allclose(bag_score(p, offsets, "max"), [0.9, 0.2])
    np.testing.assert_allclose(bag_score(p, offsets, "mean"), [(19 * 0.1 + 0.9) / 20, 0.2])
    np.testing.assert_allclose(bag_score(p, offsets, "top_fraction"), [0.9, 0.2])  # top 1 of 20, top 2 of 40
    np.testing.assert_allclose(bag_score(p, offsets, "noisy_or"), [1 - 0.9**19 * 0.1, 1 - 0.8**40])
    columns = np.c_[p, p[::-1]]  # Monte Carlo columns are scored independently
    for rule in BAG_RULES:
        np.testing.assert_allclose(bag_score(columns, offsets, rule)[:, 0], bag_score(p, offsets, rule))
    with pytest.raises(ValueError, match="unknown bag rule"):
        bag_score(p, offsets, "median")


def test_estimator_rule_is_used_by_default_and_std_matches_it(toy_bags):
    X, bags, y, _ = toy_bags
    model = VGPMIL(n_inducing=10, kernel=RBF(4.0), max_iter=20, bag_rule="mean", n_mc_samples=4000, random_state=0).fit(X, bags, y)
    _, p_default, sd = model.predict_bag_proba(X, bags, method="probit", return_std=True)
    _, p_mean = model.predict_bag_proba(X, bags, method="probit", rule="mean")
    np.testing.assert_array_equal(p_default, p_mean)
    _, p_mc = model.predict_bag_proba(X, bags, method="mc", rule="mean")
    np.testing.assert_allclose(p_mc, p_mean, atol=0.03)
    assert np.all(sd > 0) and np.all(sd < 0.3)
    with pytest.raises(ValueError, match="rule must be one of"):
        model.predict_bag_proba(X, bags, rule="median")


def _witness_bags(n_bags, size, n_witnesses, shift, seed, n_features=3):
    """Alternating labels; a positive bag's first ``n_witnesses(rng)`` rows are shifted along x0."""
    rng = np.random.default_rng(seed)
    X, bags, y = [], [], []
    for b in range(n_bags):
        x = rng.normal(size=(size, n_features))
        if b % 2:
            x[: n_witnesses(rng), 0] += shift
        X.append(x); bags += [b] * size; y += [b % 2] * size
    return np.concatenate(X), np.array(bags), np.array(y)


@pytest.mark.parametrize("model", [VGPMIL, GVGPMIL, VGPMILPR])
def test_auto_bag_rule_leaves_top_fraction_where_it_ranks_by_size(model):
    """``bag_rule="auto"`` (the default): weak witnesses in small positive bags among large
    negative ones — the top instances of a large negative bag outscore a weak witness, so
    ``top_fraction`` ranks held-out bags by size, below chance, and the choice takes ``mean``;
    with one strong witness among 40 the mean dilutes it and ``top_fraction`` stays."""
    X, bags, y, _ = _size_anti_predictive_bags(seed=0, shift=2.0)
    Xte, bte, yte, _ = _size_anti_predictive_bags(seed=1, shift=2.0)
    fitted = model(n_inducing=10, max_iter=20, random_state=0).fit(X, bags, y)
    assert fitted.bag_rule == "auto" and fitted.bag_rule_ == "mean"
    keys, p_auto = fitted.predict_bag_proba(Xte, bte)
    _, p_top = fitted.predict_bag_proba(Xte, bte, rule="top_fraction")
    truth = np.array([yte[bte == k][0] for k in keys])
    assert roc_auc_score(truth, p_top) < 0.5 < roc_auc_score(truth, p_auto) - 0.1
    one_strong = _witness_bags(40, 40, lambda rng: 1, 4.0, seed=0)
    assert model(n_inducing=10, max_iter=20, random_state=0).fit(*one_strong).bag_rule_ == "top_fraction"
    fixed = model(n_inducing=10, kernel=RBF(4.0), max_iter=5, random_state=0).fit(X, bags, y)
    assert fixed.bag_rule_ == "top_fraction"  # "auto" without a kernel choice
    assert model(n_inducing=10, max_iter=20, bag_rule="top_fraction", random_state=0).fit(X, bags, y).bag_rule_ == "top_fraction"
    with pytest.raises(ValueError, match="bag_rule must be 'auto' or one of"):
        model(n_inducing=10, kernel=RBF(4.0), bag_rule="median").fit(X, bags, y)


def test_the_gibbs_reference_takes_the_rule_its_variational_surrogate_chose():
    """The sampler's kernel choice is VGPMIL-PR's (``_select_kernel``), and so is its ``"auto"`` rule."""
    X, bags, y, _ = _size_anti_predictive_bags(seed=0, shift=2.0)
    gibbs = VGPMILPRGibbs(n_inducing=10, n_samples=5, burn_in=0, thin=1, random_state=0).fit(X, bags, y)
    assert gibbs.bag_rule_ == "mean"
    assert VGPMILPRGibbs(n_inducing=10, n_samples=5, burn_in=0, thin=1, bag_rule="max", random_state=0).fit(X, bags, y).bag_rule_ == "max"


def test_auto_bag_rule_leaves_the_default_only_for_a_clearly_better_rule():
    """``clearly_better_rule``: the first rule stays unless another beats it by more than 2 paired
    standard errors *and* by more than 0.1 AUC (for ``mean`` the errors alone where the first rule
    is below chance); among those the largest mean gain wins; degenerate (nan) points are left out."""
    rng = np.random.default_rng(0)
    base = 0.6 + 0.05 * rng.standard_normal((6, 4, 10))  # splits × variances × checkpoints
    steady_small = base + 0.05 + 0.002 * rng.standard_normal((6, 1, 1))  # many standard errors, below the margin
    assert clearly_better_rule({"top_fraction": base, "mean": steady_small}) == "top_fraction"
    noisy_large = base + 0.15 * np.where(np.arange(6)[:, None, None] % 2, 2.0, -0.6)  # +0.21 on average, ± 0.4
    assert clearly_better_rule({"top_fraction": base, "mean": noisy_large}) == "top_fraction"
    steady = base + 0.15 + 0.002 * rng.standard_normal((6, 1, 1))
    larger = base + 0.25 + 0.002 * rng.standard_normal((6, 1, 1))
    assert clearly_better_rule({"top_fraction": base, "max": steady, "mean": larger}) == "mean"
    assert clearly_better_rule({"top_fraction": base, "max": steady, "mean": base - 0.1}) == "max"
    degenerate = larger.copy()
    degenerate[:5] = np.nan  # one split left: no standard error, no switch
    assert clearly_better_rule({"top_fraction": base, "mean": degenerate}) == "top_fraction"
    below_chance = base - 0.2  # the default ranks the held-out bags below chance: no margin for mean, the errors decide
    a_little_better = below_chance + 0.05 + 0.002 * rng.standard_normal((6, 1, 1))
    assert clearly_better_rule({"top_fraction": below_chance, "mean": a_little_better}) == "mean"
    assert clearly_better_rule({"top_fraction": below_chance, "max": a_little_better}) == "top_fraction"  # max follows size more
    assert clearly_better_rule({"top_fraction": below_chance, "mean": below_chance + 0.15 * np.where(np.arange(6)[:, None, None] % 2, 2.0, -0.6)}) == "top_fraction"
    assert clearly_better_rule({"top_fraction": np.full((6, 4, 10), np.nan), "mean": larger}) == "top_fraction"


def test_the_choices_auc_equals_scikit_learns_with_ties():
    rng = np.random.default_rng(0)
    for n in (2, 7, 50):
        labels = np.r_[0, 1, rng.integers(0, 2, n)]
        for scores in (rng.normal(size=labels.size), np.round(rng.normal(size=labels.size)), np.zeros(labels.size)):
            assert binary_auc(labels, scores) == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    with pytest.raises(ValueError, match="both classes"):
        binary_auc(np.ones(4), np.arange(4.0))


def test_the_chance_std_of_the_auc_is_that_of_random_scores():
    rng = np.random.default_rng(1)
    for n_pos, n_neg in ((37, 36), (60, 60), (5, 40)):
        labels = np.r_[np.ones(n_pos), np.zeros(n_neg)]
        aucs = [binary_auc(labels, rng.permutation(labels.size).astype(float)) for _ in range(4000)]
        assert chance_auc_std(labels) == pytest.approx(np.std(aucs), rel=0.05)


def test_gvgpmil_kernel_choice_stays_below_the_variance_where_negatives_run_away():
    """G-VGPMIL's bound has a finite fixed point for an instance of latent variance s only when
    s <= 4α² − 2β: a far larger variance sends the many negatives to f → −∞ (with the default
    H = 1e12 within 81 sweeps here; H = 100 got there within 30)."""
    X, bags, y = _witness_bags(20, 300, lambda rng: 3, 3.0, seed=1)
    bounded = GVGPMIL(n_inducing=10, kernel=RBF(2.0), max_iter=120, random_state=0).fit(X, bags, y)
    runaway = GVGPMIL(n_inducing=10, kernel=RBF(64.0), max_iter=120, random_state=0).fit(X, bags, y)
    assert np.abs(bounded.predict_latent(X)[0]).max() < 5.0
    assert runaway.predict_latent(X)[0].max() < -100.0
    assert GVGPMIL()._auto_variances() == (2 / 64, 2 / 16, 0.5, 2.0)
    assert GVGPMIL(alpha=2.0, beta=1.0)._auto_variances()[-1] == 14.0  # 4·2² − 2·1
    assert GVGPMIL(alpha=0.5, beta=2.5)._auto_variances() == AUTO_VARIANCES  # no safe variance: the common grid


def test_kernel_choice_never_picks_a_degenerate_candidate():
    """A candidate whose held-out bag scores saturate into ties gets AUC 0.5 from the ties; it is
    excluded (nan in ``kernel_selection_``), not compared."""

    class WideGrid(GVGPMIL):
        def _auto_variances(self):
            return (2.0, 1e4)

    X, bags, y = _witness_bags(20, 300, lambda rng: 3, 3.0, seed=1)
    model = WideGrid(n_inducing=10, max_iter=20, random_state=0).fit(X, bags, y)
    assert model.kernel_.variance == 2.0
    assert np.isfinite(model.kernel_selection_[0, 1]) and np.isnan(model.kernel_selection_[1, 1])


def _witnesses_per_bag(bags: np.ndarray, witness: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each bag's first row, size and witness count (bags in ``np.unique`` order)."""
    _, first, counts = np.unique(bags, return_index=True, return_counts=True)
    return first, counts, np.add.reduceat(witness[np.argsort(bags, kind="stable")], np.r_[0, np.cumsum(counts)[:-1]])


def test_benchmark_robustness_sets_are_mil_bags_with_witnesses_only_in_positive_bags(bench_accuracy):
    """The offline sets that check the defaults are not tuned to MUSK (``benchmarks/bench_accuracy.py``)."""
    assert set(bench_accuracy.HELD_OUT_SETS) <= set(bench_accuracy.ROBUSTNESS_SETS)
    positive_fraction = {"imbalanced": 0.25, "highdim": 0.5, "dense": 0.5}  # the others alternate labels
    for name, sizes in (("cancer", (2, 10)), ("text", (8, 30)), ("fox", (2, 13)), ("hastie", (5, 25)), ("wine", (2, 6)),
                        ("sizes", (4, 24)), ("imbalanced", (5, 30)), ("highdim", (10, 40)), ("dense", (10, 30))):
        X, bags, y, witness = bench_accuracy.robustness_set(name)
        first, counts, per_bag = _witnesses_per_bag(bags, witness)
        if name in positive_fraction:
            assert np.mean(y[first]) == positive_fraction[name], name
        else:
            assert np.all(np.diff(y[np.argsort(bags, kind="stable")])[np.cumsum(counts)[:-1] - 1] != 0)  # labels alternate
        assert np.all((per_bag > 0) == (y[first] == 1)), name  # a bag is positive iff it holds a witness
        assert counts.min() >= sizes[0] and counts.max() <= sizes[1] and np.all(np.isfinite(X))
        if name == "dense":  # positive bags are mostly witnesses: at least 30 % each
            positive = y[first] == 1
            assert np.all(per_bag[positive] >= np.maximum(1, (0.3 * counts[positive]).astype(int)))
    _, bags, y, _ = bench_accuracy.robustness_set("sizes")
    _, first, counts = np.unique(bags, return_index=True, return_counts=True)
    positive = y[first] == 1
    assert counts[positive].max() <= 12 < 16 <= counts[~positive].min()  # size anti-predictive: negatives larger
    with pytest.raises(ValueError, match="pool too small"):
        bench_accuracy.pool_bags(np.zeros((10, 2)), np.arange(10) < 5, 0, 10, (2, 3), 0.5)


def test_benchmark_generated_sets_are_the_regimes_they_name(bench_accuracy):
    """``generated_set`` (session 30): witnesses only in positive bags, in the stated bag sizes and
    witness fractions; ``collective`` has no witnesses and shifts every instance of a positive bag."""
    assert set(bench_accuracy.GENERATED_SETS) <= set(bench_accuracy.HELD_OUT_SETS)
    for name, sizes, dims in (("lowrank", (20, 59), 256), ("heavytail", (5, 24), 20), ("rare", (50, 199), 64)):
        X, bags, y, witness = bench_accuracy.robustness_set(name)
        first, counts, per_bag = _witnesses_per_bag(bags, witness)
        assert np.all((per_bag > 0) == (y[first] == 1)), name
        assert counts.min() >= sizes[0] and counts.max() <= sizes[1] and X.shape[1] == dims and np.all(np.isfinite(X))
        if name == "rare":  # rare witnesses in rare positive bags
            assert 0.1 < np.mean(y[first]) < 0.3 and np.all(per_bag[y[first] == 1] <= np.ceil(0.03 * counts[y[first] == 1]))
        if name == "heavytail":
            assert X.min() > 0  # raw log-normal features
    X, bags, y, witness = bench_accuracy.robustness_set("collective")
    assert witness is None
    shift = X[y == 1].mean(axis=0) - X[y == 0].mean(axis=0)
    assert np.all(shift[:5] > 0.3) and np.all(np.abs(shift[5:]) < 0.15)


def test_benchmark_label_noise_flips_whole_training_bags_and_leaves_the_test_fold_alone(bench_accuracy):
    """``bench_accuracy.py --label-noise``: wrong slide labels in training, true labels in test."""
    clean = list(bench_accuracy._splits("cancer", 5, 1, (0, 1)))
    noisy = list(bench_accuracy._splits("cancer", 5, 1, (0, 1), label_noise=0.3))
    again = list(bench_accuracy._splits("cancer", 5, 1, (0, 1), label_noise=0.3))
    flipped_bags = 0
    for (name, train, test), (noisy_name, noisy_train, noisy_test), (_, train_again, _) in zip(clean, noisy, again):
        assert name == noisy_name
        np.testing.assert_array_equal(noisy_test.y, test.y)  # the AUC is measured on the true labels
        np.testing.assert_array_equal(noisy_train.X, train.X)
        np.testing.assert_array_equal(noisy_train.instance_labels, train.instance_labels)
        np.testing.assert_array_equal(train_again.y, noisy_train.y)  # every method sees the same wrong labels
        changed = noisy_train.y != train.y
        np.testing.assert_array_equal(noisy_train.y[changed], 1 - train.y[changed])
        for bag in np.unique(train.bags):  # a bag is flipped whole or not at all
            assert np.unique(changed[train.bags == bag]).size == 1
        flipped_bags += np.unique(train.bags[changed]).size
    n_bags = sum(np.unique(train.bags).size for _, train, _ in clean)  # 10 folds × 48 training bags
    assert 0.2 * n_bags < flipped_bags < 0.4 * n_bags
    with pytest.raises(ValueError, match="label noise"):
        bench_accuracy.with_label_noise(clean[0][1], 0.5, 0)


def test_benchmark_repeats_the_cv_over_seeds_on_identical_folds_and_pairs_methods_fold_by_fold(bench_accuracy, capsys):
    """``bench_accuracy --cv-seeds 0 1 --paired-to M``: seed 0 stays the old split, other seeds shuffle
    differently, every method's entries come in the same (seed, fold) order, and Δ is paired."""
    test_bags = [[frozenset(test.bags) for _, _, test in bench_accuracy.folds("cancer", 5, 1, seed)] for seed in (0, 1)]
    assert [frozenset(test.bags) for _, _, test in bench_accuracy.folds("cancer", 5, 1)] == test_bags[0]
    assert test_bags[0] != test_bags[1]
    one = bench_accuracy.evaluate("lr_mean_max", "cancer", 5, 1)["own"]["bag_auc"]
    two = bench_accuracy.evaluate("lr_mean_max", "cancer", 5, 1, cv_seeds=(0, 1))["own"]["bag_auc"]
    assert len(one) == 5 and len(two) == 10 and two[:5] == one
    mean, se = bench_accuracy.paired_difference([0.9, 0.8, 0.7], [0.8, 0.8, 0.8])
    assert mean == pytest.approx(0.0) and se == pytest.approx(0.1 / np.sqrt(3))
    bench_accuracy.print_table(["lr_mean_max"], ["cancer"], 5, 1, (0, 1), paired_to="lr_mean_max")
    out = capsys.readouterr().out
    assert "CV seeds: 0 1" in out and "+0.000 ± 0.000" in out and f"{np.mean(two):.3f}" in out


def test_choice_bags_are_whole_bags_under_the_cap_with_enough_of_each_class():
    rng = np.random.default_rng(0)
    sizes, labels = rng.integers(1_000, 10_000, 40), np.arange(40) % 2  # WSI-like bags: a row sample drops witnesses
    picked = choice_bags(sizes, labels, 0)
    assert np.all(np.diff(picked) > 0) and np.bincount(labels[picked]).min() >= 8
    np.testing.assert_array_equal(choice_bags(sizes, labels, 0), picked)  # seeded
    assert not np.array_equal(choice_bags(sizes, labels, 1), picked)
    np.testing.assert_array_equal(choice_bags(sizes[:5], labels[:5], 0), np.arange(5))  # under the cap: every bag
    small = choice_bags(np.full(40, 1_000), labels, 0)  # the cap's 20 bags, topped up to 8 per class
    assert 20 <= small.size <= 28 and np.bincount(labels[small]).min() >= 8


def test_kernel_choice_takes_the_best_mean_over_splits_and_skips_degenerate_checkpoints():
    checkpoints = np.array([5, 10, 15])
    one_lucky_split = np.array([[0.80, 0.97, 0.78], [0.80, 0.76, 0.82], [0.82, 0.76, 0.80]])  # splits × checkpoints
    steady = np.array([[0.85, 0.85, 0.85], [0.84, 0.84, 0.84], [0.85, 0.85, 0.85]])
    scores = {1.0: steady, 4.0: one_lucky_split}
    assert best_candidate({4.0: one_lucky_split[:1], 1.0: steady[:1]}, checkpoints) == (4.0, 10)  # one split: the lucky one
    assert best_candidate(scores, checkpoints) == (1.0, 5)  # the mean over splits; ties: fewest sweeps, smallest v
    scores[1.0] = steady.copy()
    scores[1.0][0, 0] = np.nan  # a degenerate split rules the checkpoint out
    assert best_candidate(scores, checkpoints) == (1.0, 10)
    assert best_candidate({2.0: steady, 1.0: steady}, checkpoints) == (1.0, 5)
    assert best_candidate({1.0: np.full((3, 3), np.nan)}, checkpoints) is None


def test_kernel_choice_can_prefer_a_smaller_variance_within_half_a_paired_standard_error():
    checkpoints = np.array([5, 10])
    best = np.array([[0.80, 0.80], [0.90, 0.90], [0.70, 0.70]])  # splits × checkpoints
    noisy = best - np.array([[0.05], [-0.04], [0.02]])  # 0.01 behind on average, well within half its paired s.e.
    consistent = best - 0.01  # 0.01 behind on every split: a real shortfall
    assert best_candidate({2.0: best, 0.5: noisy}, checkpoints) == (2.0, 5)  # the best mean by default
    assert best_candidate({2.0: best, 0.5: noisy}, checkpoints, smaller_within_se=0.5) == (0.5, 5)
    assert best_candidate({2.0: best, 0.5: consistent}, checkpoints, smaller_within_se=0.5) == (2.0, 5)
    assert best_candidate({2.0: best, 8.0: noisy}, checkpoints, smaller_within_se=0.5) == (2.0, 5)  # only smaller ones


@pytest.mark.parametrize("model, within", [(VGPMIL(n_inducing=10, random_state=0), 0.0), (GVGPMIL(n_inducing=10, random_state=0), 0.5)],
                         ids=lambda m: type(m).__name__ if hasattr(m, "fit") else str(m))
def test_gvgpmil_choice_leans_to_the_smaller_variance_and_vgpmil_takes_the_best_mean(model, within, toy_bags, monkeypatch):
    import mil_core.models.base as base

    seen = []
    monkeypatch.setattr(base, "best_candidate", lambda scores, checkpoints, f: seen.append(f) or best_candidate(scores, checkpoints, f))
    X, bags, y, _ = toy_bags
    clone(model).fit(X, bags, y)
    assert seen == [within, within]  # the first stage's choice, then the choice over both stages


def test_the_kernel_choice_places_the_inducing_points_once_per_split(monkeypatch):
    """The candidates of one split (5 variances × 2 H, then the constant kernel's second stage) fit
    on the same training half with the same seed, so they share one k-means: 6 splits + the final
    fit = 7 k-means runs, not 73."""
    import mil_core.models.base as base

    X, bags, y, _ = make_toy_bags(16)
    calls = []
    real = base.kmeans_inducing_points
    monkeypatch.setattr(base, "kmeans_inducing_points", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = VGPMIL(n_inducing=8, max_iter=10, random_state=0).fit(X, bags, y)
    assert len(calls) == 7 and model.kernel_selection_.shape == (5, 2)


def test_kmeans_inducing_points_copies_one_class_at_a_time_to_float64():
    """k-means held a float64 copy of every row beside each class's: a default fit on
    foundation-model features (float32, D = 512-2560) peaked at about 7× the feature matrix."""
    import tracemalloc

    from mil_core.inducing import kmeans_inducing_points

    rng = np.random.default_rng(0)
    X = rng.normal(size=(30_000, 128)).astype(np.float32)
    labels = (np.arange(30_000) < 6_000).astype(int)
    tracemalloc.start()
    try:
        Z = kmeans_inducing_points(X, labels, 50, random_state=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2 * X.astype(np.float64).nbytes, peak / X.nbytes  # was 5.4× the float32 rows, now 3.4×
    np.testing.assert_array_equal(Z, kmeans_inducing_points(X.astype(np.float64), labels, 50, random_state=0))  # the same centres


def test_half_precision_features_are_read_as_float32():
    """fp16 features (how many pipelines keep GigaPath/Virchow embeddings) were widened to float64:
    a 10⁶ × 512 prediction took 12× its input in memory."""
    from mil_core.validation import check_mil_data

    X = np.random.default_rng(1).normal(size=(12, 3)).astype(np.float16)
    checked, _, _ = check_mil_data(X, np.repeat(np.arange(4), 3), np.repeat([0, 1, 0, 1], 3))
    assert checked.dtype == np.float32 and np.array_equal(checked, X.astype(np.float32))
    assert check_mil_data(X.astype(np.float64), np.repeat(np.arange(4), 3))[0].dtype == np.float64  # others as they were


def test_a_float32_column_that_varies_by_rounding_alone_is_constant():
    """3.0 ± 1 ulp in float32 was scaled by its rounding noise (std 2·10⁻⁸ of its level, above the
    float64 rule's 10⁻¹²): a shift of 10⁻⁴ at prediction time moved every row thousands of stds
    and every probability to ½."""
    from mil_core.validation import standardisation

    rng = np.random.default_rng(3)
    bags = np.repeat(np.arange(20), 8)
    y = np.repeat(np.arange(20) % 2, 8)
    X = rng.normal(size=(160, 3)).astype(np.float32)
    X[y == 1, 0] += 3.0 * (rng.random(int((y == 1).sum())) < 0.3)
    jitter = np.float32(3.0) + rng.integers(-1, 2, size=160).astype(np.float32) * np.spacing(np.float32(3.0))
    X = np.column_stack([X, jitter]).astype(np.float32)
    assert standardisation(X)[1][3] == 1.0 and standardisation(X.astype(np.float64))[1][3] != 1.0  # float64 data: as before
    model = VGPMIL(kernel=RBF(4.0), n_inducing=10, max_iter=10, H=100, bag_rule="max", random_state=0).fit(X, bags, y)
    shifted = X.copy()
    shifted[:, 3] += 1e-4  # another site's extractor
    np.testing.assert_allclose(model.predict_bag_proba(shifted, bags)[1], model.predict_bag_proba(X, bags)[1], atol=1e-3)


class _CountingMemo(dict):
    def __init__(self, *args):
        super().__init__(*args)
        self.writes = 0

    def __setitem__(self, key, value):
        self.writes += 1
        super().__setitem__(key, value)


def test_a_kernel_choice_given_a_memo_records_each_split_and_a_restarted_choice_fits_only_the_missing_ones():
    """A run killed during the kernel choice started it again from nothing (13.5 minutes on 50
    slides): each finished split is now recorded under a digest of what determines it, and a
    choice given that record fits only the splits it lacks and chooses as an uninterrupted one."""
    from mil_core.bags import BagIndex

    X, bags, y, _ = make_toy_bags(n_bags=40, seed=5)
    index = BagIndex.from_ids(bags)
    X_sorted, labels = X[index.order], y[index.order][index.offsets[:-1]].astype(int)

    def choose(memo, **params):
        model = VGPMIL(random_state=0, max_iter=10, **params)  # 10 sweeps a candidate: CI time
        kernel = model._select_kernel(X_sorted, index.offsets, labels, None, memo=memo)
        return kernel, model

    kernel, reference = choose(None)
    memo = _CountingMemo()
    assert choose(memo)[0] == kernel
    splits = dict(memo)
    assert memo.writes == len(splits) >= 6  # 3 × 2 splits of the first stage, and those of the second
    restarted = _CountingMemo({key: splits[key] for key in sorted(splits)[::2]})  # killed with half the splits done
    again, model = choose(restarted)
    assert again == kernel and restarted.writes == len(splits) - len(sorted(splits)[::2]) and dict(restarted).keys() == splits.keys()
    np.testing.assert_array_equal(model.kernel_selection_, reference.kernel_selection_)
    assert (model.auto_max_iter_, model.bag_rule_, model.H_) == (reference.auto_max_iter_, reference.bag_rule_, reference.H_)
    other = _CountingMemo(splits)
    choose(other, n_inducing=8)  # another configuration finds no split of this one
    assert other.writes >= 6 and len(other) == len(splits) + other.writes
