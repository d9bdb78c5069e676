"""The pipeline scores bags the way the estimator does (issue 15: "a bag score … used the same way
by the estimators and the pipeline"): for each GP-MIL family with its default bag rule, the bag
probabilities that ``predict_cohort`` writes with the pipeline's default prediction settings equal
the estimator's ``predict_bag_proba`` and the score its kernel choice and early stopping rank
(``_bag_proba_from_state``), on a real Zarr store and a real LocalCluster.

(VGPMIL-PR-I, the Gibbs reference, AbSMIL and EmbeddedGPMIL have the same check beside their other
cluster tests: ``test_distributed``, ``test_gibbs``, ``test_embedded``.)"""

from __future__ import annotations

import numpy as np
import pytest
from distributed import Client, LocalCluster

from flows.config import PredictionConfig
from mil_core import GVGPMIL, RBF, VGPMIL, VGPMILPR, VWSGP
from mil_core.bags import BagIndex
from tasks.training import fit_cohort, predict_cohort, read_predictions
from tasks.training.predict import prediction_kwargs
from tests.conftest import make_toy_bags
from tests.test_defaults import _size_anti_predictive_bags
from tests.test_distributed import write_store

pytestmark = pytest.mark.timeout(300)

SMALL = {"n_inducing": 8, "max_iter": 8, "tol": 0.0, "random_state": 0, "kernel": RBF(4.0),
         "standardize": False}  # the pipeline standardises (training.standardize), not the model
FAMILIES = {  # each with its default bag rule (the constructor's, nothing passed; "auto" keeps it with a fixed kernel)
    "VGPMIL": (lambda: VGPMIL(**SMALL), "top_fraction"),
    "GVGPMIL": (lambda: GVGPMIL(**SMALL), "top_fraction"),
    "VGPMILPR": (lambda: VGPMILPR(**SMALL), "top_fraction"),
    "VWSGP": (lambda: VWSGP(**SMALL), None),  # its own rule: σ of the summed evidence
}


def large_bags(n_bags: int = 20, seed: int = 0):
    """Bags of 25–45 instances (the top 5 % is then 2–3 instances, not the max), 1–4 witnesses in each positive bag."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(25, 46, n_bags)
    bags = np.repeat(np.arange(n_bags), sizes)
    X = rng.normal(size=(bags.size, 2))
    y = (bags % 2).astype(np.int64)
    for b in range(1, n_bags, 2):
        X[np.flatnonzero(bags == b)[: rng.integers(1, 5)], 0] += 3.0
    return X, bags, y


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    X, bags, y = large_bags()
    X = X.astype(np.float32).astype(np.float64)  # the store keeps float32 features
    return write_store(tmp_path_factory.mktemp("bag_score") / "toy.zarr", X, bags, y), (X, bags, y)


@pytest.fixture(scope="module")
def client():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        yield client


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_pipeline_writes_the_estimators_bag_scores(family, store, client):
    path, (X, bags, y) = store
    make, default_rule = FAMILIES[family]
    model = make().fit(X, bags, y)
    assert getattr(model, "bag_rule_", getattr(model, "bag_rule", None)) == default_rule
    settings = PredictionConfig()
    instance_kwargs, bag_kwargs = prediction_kwargs(model, settings.method, settings.rule)
    assert "rule" not in bag_kwargs  # the pipeline's default leaves the estimator's fitted rule
    predict_cohort(model, path, client, run=family, partition_bytes=2_000,  # 3 partitions
                   instance_kwargs=instance_kwargs, bag_kwargs=bag_kwargs)
    written = read_predictions(path, family)["bags/proba"]

    np.testing.assert_allclose(written, model.predict_bag_proba(X, bags, **bag_kwargs)[1], rtol=1e-10)
    index = BagIndex.from_ids(bags)
    ranked = model._bag_proba_from_state(model.gp_, model.q_, X[index.order], index.offsets)
    np.testing.assert_allclose(written, ranked, rtol=1e-10)


@pytest.mark.parametrize("make", [VGPMIL, VGPMILPR])
def test_a_rule_the_guard_chose_is_the_cluster_fits_and_the_pipelines(make, client, tmp_path):
    """``bag_rule="auto"`` where the top instances rank bags by size (weak witnesses in small
    positive bags): the cluster fit leaves ``top_fraction`` for ``mean`` as ``model.fit`` does,
    and the pipeline's default prediction settings write bag scores by that rule."""
    X, bags, y, _ = _size_anti_predictive_bags(seed=0, shift=2.0)
    X = X.astype(np.float32).astype(np.float64)  # the store keeps float32 features
    path = write_store(tmp_path / "sizes.zarr", X, bags, y)
    params = dict(n_inducing=10, max_iter=20, random_state=0, standardize=False)
    serial = make(**params).fit(X, bags, y)
    model = make(**params)
    fit_cohort(model, path, client, partition_bytes=8_000, resume=False)
    assert model.bag_rule == "auto" and model.bag_rule_ == serial.bag_rule_ == "mean"
    np.testing.assert_array_equal(model.kernel_selection_, serial.kernel_selection_)
    settings = PredictionConfig()
    instance_kwargs, bag_kwargs = prediction_kwargs(model, settings.method, settings.rule)
    predict_cohort(model, path, client, run="guard", partition_bytes=8_000, instance_kwargs=instance_kwargs, bag_kwargs=bag_kwargs)
    written = read_predictions(path, "guard")["bags/proba"]
    np.testing.assert_allclose(written, model.predict_bag_proba(X, bags, rule="mean", **bag_kwargs)[1], rtol=1e-10)
    assert not np.allclose(written, model.predict_bag_proba(X, bags, rule="top_fraction", **bag_kwargs)[1], atol=1e-3)


def test_the_prediction_settings_reach_every_model_that_takes_them():
    """``prediction.method`` is not only for the logistic family: VWSGP's bag probability takes it
    too (left out, each partition drew its own Monte Carlo sample); ``prediction.rule`` reaches
    the logistic and the probit family (VGPMILPR was the pipeline's default model until session 28;
    it used to be ignored there), no model gets a keyword its predict methods do not name, and VWSGP, which
    scores bags by its summed evidence, refuses a rule rather than ignore it."""
    X, bags, y, _ = make_toy_bags(12)
    vwsgp = VWSGP(**SMALL).fit(X, bags, y)
    assert prediction_kwargs(vwsgp, "probit", None) == ({}, {"method": "probit"})
    with pytest.raises(ValueError, match="prediction.rule='max': VWSGP scores bags by its own rule"):
        prediction_kwargs(vwsgp, "probit", "max")
    vgpmil = VGPMIL(**SMALL).fit(X, bags, y)
    assert prediction_kwargs(vgpmil, "mc", None) == ({"method": "mc"}, {"method": "mc"})
    assert prediction_kwargs(vgpmil, "probit", "max") == ({"method": "probit"}, {"method": "probit", "rule": "max"})
    probit = VGPMILPR(**SMALL).fit(X, bags, y)
    assert prediction_kwargs(probit, "probit", None) == ({}, {})
    assert prediction_kwargs(probit, "probit", "max") == ({}, {"rule": "max"})
