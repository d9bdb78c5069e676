"""The Prefect flows end to end on a real Prefect server, a real LocalCluster and real Zarr stores."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import yaml

from flows.config import ConfigError, PipelineConfig, load_config
from flows.pipeline import pipeline, predict_cohort, train_model
from tests.conftest import make_toy_bags
from tests.test_distributed import write_store

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("prefect_server")]

MODEL = {"name": "VGPMIL", "params": {"n_inducing": 10, "max_iter": 8, "random_state": 0}}


def write_config(tmp_path, store, **extra) -> str:
    config = {"name": "toy", "store": str(store), "output_dir": str(tmp_path / "out"), "model": MODEL,
              "dask": {"n_workers": 2, "processes": False}, **extra}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.fixture
def cohort(tmp_path):
    X, bags, y, _ = make_toy_bags(n_bags=30, seed=1)
    return write_store(tmp_path / "train.zarr", X, bags, y)


def test_pipeline_writes_model_predictions_and_report_and_a_rerun_repeats_nothing(tmp_path, cohort):
    config = write_config(tmp_path, cohort)
    first = pipeline(config)
    assert not any(r.reused for r in first.values())
    table = pd.read_parquet(first["report"].path.replace("report.md", "bag_predictions.parquet"))
    assert len(table) == 30 and set(table.columns) >= {"bag_id", "probability", "std", "predicted_label", "most_suspicious"}
    assert first["report"].info["bag_auc"] > 0.9
    assert json.loads(table["most_suspicious"][0])[0].keys() == {"row", "coords", "probability"}

    second = pipeline(config)
    assert all(r.reused for r in second.values())
    assert second["report"].info == first["report"].info


def test_a_changed_prediction_setting_recomputes_predictions_but_not_the_model(tmp_path, cohort):
    first = pipeline(write_config(tmp_path, cohort))
    changed = pipeline(write_config(tmp_path, cohort, prediction={"rule": "noisy_or"}))
    assert changed["train"].reused and changed["train"].path == first["train"].path
    assert not changed["predict"].reused and changed["predict"].key != first["predict"].key


def test_a_new_cohort_is_predicted_with_the_stored_model(tmp_path, cohort):
    trained = train_model(write_config(tmp_path, cohort))
    X, bags, y, _ = make_toy_bags(n_bags=10, seed=7)
    new = write_store(tmp_path / "new.zarr", X, bags, np.full_like(y, -1), unlabelled=set(np.unique(bags)))
    result = predict_cohort(write_config(tmp_path, cohort), trained.path, store=new)
    assert not result.reused and result.path.startswith(new)


def test_a_bad_config_fails_before_any_work_naming_the_field(tmp_path, cohort):
    config = write_config(tmp_path, cohort, model={"name": "VGPMIL", "params": {"n_inducing": 10, "learning_rate": 3}})
    with pytest.raises(ConfigError, match=r"model: .*no parameter\(s\) learning_rate"):
        load_config(config)
    with pytest.raises(ConfigError, match=r"training.checkpoint_every"):
        load_config(write_config(tmp_path, cohort, training={"checkpoint_every": 0}))
    with pytest.raises(ConfigError, match="unknown model 'SVM'"):
        load_config(write_config(tmp_path, cohort, model={"name": "SVM"}))
    assert not (tmp_path / "out").exists()


def test_relative_paths_are_read_from_the_config_folder(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"store": "data/c.zarr", "output_dir": "out"}))
    config = load_config(path)
    assert isinstance(config, PipelineConfig) and config.store == tmp_path / "data" / "c.zarr"


def test_an_interrupted_training_resumes_when_the_flow_is_rerun(tmp_path, cohort):
    from distributed import Client, LocalCluster

    from flows.config import make_model
    from tasks.prefect_tasks import fingerprint_cohort
    from tasks.training import fit_cohort

    config = load_config(write_config(tmp_path, cohort, training={"checkpoint_every": 3}))
    key = config.model_key(fingerprint_cohort.fn(cohort))

    def crash(iteration, objective):
        if iteration == 5:
            raise KeyboardInterrupt

    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        with pytest.raises(KeyboardInterrupt):
            fit_cohort(make_model(config.model), cohort, client, run=key, checkpoint_every=3, standardize=True, on_iteration=crash)
    result = train_model(write_config(tmp_path, cohort, training={"checkpoint_every": 3}))
    assert result.key == key and result.info["resumed_from"] == 3 and result.info["n_iter"] == 8


def test_predicting_a_cohort_with_other_features_fails_clearly_and_keeps_the_model(tmp_path, cohort):
    trained = train_model(write_config(tmp_path, cohort))
    X, bags, y, _ = make_toy_bags(n_bags=6, n_features=5, seed=3)
    other = write_store(tmp_path / "other.zarr", X, bags, y)
    with pytest.raises(ValueError, match=r"other.zarr has 5 features per instance, but the model was trained on 2"):
        predict_cohort(write_config(tmp_path, cohort), trained.path, store=other)
    assert (tmp_path / "out" / "models" / trained.key / "model.pkl").exists()


def test_the_cli_runs_the_pipeline_and_reports_a_bad_config_without_a_traceback(tmp_path, cohort, capsys):
    from flows.cli import main

    assert main(["run", write_config(tmp_path, cohort)]) == 0
    out = capsys.readouterr().out
    assert "report" in out and "report.md" in out
    bad = write_config(tmp_path, cohort, training={"mode": "sometimes"})
    assert main(["train", bad]) == 2
    assert "training.mode" in capsys.readouterr().err


def test_demo_pipeline_on_generated_slides_and_ct_scans_skips_a_corrupt_slide_and_reruns_for_free(tmp_path):
    from flows.demo import write_demo_configs

    configs = write_demo_configs(tmp_path, n_slides=6, n_scans=6, n_corrupt=1, max_iter=10)
    wsi = pipeline(str(configs["wsi"]))
    skipped = wsi["ingest"].info["skipped"]
    assert [s["bag_id"] for s in skipped] == ["corrupt_00000"] and skipped[0]["path"].endswith("corrupt_00000.tiff")
    assert len(wsi["ingest"].info["added"]) == 6
    out = tmp_path / "runs" / "wsi" / "predictions" / wsi["predict"].key
    assert len(list((out / "heatmaps").glob("*.png"))) == 4 and (out / "report.md").read_text().count("data:image/png") >= 5

    ct = pipeline(str(configs["ct"]))
    assert len(ct["ingest"].info["added"]) == 6
    assert (tmp_path / "runs" / "ct" / "predictions" / ct["predict"].key / "slices").is_dir()
    assert "instance_auc" in ct["report"].info  # slice labels from the RSNA-style CSV

    again = pipeline(str(configs["ct"]))
    assert all(r.reused for r in again.values())


def test_progress_bars_say_how_far_a_stage_is():
    from tasks.prefect_tasks import progress_bar

    assert progress_bar(0, 4, width=8) == "[........] 0/4"
    assert progress_bar(3, 4, width=8) == "[######..] 3/4"
    assert progress_bar(0, 0, width=4) == "[....] 0/0"
