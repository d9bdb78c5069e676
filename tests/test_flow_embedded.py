"""EmbeddedGPMIL from the pipeline configuration (issue 15), through the Prefect flow on a real
Prefect server, LocalCluster and Zarr store: the embedding is fitted on the training cohort and
saved with the model as plain arrays (no pickle, no torch file), and the saved model, loaded back in
a separate prediction run, gives the predictions of ``fit`` on the same bags."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from flows.pipeline import pipeline, predict_cohort
from mil_core import EmbeddedGPMIL
from tasks.prefect_tasks import load_model
from tasks.training import read_predictions
from tests.test_distributed import write_store
from tests.test_flows import cohort, write_config  # noqa: F401  (the fixture)

pytest.importorskip("torch", reason='training the network needs the optional extra "torch"')
pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("prefect_server")]

# The ensemble's path (member GPs on the embeddings); a fit that keeps the GP on the input features
# is test_embedded.py's (representation="auto" would keep it on these bags).
PARAMS = {"n_networks": 2, "n_components": 4, "hidden": [16], "attention_dim": 8, "learning_rate": 0.01, "max_epochs": 15, "random_state": 0,
          "representation": "embedding", "gp": {"name": "VGPMIL", "params": {"n_inducing": 10, "max_iter": 10, "random_state": 0}}}


def test_embedded_gp_mil_trains_saves_as_arrays_and_predicts_from_the_config(tmp_path, cohort):  # noqa: F811
    from flows.config import ModelConfig, make_model
    from tests.conftest import make_toy_bags

    config = write_config(tmp_path, cohort, model={"name": "EmbeddedGPMIL", "params": PARAMS}, training={"standardize": False})
    result = pipeline(config)
    table = pd.read_parquet(result["report"].path.replace("report.md", "bag_predictions.parquet"))

    X, bags, y, _ = make_toy_bags(n_bags=30, seed=1)
    X = X.astype(np.float32).astype(np.float64)  # the store keeps float32 features
    serial = make_model(ModelConfig(name="EmbeddedGPMIL", params=PARAMS))
    assert isinstance(serial, EmbeddedGPMIL)
    serial.set_params(standardize=False).fit(X, bags, y)  # training.standardize is the model's standardize
    expected = serial.predict_bag_proba(X, bags)[1]
    np.testing.assert_allclose(table["probability"], expected, rtol=1e-6)
    order = np.argsort(bags, kind="stable")  # the store's rows: bags in id order
    # instance probabilities: the GP's closed form (prediction.method), the same in every partition
    np.testing.assert_allclose(read_predictions(cohort, result["predict"].key)["instances/proba"],
                               serial.predict_instance_proba(X[order], method="probit"), rtol=1e-6)

    model_dir = Path(result["train"].path)
    assert (result["train"].info["n_bags"], result["train"].info["n_instances"]) == (30, len(X))  # not a member's share
    saved = sorted(p.name for p in model_dir.iterdir() if p.is_file())
    assert not any(p.endswith((".pkl", ".pickle", ".pt", ".pth", ".joblib", ".safetensors")) for p in saved), saved
    with np.load(model_dir / "model.npz", allow_pickle=False) as stored:  # readable without running anything
        tree = json.dumps(json.loads(stored["__gpmil__"].tobytes().decode()))
        assert '"network_states_"' in tree and len(stored.files) > sum(map(len, serial.network_states_))
    trained = load_model(model_dir).estimator
    assert trained.standardize is False and trained.feature_mean_ is None
    assert len(trained.network_states_) == len(serial.network_states_) == PARAMS["n_networks"]  # the ensemble's members
    members = json.loads((model_dir / "model.json").read_text())["choices"]["members"]  # each member GP's own choice
    assert [m["kernel_variance"] for m in members] == [gp.kernel_.variance for gp in serial.gps_]
    assert [m["bag_rule"] for m in members] == [gp.bag_rule_ for gp in serial.gps_]
    variances = ", ".join(f"{gp.kernel_.variance:g}" for gp in serial.gps_)
    assert f"Its 2 member GPs chose from their training bags: kernel variances {variances}" in Path(result["report"].path).read_text()
    assert "Bag probabilities of this prediction: the ensemble's calibrated score" in Path(result["report"].path).read_text()
    for state, serial_state in zip(trained.network_states_, serial.network_states_, strict=True):
        for name, weights in serial_state.items():  # the embeddings fitted on the training cohort, as weights
            np.testing.assert_array_equal(state[name], weights, err_msg=name)

    other = write_store(tmp_path / "other.zarr", X, bags, y)  # a second cohort, predicted by the saved model
    predicted = predict_cohort(config, str(model_dir), store=other)
    assert not predicted.reused
    np.testing.assert_allclose(read_predictions(other, predicted.key)["bags/proba"], expected, rtol=1e-6)
