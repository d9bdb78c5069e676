"""Predictions never change an estimator (scikit-learn convention): every ``predict*`` (and
``transform``) method of every public mil_core estimator, with every output option and every bag
rule, leaves ``vars(estimator)`` as it was; ``sklearn.base.clone`` works for each."""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import inspect
from typing import Any

import numpy as np
import pytest
from conftest import make_toy_bags
from sklearn.base import BaseEstimator, clone

import mil_core
from mil_core import (
    ABMIL,
    GVGPMIL,
    RBF,
    VGPMIL,
    VGPMILPR,
    VGPMILPRI,
    VWSGP,
    AbSMIL,
    EmbeddedGPMIL,
    PsiVGPMIL,
    VGPMILPRGibbs,
)
from mil_core.bags import BAG_RULES, BagIndex
from mil_core.ising import check_coords
from mil_core.models.ising_hyper import LamState
from mil_core.models.probit import PROBIT_BAG_RULES

SMALL = {"n_inducing": 6, "random_state": 0, "n_mc_samples": 40}
ESTIMATORS = {
    "VGPMIL": lambda: VGPMIL(max_iter=5, **SMALL),
    "VGPMIL-learnt-kernel": lambda: VGPMIL(max_iter=3, learn_kernel=True, **SMALL),
    "GVGPMIL": lambda: GVGPMIL(max_iter=5, **SMALL),
    "PsiVGPMIL": lambda: PsiVGPMIL(max_iter=5, **SMALL),
    "VGPMILPR": lambda: VGPMILPR(max_iter=5, **SMALL),
    "VGPMILPRI": lambda: VGPMILPRI(lam=1.0, max_iter=5, exact_orthant_max=4, **SMALL),
    "VGPMILPRI-learnt-lam": lambda: VGPMILPRI(lam=1.0, learn_lam=True, max_iter=3, exact_orthant_max=4, **SMALL),
    "VGPMILPRI-smoother": lambda: VGPMILPRI(lam=1.0, coupling_form="smoother", max_iter=5, exact_orthant_max=4, **SMALL),
    "VGPMILPRGibbs": lambda: VGPMILPRGibbs(lam=1.0, n_samples=30, burn_in=5, thin=1, exact_orthant_max=4, **SMALL),
    "VWSGP": lambda: VWSGP(max_iter=5, **SMALL),
    "AbSMIL": lambda: AbSMIL(max_iter=5, random_state=0),
}
NETWORK = {"n_components": 4, "hidden": (8,), "attention_dim": 4, "max_epochs": 5, "random_state": 0}
NEEDS_TORCH = {"ABMIL", "EmbeddedGPMIL"}  # the network trains with PyTorch (the optional extra "torch")
if importlib.util.find_spec("torch") is not None:
    ESTIMATORS |= {
        "ABMIL": lambda: ABMIL(**NETWORK),
        # its member GPs' kernel choice is VGPMIL's, checked above; here it made each fit 4× slower
        "EmbeddedGPMIL": lambda: EmbeddedGPMIL(VGPMIL(kernel=RBF(4.0, 1.0), n_inducing=6, max_iter=5, n_mc_samples=40),
                                               n_networks=2, **NETWORK),
    }
USES_COORDS = {"VGPMILPRI", "VGPMILPRI-learnt-lam", "VGPMILPRI-smoother", "VGPMILPRGibbs"}
OPTIONS = {"return_std": True, "return_orthant_error": True}  # every output a method offers
EMBEDDED_RULES = ("ensemble", "attention", "network")
VARIANTS = {"method": ("mc", "probit"), "rule": tuple(dict.fromkeys(BAG_RULES + PROBIT_BAG_RULES + EMBEDDED_RULES))}


