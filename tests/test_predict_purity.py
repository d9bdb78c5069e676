"""Predictions never change an estimator (scikit-learn convention): every ``predict*`` method of
every mil_core estimator, with every output option, leaves ``vars(estimator)`` as it was."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from typing import Any

import numpy as np
import pytest
from conftest import make_toy_bags

from mil_core import GVGPMIL, VGPMIL, VGPMILPR, VGPMILPRI, VWSGP, AbSMIL, PsiVGPMIL, VGPMILPRGibbs
from mil_core.bags import BagIndex
from mil_core.ising import check_coords
from mil_core.models.ising_hyper import LamState

SMALL = dict(n_inducing=6, random_state=0, n_mc_samples=40)
ESTIMATORS = {
    "VGPMIL": lambda: VGPMIL(max_iter=5, **SMALL),
    "VGPMIL-learnt-kernel": lambda: VGPMIL(max_iter=3, learn_kernel=True, **SMALL),
    "GVGPMIL": lambda: GVGPMIL(max_iter=5, **SMALL),
    "PsiVGPMIL": lambda: PsiVGPMIL(max_iter=5, **SMALL),
    "VGPMILPR": lambda: VGPMILPR(max_iter=5, **SMALL),
    "VGPMILPRI": lambda: VGPMILPRI(lam=1.0, max_iter=5, exact_orthant_max=4, **SMALL),
    "VGPMILPRI-learnt-lam": lambda: VGPMILPRI(lam=1.0, learn_lam=True, max_iter=3, exact_orthant_max=4, **SMALL),
    "VGPMILPRI-smoother": lambda: VGPMILPRI(lam=1.0, coupling_form="smoother", max_iter=5, exact_orthant_max=4, **SMALL),
    "VGPMILPRGibbs": lambda: VGPMILPRGibbs(lam=1.0, n_samples=30, burn_in=5, exact_orthant_max=4, **SMALL),
    "VWSGP": lambda: VWSGP(max_iter=5, **SMALL),
    "AbSMIL": lambda: AbSMIL(max_iter=5, random_state=0),
}
USES_COORDS = {"VGPMILPRI", "VGPMILPRI-learnt-lam", "VGPMILPRI-smoother", "VGPMILPRGibbs"}
OPTIONS = {"return_std": True, "return_orthant_error": True}  # every output a method offers
VARIANTS = {"method": ("mc", "probit"), "rule": ("noisy_or", "max")}


def _same(a: Any, b: Any) -> bool:
    """Deep equality with arrays compared by value (NaN equal to NaN) and exact types."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if hasattr(a, "__dict__") and not callable(a):
        return _same(vars(a), vars(b))
    return bool(a == b) or a is b


def _calls(method: Any, X: np.ndarray, bags: np.ndarray, coords: np.ndarray | None):
    """Keyword sets covering a predict method: required arguments only, then every context and
    output option it accepts, then each alternative ``method``/``rule``."""
    params = inspect.signature(method).parameters
    required = {"bag_ids": bags} if "bag_ids" in params and params["bag_ids"].default is inspect.Parameter.empty else {}
    full = dict(required)
    if "bag_ids" in params:
        full["bag_ids"] = bags
    if "coords" in params and coords is not None:
        full["coords"] = coords
    full.update({k: v for k, v in OPTIONS.items() if k in params})
    yield required
    yield full
    for name, values in VARIANTS.items():
        if name in params:
            for value in values:
                yield {**full, name: value}


def test_same_sees_every_kind_of_change():
    state = {"q_": np.zeros(3), "gp_": dataclasses.make_dataclass("G", ["Z"])(np.ones(2)), "n_iter_": 4}
    assert _same(state, copy.deepcopy(state))
    for change in (
        lambda s: s.__setitem__("orthant_std_error_", np.zeros(2)),  # an attribute added
        lambda s: s["q_"].__setitem__(0, 1.0),  # an array changed in place
        lambda s: setattr(s["gp_"], "Z", np.zeros(2)),  # a field of a nested dataclass
        lambda s: s.__setitem__("n_iter_", 5),
    ):
        changed = copy.deepcopy(state)
        change(changed)
        assert not _same(state, changed)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_predictions_never_change_the_estimator(name):
    X, bags, y, _ = make_toy_bags(n_bags=12)
    coords = np.concatenate([np.arange(n) for n in np.unique(bags, return_counts=True)[1]]) if name in USES_COORDS else None
    estimator = ESTIMATORS[name]().fit(X, bags, y, **({"coords": coords} if coords is not None else {}))
    methods = [m for m in dir(estimator) if m.startswith("predict") and callable(getattr(estimator, m))]
    assert methods
    for method_name in methods:
        succeeded = 0
        for kwargs in _calls(getattr(estimator, method_name), X, bags, coords):
            before = copy.deepcopy(vars(estimator))
            try:
                getattr(estimator, method_name)(X, **kwargs)
                succeeded += 1
            except ValueError:  # an option this estimator rejects (e.g. AbSMIL has no std): still pure
                pass
            assert _same(before, vars(estimator)), f"{name}.{method_name}({sorted(kwargs)}) changed the estimator"
        assert succeeded, f"{name}.{method_name} never ran"


def test_scoring_a_fit_state_never_changes_the_estimator():
    """Validation during a fit (the estimator's early stopping, and tasks.training's) scores a
    global state; a state with a learnt λ carries its own λ, which must not leak into the estimator."""
    X, bags, y, _ = make_toy_bags(n_bags=12)
    coords = np.concatenate([np.arange(n) for n in np.unique(bags, return_counts=True)[1]])
    estimator = VGPMILPRI(lam=1.0, learn_lam=True, max_iter=3, exact_orthant_max=4, **SMALL).fit(X, bags, y, coords=coords)
    index = BagIndex.from_ids(bags)
    before = copy.deepcopy(vars(estimator))
    state = LamState(q=estimator.q_, lam=10.0 * estimator.lam_)
    scored = estimator._bag_proba_from_state(estimator.gp_, state, X[index.order], index.offsets, check_coords(coords, index))
    assert _same(before, vars(estimator))
    _, predicted = estimator.predict_bag_proba(X, bags, coords=coords)
    assert not np.allclose(scored, predicted)  # the state's λ was used, not lam_
