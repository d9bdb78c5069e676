"""Degenerate results warn: an unconverged fit, near-constant predictions, wildly different feature scales."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from sklearn.exceptions import ConvergenceWarning

import mil_core
from tasks import diagnostics
from tests.conftest import make_toy_bags


def test_a_fit_stopping_at_max_iter_unconverged_warns_and_a_converged_one_does_not():
    X, bags, y, _ = make_toy_bags(n_bags=12, seed=0)  # fixed kernels: kernel=None may choose an early stop, which is not convergence
    with pytest.warns(ConvergenceWarning, match=r"stopped at max_iter=2 without converging.*tol=1e-09"):
        model = mil_core.VGPMIL(n_inducing=5, kernel=mil_core.RBF(4.0), max_iter=2, tol=1e-9, random_state=0).fit(X, bags, y)
    assert not model.converged_ and model.n_iter_ == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConvergenceWarning)
        model = mil_core.VGPMIL(n_inducing=5, kernel=mil_core.RBF(4.0), max_iter=200, tol=1e-3, random_state=0).fit(X, bags, y)
    assert model.converged_ and model.n_iter_ < 200


def test_near_constant_bag_probabilities_are_reported():
    assert diagnostics.constant_predictions(np.array([0.5, 0.5004, 0.4999])) is not None
    assert "3 bag probabilities lie in [0.4999, 0.5004]" in diagnostics.constant_predictions(np.array([0.5, 0.5004, 0.4999]))
    assert diagnostics.constant_predictions(np.array([0.2, 0.8])) is None
    assert diagnostics.constant_predictions(np.array([0.3])) is None  # one bag: nothing to compare


def test_features_of_wildly_different_scales_are_reported_naming_the_columns():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(200, 3)) * np.array([1.0, 1e6, 0.5])
    X[:, 2] = 7.0  # a constant column is not a scale
    message = diagnostics.feature_scale_spread(X)
    assert message and "column 1" in message and "column 0" in message and "standardize: true" in message
    assert diagnostics.feature_scale_spread(X[:, [0, 2]]) is None
    assert diagnostics.feature_scale_spread(rng.normal(size=(50, 4)) * [1, 10, 100, 0.5]) is None


def test_the_scale_check_reads_a_sample_of_the_store(tmp_path):
    from tests.test_distributed import write_store

    X, bags, y, _ = make_toy_bags(n_bags=16, n_features=3, seed=4)
    mixed = write_store(tmp_path / "mixed.zarr", X * np.array([1.0, 1e6, 1.0]), bags, y)
    sample = diagnostics.sample_features(mixed, max_rows=10_000)
    assert sample.shape == X.shape and "factor" in diagnostics.feature_scale_spread(sample)
    plain = write_store(tmp_path / "plain.zarr", X, bags, y)
    assert diagnostics.feature_scale_spread(diagnostics.sample_features(plain)) is None


@pytest.mark.timeout(600)
@pytest.mark.usefixtures("prefect_server")
def test_the_pipeline_reports_unscaled_features_an_unconverged_fit_and_constant_predictions(tmp_path):
    """``standardize: false`` with a feature of scale 1e6: the kernel sees no similarity between
    instances, every bag (all of one size) gets the prior's probability, and the run says why."""
    import json
    from pathlib import Path

    import yaml

    from flows.pipeline import pipeline
    from tasks.store import BagData, CohortSpec, append_bags, create_cohort

    rng = np.random.default_rng(0)
    store = tmp_path / "c.zarr"
    create_cohort(store, CohortSpec(name="c", n_features=2, coords_dim=1, coords_meaning="index"))
    append_bags(store, [BagData(bag_id=f"b{b}", label=b % 2, source="memory",
                                features=rng.normal(size=(4, 2)) * [1e6, 1e-3] + [0.0, 3.0 * (b % 2)],
                                coords=np.arange(4)[:, None], instance_labels=np.full(4, -1)) for b in range(12)])
    config = {"name": "flat", "store": str(store), "output_dir": str(tmp_path / "out"),
              "model": {"name": "VGPMIL", "params": {"n_inducing": 6, "max_iter": 2, "tol": 1e-12, "random_state": 0}},
              "training": {"standardize": False}, "dask": {"n_workers": 1, "processes": False}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    result = pipeline(str(tmp_path / "c.yaml"))
    model_info = json.loads((Path(result["train"].path) / "model.json").read_text())
    assert any("feature scales differ" in w for w in model_info["warnings"])
    assert any("max_iter=2 without converging" in w for w in model_info["warnings"])
    report = Path(result["report"].path).read_text()
    assert "## Warnings" in report and "does not separate the bags" in report and "standardize: true" in report


def test_a_chosen_sweep_budget_is_no_convergence_failure_on_the_cluster_or_serially_but_a_user_max_iter_is(tmp_path):
    """``kernel=None`` chooses the number of sweeps too (``auto_max_iter_``): a run that stops there
    stopped where it was meant to, in ``fit`` and in ``fit_cohort`` alike; one that reaches the
    user's ``max_iter`` before ``tol`` warns in both."""
    from distributed import Client, LocalCluster

    from tasks.training.fit import fit_cohort
    from tests.test_distributed import write_store

    X, bags, y, _ = make_toy_bags(n_bags=16, seed=0)
    X = X.astype(np.float32).astype(np.float64)
    store = write_store(tmp_path / "c.zarr", X, bags, y)
    auto = dict(n_inducing=5, max_iter=40, tol=1e-12, random_state=0, standardize=False)  # kernel=None: it chooses variance and sweeps
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConvergenceWarning)
            serial = mil_core.VGPMIL(**auto).fit(X, bags, y)
            distributed = mil_core.VGPMIL(**auto)
            fit_cohort(distributed, store, client, run="auto")
        for model in (serial, distributed):  # it did stop at the chosen budget, unconverged
            assert model.auto_max_iter_ < 40 and model.n_iter_ == model.auto_max_iter_ and not model.converged_
        np.testing.assert_allclose(distributed.elbo_, serial.elbo_, rtol=1e-8)

        user = dict(n_inducing=5, kernel=mil_core.RBF(4.0), max_iter=3, tol=1e-12, random_state=0, standardize=False)
        with pytest.warns(ConvergenceWarning, match=r"stopped at max_iter=3 without converging"):
            mil_core.VGPMIL(**user).fit(X, bags, y)
        with pytest.warns(ConvergenceWarning, match=r"stopped at max_iter=3 without converging"):
            fit_cohort(mil_core.VGPMIL(**user), store, client, run="user")