def toy_data(name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """``X, bag_ids, y, coords`` (coords for the models that read them, else None)."""
    X, bags, y, _ = make_toy_bags(n_bags=12)
    coords = np.concatenate([np.arange(n) for n in np.unique(bags, return_counts=True)[1]]) if name in USES_COORDS else None
    return X, bags, y, coords


@functools.cache
def fitted(name: str) -> Any:
    """``ESTIMATORS[name]`` fitted on :func:`toy_data`, once per test session (the tests that use it
    only predict, which this module checks changes nothing)."""
    X, bags, y, coords = toy_data(name)
    return ESTIMATORS[name]().fit(X, bags, y, **({"coords": coords} if coords is not None else {}))


def _same(a: Any, b: Any) -> bool:
    """Deep equality with arrays compared by value (NaN equal to NaN, in arrays and as numbers) and exact types."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (float, np.floating)) and np.isnan(a):  # EmbeddedGPMIL's representation_auc_ of what it did not measure
        return bool(np.isnan(b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):  # its fields, and what a cached property stored beside them
        return (all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
                and _same(getattr(a, "__dict__", {}), getattr(b, "__dict__", {})))
    if hasattr(a, "__dict__") and not callable(a):
        return _same(vars(a), vars(b))
    return bool(a == b) or a is b


def _calls(method: Any, X: np.ndarray, bags: np.ndarray, coords: np.ndarray | None):
    """Keyword sets covering a predict method: required arguments only, then every context and
    output option it accepts, then each alternative ``method``/``rule``. A method that passes
    ``**kwargs`` on to a wrapped GP (EmbeddedGPMIL) gets the GP's ``return_std`` and ``method``."""
    params = dict(inspect.signature(method).parameters)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        params = {"return_std": None, "method": None} | params
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
        lambda s: s["gp_"].__dict__.__setitem__("cached", 1),  # a cached property of a nested dataclass
        lambda s: s.__setitem__("n_iter_", 5),
    ):
        changed = copy.deepcopy(state)
        change(changed)
        assert not _same(state, changed)


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_predictions_never_change_the_estimator(name):
    X, bags, _, coords = toy_data(name)
    estimator = fitted(name)
    # scikit-learn conventions on the way: fit leaves the parameters as given, what it learns ends in "_"
    params = ESTIMATORS[name]().get_params(deep=False)
    assert _same(estimator.get_params(deep=False), params), f"{name}.fit changed a constructor parameter"
    learnt = set(vars(estimator)) - set(params)
    assert learnt and all(k.endswith("_") for k in learnt), sorted(k for k in learnt if not k.endswith("_"))
    methods = [m for m in dir(estimator) if m.startswith(("predict", "transform")) and callable(getattr(estimator, m))]
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


def test_every_public_estimator_is_checked():
    """A new estimator exported by mil_core cannot skip the checks here (ABMIL/EmbeddedGPMIL are
    checked where PyTorch is installed: their fit needs it)."""
    public = {name for name in mil_core.__all__ if isinstance(getattr(mil_core, name), type)
              and issubclass(getattr(mil_core, name), BaseEstimator)}
    checked = {type(make()).__name__ for make in ESTIMATORS.values()}
    assert public - checked <= NEEDS_TORCH, f"estimators without a purity check: {sorted(public - checked)}"
    assert public >= checked


@pytest.mark.parametrize("name", sorted(ESTIMATORS))
def test_clone_gives_an_unfitted_estimator_with_equal_params(name):
    estimator = ESTIMATORS[name]()
    copied = clone(estimator)
    assert type(copied) is type(estimator) and copied is not estimator
    assert repr(copied) == repr(estimator)
    assert _same(vars(copied), vars(estimator))  # parameters only, nested estimators cloned by value
    assert not any(k.endswith("_") for k in vars(copied))


def test_the_scikit_learn_adapter_predicts_without_changing_itself_and_clones():
    """:class:`mil_core.model_selection.BagwiseClassifier` (the estimator scikit-learn's search tools see)."""
    from mil_core.model_selection import BagwiseClassifier, with_bag_ids

    X, bags, y, _ = toy_data("VGPMIL")
    adapter = BagwiseClassifier(VGPMIL(max_iter=5, **SMALL), predict_kwargs={"method": "probit"})
    assert _same(vars(clone(adapter)), vars(adapter))
    Xb = with_bag_ids(X, bags)
    adapter.fit(Xb, y)
    for method in ("predict_bag_proba", "predict_proba", "predict"):
        before = copy.deepcopy(vars(adapter))
        getattr(adapter, method)(Xb)
        assert _same(before, vars(adapter)), method
    assert not any(k.endswith("_") for k in vars(clone(adapter)))
