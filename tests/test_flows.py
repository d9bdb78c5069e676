"""The Prefect flows end to end on a real Prefect server, a real LocalCluster and real Zarr stores."""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
import zarr

from flows.checks import check_inputs
from flows.config import ConfigError, PipelineConfig, load_config
from flows.pipeline import pipeline, predict_cohort, train_model
from tasks.paths import safe_filename
from tasks.store import open_cohort
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
    suspicious = json.loads(table["most_suspicious"][0])[0]
    assert suspicious.keys() == {"row", "instance", "coords", "probability"}
    instances = pd.read_parquet(first["report"].path.replace("report.md", "instance_predictions.parquet"))
    match = instances[(instances["bag_id"] == table["bag_id"][0]) & (instances["instance"] == suspicious["instance"])]
    assert match["probability"].round(6).tolist() == [suspicious["probability"]]  # joins on (bag id, instance)
    umask = os.umask(0)
    os.umask(umask)
    written = [*(tmp_path / "out" / "models").glob("*/model.*"), *(tmp_path / "out" / "runs").glob("*.json")]
    assert {p.name for p in written} >= {"model.npz", "model.json"}
    for path in written:  # readable by whom the umask lets read (a served prediction under another account)
        assert path.stat().st_mode & 0o777 == 0o666 & ~umask, path

    second = pipeline(config)
    assert all(r.reused for r in second.values())
    assert second["report"].info == first["report"].info

    out = Path(first["report"].path).parent  # a table or metrics file deleted since: the report is written again
    (out / "metrics.json").unlink()
    (out / "bag_predictions.csv").unlink()
    third = pipeline(config)
    assert not third["report"].reused and third["report"].info == first["report"].info
    assert (out / "metrics.json").is_file() and (out / "bag_predictions.csv").is_file()
    assert pipeline(config)["report"].reused

    model_dir = Path(first["train"].path)  # the model's description deleted: trained again, not a FileNotFoundError
    (model_dir / "model.json").unlink()
    again = pipeline(config)
    assert not again["train"].reused and json.loads((model_dir / "model.json").read_text())["n_iter"] >= 1
    assert again["report"].info == first["report"].info


def test_a_changed_prediction_setting_recomputes_predictions_but_not_the_model(tmp_path, cohort):
    """…and a report copies the model folder's objective figure, never a link planted there in its
    place (the copy would put any file the run can read into the shared report)."""
    first = pipeline(write_config(tmp_path, cohort))
    secret = tmp_path / "secret.txt"
    secret.write_text("PRIVATE KEY")
    figure = Path(first["train"].path) / "objective.png"
    assert Path(first["report"].path).with_name("objective.png").read_bytes() == figure.read_bytes()
    assert "](objective.png)" in Path(first["report"].path).read_text()
    figure.unlink()
    figure.symlink_to(secret)
    changed = pipeline(write_config(tmp_path, cohort, prediction={"rule": "noisy_or"}))
    assert changed["train"].reused and changed["train"].path == first["train"].path
    assert not changed["predict"].reused and changed["predict"].key != first["predict"].key
    report = Path(changed["report"].path)
    assert report.exists() and not report.with_name("objective.png").exists()
    assert "](objective.png)" not in report.read_text()


def test_a_new_cohort_is_predicted_with_the_stored_model_on_clusters_named_by_class_path(tmp_path, cohort):
    adaptive = {"cluster_class": "distributed.LocalCluster", "cluster_kwargs": {"n_workers": 1, "processes": False},
                "adapt_kwargs": {"minimum": 1, "maximum": 2}}
    trained = train_model(write_config(tmp_path, cohort, dask=adaptive))
    X, bags, y, _ = make_toy_bags(n_bags=10, seed=7)
    new = write_store(tmp_path / "new.zarr", X, bags, np.full_like(y, -1), unlabelled=set(np.unique(bags)))
    spec = {"cluster_class": "distributed.SpecCluster", "cluster_kwargs": {
        "scheduler": {"cls": "distributed.Scheduler", "options": {"dashboard_address": ":0"}},
        "workers": {"w": {"cls": "distributed.Worker", "options": {"nthreads": 1}}}}}
    result = predict_cohort(write_config(tmp_path, cohort, dask=spec), trained.path, store=new)
    assert not result.reused and result.path.startswith(new)
    table = pd.read_csv(Path(result.info["report"]).parent / "bag_predictions.csv")  # a store predicted gets its report too
    assert len(table) == 10 and result.info["store"] == new


def test_a_bad_config_fails_before_any_work_naming_the_field(tmp_path, cohort):
    config = write_config(tmp_path, cohort, model={"name": "VGPMIL", "params": {"n_inducing": 10, "learning_rate": 3}})
    with pytest.raises(ConfigError, match=r"model: .*no parameter\(s\) learning_rate"):
        load_config(config)
    with pytest.raises(ConfigError, match=r"training.checkpoint_every"):
        load_config(write_config(tmp_path, cohort, training={"checkpoint_every": 0}))
    with pytest.raises(ConfigError, match="unknown model 'SVM'"):
        load_config(write_config(tmp_path, cohort, model={"name": "SVM"}))
    with pytest.raises(ConfigError, match=r"model: .*use training.standardize, not model.params.standardize"):
        load_config(write_config(tmp_path, cohort, model={"name": "VGPMIL", "params": {"standardize": False}}))
    with pytest.raises(ConfigError, match=r"prediction.rule='max': VWSGP scores bags by its own rule"):
        load_config(write_config(tmp_path, cohort, model={"name": "VWSGP"}, prediction={"rule": "max"}))
    with pytest.raises(ConfigError, match=r"model: .*EmbeddedGPMIL's gp must be a GP-MIL model .* not VWSGP"):  # whatever the rule
        load_config(write_config(tmp_path, cohort, model={"name": "EmbeddedGPMIL", "params": {"gp": {"name": "VWSGP"}}},
                                 prediction={"rule": "max"}))
    assert load_config(write_config(tmp_path, cohort, model={"name": "VGPMILPR"}, prediction={"rule": "max"})).prediction.rule == "max"
    for kernel, problem in (({"varience": 4}, r"params.kernel has no field\(s\) varience"), ("rbf", r"params.kernel must be a mapping"),
                            ({"length_scale": "ARD"}, r"params.kernel: length_scale must be .* got 'ARD'"),
                            ({"variance": -1}, r"params.kernel: kernel variance must be a positive"),
                            ({"variance": 2, "bias": -1}, r"params.kernel: kernel bias must be a finite number >= 0, got -1")):
        with pytest.raises(ConfigError, match=rf"model: .*{problem}"):
            load_config(write_config(tmp_path, cohort, model={"name": "VGPMIL", "params": {"kernel": kernel}}))
    with pytest.raises(ConfigError, match=r"dask.cluster_class: .*cannot import dask_jobqeue"):
        load_config(write_config(tmp_path, cohort, dask={"cluster_class": "dask_jobqeue.SLURMCluster"}))
    with pytest.raises(ConfigError, match=r"dask: .*cluster_kwargs: n_wrokers \(did you mean n_workers\?\) is no parameter of a LocalCluster"):
        load_config(write_config(tmp_path, cohort, dask={"cluster_kwargs": {"n_wrokers": 2}}))  # was 'Nanny failed to start'
    for kwargs, problem in (({"n_workers": "two"}, r"n_workers: 'two' is not a whole number >= 1"),  # was a traceback from its event loop
                            ({"threads_per_worker": "2"}, r"threads_per_worker: '2' is not a whole number >= 1"),  # was 'Nanny failed to start'
                            ({"nthreads": 0}, r"nthreads: 0 is not a whole number >= 1"),
                            ({"n_workers": True}, r"n_workers: True is not a whole number"),
                            ({"n_workers": 0}, r"n_workers: 0 starts no worker and the run would wait for one"),
                            ({"processes": "no"}, r"processes: 'no' is not true or false")):  # started processes
        with pytest.raises(ConfigError, match=rf"dask: .*cluster_kwargs: {problem}"):
            load_config(write_config(tmp_path, cohort, dask={"cluster_kwargs": kwargs}))
    assert load_config(write_config(tmp_path, cohort, dask={"cluster_kwargs": {"memory_limit": "2GB", "nthreads": 1, "resources": {"GPU": 1}}}))
    assert load_config(write_config(tmp_path, cohort, dask={"cluster_kwargs": {"n_workers": 0, "processes": False},
                                                             "adapt_kwargs": {"minimum": 1, "maximum": 2}}))
    assert load_config(write_config(tmp_path, cohort, dask={"cluster_kwargs": {"n_workers": None, "processes": None}}))  # their defaults
    (tmp_path / "list.yaml").write_text("- distributed\n")
    with pytest.raises(ConfigError, match=r"dask.config_file: .*list.yaml: a Dask configuration file holds a mapping, not list"):
        load_config(write_config(tmp_path, cohort, dask={"config_file": str(tmp_path / "list.yaml")}),
                    preflight=lambda c: check_inputs(c, "train"))
    with pytest.raises(ConfigError, match=r"dask.adapt_kwargs: .*1 <= minimum <= maximum \(got minimum=0"):
        load_config(write_config(tmp_path, cohort, dask={"adapt_kwargs": {"minimum": 0, "maximum": 4}}))
    with pytest.raises(ConfigError, match=r"dask: .*either scheduler_address .* or cluster_class"):
        load_config(write_config(tmp_path, cohort, dask={"scheduler_address": "tcp://h:8786", "cluster_class": "distributed.LocalCluster"}))
    with pytest.raises(ConfigError, match=r"ingest: .*labels applies to ingest.kind wsi, ct, h5 and npy; a feature table"):
        load_config(write_config(tmp_path, cohort, ingest={"kind": "features", "source": "t.csv",
                                                           "labels": {"file": "c.csv", "id_column": "a", "label_column": "b"}}))
    assert not (tmp_path / "out").exists()


def test_numbers_written_as_1e12_are_numbers_and_a_python_tag_is_refused(tmp_path, cohort):
    # PyYAML reads YAML 1.1, where 1e12 and 1e-6 (no decimal point) are strings
    path = tmp_path / "config.yaml"
    path.write_text(f"name: toy\nstore: {cohort}\noutput_dir: {tmp_path / 'out'}\n"
                    "model: {name: VGPMIL, params: {H: 1e12, tol: 1e-6, n_inducing: 10, bag_rule: max}}\n")
    params = load_config(path).model.params
    assert params == {"H": 1e12, "tol": 1e-6, "n_inducing": 10, "bag_rule": "max"}
    assert isinstance(params["H"], float) and isinstance(params["tol"], float)
    marker = tmp_path / "ran"
    path.write_text(f"name: !!python/object/apply:os.system ['touch {marker}']\nstore: {cohort}\n")
    with pytest.raises(ConfigError, match="not valid YAML.*python/object/apply"):
        load_config(path)
    assert not marker.exists()


def test_relative_paths_are_read_from_the_config_folder_and_a_tilde_as_the_home_folder(tmp_path, monkeypatch):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"store": "data/c.zarr", "output_dir": "out"}))
    config = load_config(path)
    assert isinstance(config, PipelineConfig) and config.store == tmp_path / "data" / "c.zarr"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # '~/c.zarr' was <config folder>/~/c.zarr, a folder named '~'
    path.write_text(yaml.safe_dump({"store": "~/c.zarr", "output_dir": "~/out", "ingest": {"kind": "wsi", "source": "~/slides"}}))
    config = load_config(path)
    assert (config.store, config.output_dir, config.ingest.source) == (tmp_path / "home" / "c.zarr", tmp_path / "home" / "out",
                                                                       tmp_path / "home" / "slides")
    path.write_text(yaml.safe_dump({"store": "~no-such-user-here/c.zarr", "output_dir": "out"}))  # was a bare RuntimeError
    with pytest.raises(ConfigError, match=rf"^{path}: '~no-such-user-here/c.zarr': cannot read its '~'"):
        load_config(path)


def test_an_interrupted_training_resumes_when_the_flow_is_rerun(tmp_path, cohort):
    from distributed import Client, LocalCluster

    from flows.config import make_model
    from tasks.prefect_tasks import fingerprint_cohort
    from tasks.training import fit_cohort

    fixed = {"name": "VGPMIL", "params": {**MODEL["params"], "kernel": {"variance": 4.0}}}  # all 8 sweeps, not a chosen stop
    config = load_config(write_config(tmp_path, cohort, model=fixed, training={"checkpoint_every": 3}))
    key = config.model_key(fingerprint_cohort.fn(cohort))

    def crash(iteration, objective):
        if iteration == 5:
            raise KeyboardInterrupt

    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        with pytest.raises(KeyboardInterrupt):
            fit_cohort(make_model(config.model), cohort, client, run=key, checkpoint_every=3, standardize=True, on_iteration=crash)
    result = train_model(write_config(tmp_path, cohort, model=fixed, training={"checkpoint_every": 3}))
    assert result.key == key and result.info["resumed_from"] == 3 and result.info["n_iter"] == 8


def test_predicting_a_cohort_with_other_features_fails_clearly_and_keeps_the_model(tmp_path, cohort):
    trained = train_model(write_config(tmp_path, cohort))
    X, bags, y, _ = make_toy_bags(n_bags=6, n_features=5, seed=3)
    other = write_store(tmp_path / "other.zarr", X, bags, y)
    with pytest.raises(ValueError, match=r"other.zarr has 5 features per instance, but the model was trained on 2"):
        predict_cohort(write_config(tmp_path, cohort), trained.path, store=other)
    assert (tmp_path / "out" / "models" / trained.key / "model.npz").exists()


def test_a_kernel_written_in_the_config_is_the_trained_models_ard_kernel(tmp_path, cohort):
    """``model.params.kernel`` in YAML: an RBF's fields; ``length_scale: ard`` learns one scale per feature."""
    from tasks.prefect_tasks import load_model

    params = {**MODEL["params"], "max_iter": 4, "kernel": {"variance": 4.0, "length_scale": "ard"}, "learn_kernel": True}
    trained = train_model(write_config(tmp_path, cohort, model={"name": "VGPMIL", "params": params}))
    model = load_model(trained.path).estimator
    assert model.kernel.length_scale == "ard" and len(model.kernel_.length_scale) == open_cohort(cohort).n_features
    assert model.kernel_ != model.kernel.resolve(open_cohort(cohort).n_features)  # learnt away from its √D start
    info = json.loads((Path(trained.path) / "model.json").read_text())
    assert info["params"]["kernel"] == {"variance": 4.0, "length_scale": "ard"}
    scales = np.asarray(model.kernel_.length_scale)
    assert info["choices"]["shortest_length_scales"] == {str(d): round(float(scales[d]), 4) for d in np.argsort(scales, kind="stable")}


def test_the_cli_runs_the_pipeline_and_reports_a_bad_config_without_a_traceback(tmp_path, cohort, capsys):
    from flows.cli import main

    # no model name: the pipeline's default model, VGPMIL with its automatic choices
    assert main(["run", write_config(tmp_path, cohort, model={"params": {**MODEL["params"], "max_iter": 40}})]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in lines] == [["train", "done"], ["predict", "done"], ["report", "done"]]
    [info] = [json.loads(p.read_text()) for p in (tmp_path / "out" / "models").glob("*/model.json")]
    # kernel=None stopped it at the sweeps it chose: not a failure to converge
    assert not info["converged"] and info["n_iter"] == info["chosen_sweeps"] < 40
    # what the defaults chose on the training bags, in model.json, the CLI line and the report
    choices = info["choices"]
    assert set(choices["held_out_auc_by_variance"]) == {"0.25", "1", "4", "16", "64"}
    assert f"{choices['kernel_variance']:g}" in choices["held_out_auc_by_variance"]
    assert choices["bag_rule"] == "top_fraction" and choices["bag_rule_chosen"]  # VGPMIL's default "auto" kept it here
    assert set(choices["held_out_auc_by_H"]) == {"100", "1e+12"} and f"{choices['H']:g}" in choices["held_out_auc_by_H"]
    assert f"VGPMIL on 30 bags, {info['n_iter']} iterations (the sweeps chosen with the kernel), bag rule top_fraction" in lines[0]
    report_text = Path(lines[2].split("-> ")[1]).read_text()
    assert f"Fitted with kernel variance {choices['kernel_variance']:g}" in report_text
    assert f"bag-likelihood odds H = {choices['H']:g} (`H=\"auto\"`, chosen with the kernel" in report_text
    assert f"{info['n_iter']} sweeps, chosen with it; bag rule `top_fraction`" in report_text
    assert "30 bags" in lines[1] and "bag_auc" in lines[2] and "bag_f1" in lines[2]
    assert lines[2].endswith("report.md") and not any("StageResult(" in line for line in lines)
    bad = write_config(tmp_path, cohort, training={"mode": "sometimes"})
    assert main(["train", bad]) == 2
    assert "training.mode" in capsys.readouterr().err
    for params, message in (({"max_iter": 0}, "max_iter must be an integer >= 1, got 0"),  # was found by the fit, after the ingest
                            ({"n_inducing": 1.5}, "n_inducing must be an integer >= 2, got 1.5"),
                            ({"tol": "0.001"}, "VGPMIL's tol must be a number, got the text '0.001'")):  # was a bare TypeError
        assert main(["train", write_config(tmp_path, cohort, model={"name": "VGPMIL", "params": params})]) == 2
        assert f"model: Value error, {message}" in capsys.readouterr().err


def task_runs_of(flow_run_id, n_expected: int) -> list:
    """The task runs of a flow run as the Prefect server recorded them (task run states reach the
    server as events, so wait until all ``n_expected`` are there and final)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            if len(runs) >= n_expected and all(r.state is not None and r.state.is_final() for r in runs) or time.monotonic() > deadline:
                return runs


@pytest.fixture
def slide_folder(tmp_path):
    from tasks.ingest.synthetic import make_slide_cohort

    folder = tmp_path / "slides"
    make_slide_cohort(folder, 4, map_shape=(16, 24), seed=5, tile=128, n_corrupt=1)
    return folder


def test_ingest_runs_one_named_task_per_slide_a_corrupt_slide_fails_only_its_own_and_a_rerun_redoes_no_slide(tmp_path, slide_folder):
    from flows.pipeline import ingest_cohort

    config = write_config(tmp_path, tmp_path / "slides.zarr", ingest={"kind": "wsi", "source": str(slide_folder),
                                                                      "labels": str(slide_folder / "labels.csv"), "tile_size": 128})
    state = ingest_cohort(config, return_state=True)
    result = state.result()
    runs = {r.name: r for r in task_runs_of(state.state_details.flow_run_id, n_expected=7)}
    per_slide = {name: run for name, run in runs.items() if run.task_key.startswith("ingest_item")}
    assert sorted(per_slide) == ["ingest corrupt_00000"] + [f"ingest slide_{i:05d}" for i in range(4)]
    assert per_slide["ingest corrupt_00000"].state.is_failed() and per_slide["ingest corrupt_00000"].run_count == 1  # bad input: no retry
    assert all(run.state.is_completed() for name, run in per_slide.items() if name != "ingest corrupt_00000")
    assert any(name.startswith("list wsi inputs") for name in runs) and runs[f"finalise {tmp_path / 'slides.zarr'}"].state.is_completed()
    assert list(result.info["added"]) == [f"slide_{i:05d}" for i in range(4)]
    assert [(s["bag_id"], s["error"]) for s in result.info["skipped"]] == [("corrupt_00000", "UnreadableFileError")]
    assert list(open_cohort(tmp_path / "slides.zarr").bag_ids) == list(result.info["added"])

    again = ingest_cohort(config, return_state=True)
    rerun = task_runs_of(again.state_details.flow_run_id, n_expected=3)
    assert [r.name for r in rerun if r.task_key.startswith("ingest_item")] == ["ingest corrupt_00000"]  # only the failed one is retried
    assert again.result().reused and len(again.result().info["already_done"]) == 4
    # A slide replaced since its ingest is reported, not reused as done; the store keeps the bag it has.
    shutil.copy(slide_folder / "slide_00002.tiff", slide_folder / "slide_00001.tiff")
    replaced = ingest_cohort(config).info
    assert len(replaced["already_done"]) == 3 and not replaced["added"]
    changed = [(s["bag_id"], s["error"]) for s in replaced["skipped"] if s["error"] != "UnreadableFileError"]
    assert changed == [("slide_00001", "SourceChangedError")]
    assert open_cohort(tmp_path / "slides.zarr").n_bags == 4


def test_a_feature_table_ingest_lists_each_input_it_left_out_as_the_slide_ingest_does(tmp_path, caplog):
    """The features/h5/npy kinds logged only '1 skipped': no warning naming the bag, no artifact."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.pipeline import ingest_cohort

    rows = "".join(f"{label},bag{b},{b}.0,1.0\n" for b, label in enumerate([0, 1, 0, 1, 0, 1]))
    (tmp_path / "t.csv").write_text(rows + "2,odd,1.0,2.0\n")  # one bag with label 2
    config = write_config(tmp_path, tmp_path / "t.zarr", ingest={"kind": "features", "source": str(tmp_path / "t.csv")})
    state = ingest_cohort(config, return_state=True)
    assert len(state.result().info["added"]) == 6
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    table = next(a for a in artifacts if a.key == "skipped-inputs-toy")
    assert "odd" in str(table.data) and "MissingLabelError" in str(table.data)
    assert any(r.levelname == "WARNING" and f"skipped {tmp_path / 't.csv'} [bag odd]: MissingLabelError" in r.getMessage()
               for r in caplog.records)


def test_only_transient_errors_are_retried():
    from distributed import KilledWorker

    from tasks.ingest.errors import NoTissueError, UnreadableFileError
    from tasks.prefect_tasks import is_transient

    assert is_transient(OSError("stale file handle")) and is_transient(TimeoutError()) and is_transient(KilledWorker("k", "w", 3))
    assert not is_transient(UnreadableFileError("truncated", path="a.tiff")) and not is_transient(NoTissueError("none"))
    assert not is_transient(ValueError("a bug")) and not is_transient(None)
    assert is_transient(ConnectionResetError()) and is_transient(OSError(116, "Stale file handle"))
    for deterministic in (FileNotFoundError(2, "No such file", "a.tiff"), PermissionError(13, "denied"), IsADirectoryError(21, "dir")):
        assert not is_transient(deterministic)
    from distributed.comm.core import CommClosedError

    try:  # a connection closed as Ctrl-C unwinds: the user stopped the run, no retry resumes it
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise CommClosedError("in <TCP (closed)>: Stream is closed")
    except CommClosedError as closed:
        assert not is_transient(closed)
    assert is_transient(CommClosedError("in <TCP (closed)>: Stream is closed"))


def test_a_flow_run_with_a_missing_input_fails_before_any_task_or_cluster(tmp_path, cohort):
    config = write_config(tmp_path, tmp_path / "moved.zarr")
    state = train_model(config, return_state=True)
    assert state.is_failed() and "store: " + str(tmp_path / "moved.zarr") + " does not exist" in state.message
    assert task_runs_of(state.state_details.flow_run_id, n_expected=0) == []


def test_a_deterministic_task_failure_is_not_retried(tmp_path, cohort):
    not_a_store = tmp_path / "empty.zarr"
    not_a_store.mkdir()
    state = train_model(write_config(tmp_path, not_a_store), return_state=True)
    assert state.is_failed()
    runs = task_runs_of(state.state_details.flow_run_id, n_expected=1)
    assert [(r.name, r.run_count, r.state.is_failed()) for r in runs] == [(f"fingerprint {not_a_store}", 1, True)]


def test_a_bad_config_or_a_missing_input_fails_in_one_line_before_prefect_or_mil_core_is_imported(tmp_path, cohort):
    import subprocess
    import sys

    bad = write_config(tmp_path, cohort, training={"mode": "sometimes"})
    missing = tmp_path / "missing.yaml"
    missing.write_text(yaml.safe_dump({"store": str(tmp_path / "s.zarr"), "output_dir": "out",
                                       "ingest": {"kind": "wsi", "source": "slides", "labels": "labels.csv"}}))
    a_file, binary = tmp_path / "a_file", tmp_path / "binary.yaml"
    a_file.write_text("not a folder")
    binary.write_bytes(bytes(range(128, 256)))
    (tmp_path / "t.csv").write_text("0,a,1.0\n1,b,2.0\n")
    for folder in ("t", "o", "p"):  # one config file per folder
        (tmp_path / folder).mkdir()
    table_config = write_config(tmp_path / "t", tmp_path / "t.zarr", ingest={"kind": "features", "source": str(tmp_path / "t.csv")})
    file_output = write_config(tmp_path / "o", cohort, output_dir=str(a_file))
    system_output = write_config(tmp_path / "p", cohort, output_dir="/proc/gpmil-runs")  # no file can be made there, even by root
    probe = ("import sys; from flows.cli import main; rc = main(sys.argv[1:]); "
             "print(rc, sorted(m for m in ('prefect', 'mil_core', 'distributed') if m in sys.modules))")
    for args, message in [(["run", bad], f"gpmil: {bad}: training.mode: Input should be 'auto', 'persist' or 'stream'"),
                          (["ingest", str(missing)], f"gpmil: {missing}: ingest.source: {tmp_path / 'slides'} does not exist; "
                                                     f"ingest.labels: {tmp_path / 'labels.csv'} does not exist"),
                          (["train", str(missing), "--store", str(tmp_path / "none.zarr")],
                           f"gpmil: {missing}: --store: {tmp_path / 'none.zarr'} does not exist"),
                          (["ingest", table_config, "--store", str(a_file)], f"gpmil: {table_config}: --store: {a_file} is not a folder"),
                          (["run", file_output], f"gpmil: {file_output}: output_dir: {a_file} is not a folder"),
                          (["run", system_output], f"gpmil: {system_output}: output_dir: /proc/gpmil-runs cannot be written (/proc: "),
                          (["run", str(binary)], f"gpmil: {binary}: not a readable YAML text file (UnicodeDecodeError"),
                          (["run", str(tmp_path)], f"gpmil: {tmp_path}: not a readable YAML text file (IsADirectoryError")]:
        done = subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[1])
        assert done.stdout.strip() == "2 []", done.stderr
        assert done.stderr.count("\n") == 1 and done.stderr.startswith(message) and "Traceback" not in done.stderr


def test_a_key_given_twice_in_a_config_section_is_refused_naming_it(tmp_path, cohort):
    path = Path(write_config(tmp_path, cohort))
    path.write_text(path.read_text() + "name: other\n")
    with pytest.raises(ConfigError, match=r"key 'name' given twice in one section"):
        load_config(path)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory, prefect_server):
    from flows.demo import demo, write_demo_configs

    workdir = tmp_path_factory.mktemp("demo")
    sizes = dict(n_slides=6, n_scans=6, n_heldout=6, n_corrupt=1, max_iter=10)
    reports = demo(str(workdir), **sizes)
    return workdir, reports, write_demo_configs(workdir, **sizes)


def test_demo_trains_on_one_cohort_and_reports_metrics_on_a_held_out_cohort(demo_run):
    workdir, reports, _ = demo_run
    for modality in ("wsi", "ct"):
        report = Path(reports[modality])
        text = report.read_text()
        assert f"`{workdir / 'stores' / f'{modality}-heldout.zarr'}` (6 bags" in text and "held-out cohort" in text
        assert "in-sample" not in text
        table = pd.read_parquet(report.with_name("bag_predictions.parquet"))
        assert len(table) == 6 and all(Path(s).is_relative_to(workdir / "raw" / f"{modality}-heldout") for s in table["source"])
        metrics = json.loads(report.with_name("metrics.json").read_text())
        assert metrics["n_bags"] == 6 and 0 <= metrics["bag_auc"] <= 1
        model = json.loads((Path(text.split("model `")[1].split("`")[0]) / "model.json").read_text())
        assert model["store"] == str(workdir / "stores" / f"{modality}.zarr") and model["n_bags"] == 6
    assert len(list((Path(reports["wsi"]).parent / "heatmaps").glob("*.png"))) == 4
    for modality in ("wsi", "ct"):
        report = Path(reports[modality])
        figures = re.findall(r"!\[[^]]*\]\(([^)]+)\)", report.read_text())
        assert len(figures) >= 6 and all((report.parent / f).is_file() for f in figures)  # ELBO, ROC, 4 heatmaps / slice plots
        assert "base64" not in report.read_text() and report.stat().st_size < 20_000
    assert (Path(reports["ct"]).parent / "slices").is_dir() and "instance_auc" in json.loads(Path(reports["ct"]).with_name("metrics.json").read_text())
    trained, held_out = open_cohort(workdir / "stores" / "wsi.zarr"), open_cohort(workdir / "stores" / "wsi-heldout.zarr")
    assert held_out.attrs["feature_extractor"] == trained.attrs["feature_extractor"]  # the model's features, not refitted
    wsi_out, ct_out = Path(reports["wsi"]).parent, Path(reports["ct"]).parent
    instances = pd.read_parquet(wsi_out / "instance_predictions.parquet")
    assert list(instances.columns) == ["bag_id", "instance", "x", "y", "probability", "std"] and len(instances) == held_out.n_instances
    first = instances[instances["bag_id"] == held_out.bag_ids[0]]
    geojson = json.loads((wsi_out / "geojson" / safe_filename(held_out.bag_ids[0], ".geojson")).read_text())
    ring = geojson["features"][0]["geometry"]["coordinates"][0]
    assert len(geojson["features"]) == len(first) and ring[0] == [first["x"].iloc[0], first["y"].iloc[0]]
    assert ring[2][0] - ring[0][0] == ring[2][1] - ring[0][1] > 0  # a square tile in level-0 pixels
    assert geojson["features"][0]["properties"]["measurements"]["probability"] == pytest.approx(first["probability"].iloc[0])
    ct_instances = pd.read_parquet(ct_out / "instance_predictions.parquet")
    assert list(ct_instances.columns[:4]) == ["bag_id", "instance", "slice_index", "sop_instance_uid"]
    assert ct_instances["sop_instance_uid"].str.len().min() > 10 and ct_instances["sop_instance_uid"].is_unique
    assert len(list((ct_out / "strips").glob("*.png"))) == 4  # windowed slices with their probabilities
    from tasks.ingest.ct import read_rsna_labels

    slice_labels = read_rsna_labels(workdir / "raw" / "ct-heldout" / "labels.csv")
    stored = open_cohort(workdir / "stores" / "ct-heldout.zarr").read_bags(0, 6).instance_labels
    assert [slice_labels[u] for u in ct_instances["sop_instance_uid"]] == stored.tolist()  # each row is its slice


def test_demo_skips_a_corrupt_slide_and_a_rerun_reuses_every_stage(demo_run):
    workdir, reports, configs = demo_run
    ingested = json.loads((workdir / "stores" / "wsi.zarr.ingest_report.json").read_text())
    assert [s["bag_id"] for s in ingested["skipped"]] == ["corrupt_00000"] and ingested["skipped"][0]["path"].endswith("corrupt_00000.tiff")
    assert len(ingested["added"]) + len(ingested["already_done"]) == 6
    again = pipeline(str(configs["ct"]))
    assert all(r.reused for r in again.values()) and again["report"].path == reports["ct"]


def test_a_cohort_featurised_with_another_fitted_extractor_is_refused(demo_run, tmp_path):
    workdir, reports, configs = demo_run
    from flows.pipeline import ingest_cohort

    config = yaml.safe_load(configs["wsi-heldout"].read_text())
    del config["ingest"]["extractor_from"]
    config["store"] = str(tmp_path / "refitted.zarr")
    path = tmp_path / "refitted.yaml"
    path.write_text(yaml.safe_dump(config))
    ingest_cohort(str(path))
    model_dir = Path(reports["wsi"].split("predictions")[0]) / "models"
    with pytest.raises(ValueError, match=r"fitted with other parameters.*ingest.extractor_from"):
        predict_cohort(str(configs["wsi"]), str(next(model_dir.iterdir())), store=str(tmp_path / "refitted.zarr"))


def test_a_nightly_rerun_says_which_bags_of_the_store_its_source_no_longer_confirms(tmp_path, capsys):
    """A slide deleted from the folder, or whose label was corrected, stayed in the store, the
    training and the report with no word (the corrected one as a 'skipped' line only)."""
    import h5py

    from flows.cli import main

    rng = np.random.default_rng(2)
    folder = tmp_path / "h5"
    folder.mkdir()
    for i in range(12):
        with h5py.File(folder / f"s{i:02d}.h5", "w") as handle:
            X = rng.normal(size=(6, 4)).astype(np.float32)
            X[: 2 * (i % 2), 0] += 4.0
            handle["features"], handle["coords"] = X, np.arange(12).reshape(6, 2) * 256
    labels = pd.DataFrame({"slide_id": [f"s{i:02d}" for i in range(12)], "label": [i % 2 for i in range(12)]})
    labels.to_csv(tmp_path / "labels.csv", index=False)
    config = write_config(tmp_path, tmp_path / "c.zarr", ingest={"kind": "h5", "source": str(folder), "labels": str(tmp_path / "labels.csv")})
    assert main(["run", config]) == 0
    assert "not confirmed" not in capsys.readouterr().out
    (folder / "s03.h5").unlink()
    labels[labels["slide_id"] != "s03"].assign(label=lambda t: np.where(t["slide_id"] == "s04", 1, t["label"])).to_csv(
        tmp_path / "labels.csv", index=False)
    assert main(["run", config]) == 0
    out = capsys.readouterr().out
    assert "; 2 in the store not confirmed, still used" in out, out
    latest = json.loads((tmp_path / "out" / "latest-run.json").read_text())  # which of the hash-named folders is the newest
    report = Path(latest["report"]).read_text()
    assert Path(latest["model_dir"]).parent == tmp_path / "out" / "models" and latest["prediction_key"] == Path(latest["report"]).parent.name
    assert "Accuracy, F1 and the confusion matrix at threshold 0.5" in report
    assert json.loads((Path(latest["report"]).parent / "metrics.json").read_text())["threshold"] == 0.5
    warning = next(line for line in report.splitlines() if "not confirmed by its last ingest" in line)
    assert warning.startswith("- 2 bag(s) of this cohort were not confirmed by its last ingest and are kept, and reported, and trained on")
    assert f"s03 (not in {folder})" in warning and "s04 (LabelChangedError:" in warning
    # New slides from a folder of their own (one --source a night): the store's other bags are not that folder's to confirm.
    (tmp_path / "night2").mkdir()
    shutil.copy(folder / "s05.h5", tmp_path / "night2" / "t00.h5")
    pd.concat([pd.read_csv(tmp_path / "labels.csv"), pd.DataFrame({"slide_id": ["t00"], "label": [1]})]).to_csv(tmp_path / "labels.csv", index=False)
    assert main(["ingest", config, "--source", str(tmp_path / "night2")]) == 0
    assert "1 bags added" in (night := capsys.readouterr().out) and "not confirmed" not in night, night


def test_a_second_run_is_refused_while_the_first_writes_its_report(tmp_path, cohort):
    """The store's lease ends with the predictions: a second run of the configuration reached the
    report stage, cleared the first run's report as it was written, and the first one failed."""
    from tasks.lease import StoreLockedError
    from tests.test_lease import _start_holder

    config = write_config(tmp_path, cohort)
    out = Path(pipeline(config)["report"].path).parent
    (out / "metrics.json").unlink()  # the next run writes the report again
    before = (out / "report.md").read_text()
    holder = _start_holder(out, tmp_path / "release")  # another process writing this report
    try:
        with pytest.raises(StoreLockedError, match=rf"{out} is being written by another run: test holder"):
            pipeline(config)
        assert (out / "report.md").read_text() == before  # nothing of it cleared
    finally:
        (tmp_path / "release").touch()
        assert holder.wait(timeout=30) == 0
    assert pipeline(config)["report"].reused is False and (out / "metrics.json").is_file()


def test_a_report_that_fails_while_it_is_rewritten_leaves_the_earlier_one_whole(tmp_path, cohort, monkeypatch):
    """A new threshold keeps the prediction key, so its report is written into the same folder: the
    earlier report was deleted first, and a run killed while writing left half a report (and
    latest-run.json naming a report.md that was gone)."""
    from tasks import report

    out = Path(pipeline(write_config(tmp_path, cohort))["report"].path).parent
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    (out / "notes.txt").write_text("reviewed by JD")  # a file no report writes
    changed = write_config(tmp_path, cohort, prediction={"threshold": 0.3})

    def fails(*args, **kwargs):
        raise ValueError("the run dies here")

    monkeypatch.setattr(report, "instance_table", fails)  # after the tables and metrics, before figures and report.md
    with pytest.raises(Exception, match="the run dies here"):
        pipeline(changed)
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before | {Path("notes.txt"): b"reviewed by JD"}

    from tasks.lease import StoreLockedError, lease_path

    monkeypatch.undo()
    written = report.instance_table

    def frozen_past_the_ttl(*args, **kwargs):  # meanwhile another run takes the report's lease over and stages its report
        lease_path(out).write_text(json.dumps({"host": "other-node", "pid": 1, "pid_start": None,
                                               "purpose": "report on other-node", "started": 0.0, "token": "x"}))
        (out / ".writing-other").mkdir()
        (out / ".writing-other" / "report.md").write_text("the other run's")
        return written(*args, **kwargs)

    monkeypatch.setattr(report, "instance_table", frozen_past_the_ttl)
    with pytest.raises(StoreLockedError, match="was lost while this run held it .*report on other-node"):
        pipeline(changed)
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == after | {
        Path(".writing-other/report.md"): b"the other run's"}  # the other run's to write and to put in place
    monkeypatch.undo()
    lease_path(out).unlink()  # the other run is killed: its staged report is left for the next run to clear
    result = pipeline(changed)["report"]
    assert not result.reused and Path(result.path).parent == out
    assert json.loads((out / "metrics.json").read_text())["threshold"] == 0.3 and (out / "notes.txt").is_file()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".")) == []  # no staging folder left


@pytest.mark.timeout(120)  # without the refusal it serves until stopped
def test_serve_without_a_prefect_server_is_refused_naming_how_to_start_one(tmp_path, cohort, capsys):
    """On gpmil's temporary server Prefect only warned "Cannot schedule flows on an ephemeral
    server" and the cron never fired."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.cli import main

    with temporary_settings(restore_defaults={PREFECT_API_URL}):
        assert main(["serve", write_config(tmp_path, cohort), "--cron", "0 2 * * *"]) == 2
    err = capsys.readouterr().err
    assert "no Prefect server to serve on (PREFECT_API_URL is not set)" in err and "prefect server start" in err


@pytest.mark.parametrize("schedule, problem", [
    (["--cron", "0 2 * * *", "--timezone", "Mars/Olympus_Mons"], "--timezone 'Mars/Olympus_Mons': Invalid timezone"),
    (["--cron", "0 2 * * *", "--timezone", "Europe"], "--timezone 'Europe': Invalid timezone"),  # a folder of zoneinfo
    (["--cron", "0 2 * * *", "--timezone", "right/UTC"], "--timezone 'right/UTC': Invalid timezone"),  # zoneinfo's, not Prefect's
    (["--cron", "0 25 * * *"], "--cron '0 25 * * *': Invalid cron string"),
    (["--cron", "0 2 30 2 *"], "--cron '0 2 30 2 *': no date matches it: it would never run"),
    (["--cron", "0 2 * * * *"], "--cron '0 2 * * * *' has 6 fields, not five"),
    (["--timezone", "Europe/Berlin"], "--timezone needs --cron"),
])
def test_serve_refuses_a_schedule_prefect_would_fail_on_later(tmp_path, cohort, capsys, schedule, problem):
    """Prefect's client took any timezone name for a cron (its server then refused it), a cron no
    date matches (no run ever came) and a sixth field (seconds: a run every second), and raised a
    traceback for a bad cron once serving began: each is refused first, exit 2, as the server reads it."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.cli import main

    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):  # nothing listens: the check comes first
        assert main(["serve", write_config(tmp_path, cohort), *schedule]) == 2
    assert problem in capsys.readouterr().err


def test_a_deployment_runs_paths_are_read_beside_the_configuration(tmp_path, cohort, monkeypatch):
    """A served deployment's run parameters typed in the UI: ``source`` was read from the serving
    process's working directory, ``store`` from the config's folder."""
    from flows.pipeline import _beside, _config

    config = write_config(tmp_path, cohort)
    monkeypatch.chdir(tmp_path.parent)
    assert _config(config, source="raw/new").ingest.source == tmp_path / "raw" / "new"
    assert _beside(config, "stores/new.zarr") == str(tmp_path / "stores" / "new.zarr")
    assert _beside(config, str(tmp_path.parent / "x")) == str(tmp_path.parent / "x") and _beside(config, None) is None


def test_the_cli_summarises_each_stage_in_one_line():
    from flows.cli import summary
    from tasks.prefect_tasks import StageResult

    ingest = StageResult("c", "/s.zarr", False, {"added": ["a", "b"], "n_instances_added": 40, "already_done": ["c"],
                                                  "skipped": [{"bag_id": "d"}]})
    assert summary("ingest", ingest) == "ingest  done    2 bags added (40 instances), 1 already in the store, 1 skipped -> /s.zarr"
    train = StageResult("k", "/m", True, {"model": "VGPMIL", "n_bags": 9, "n_iter": 30, "converged": True})
    assert summary("train", train) == "train   reused  VGPMIL on 9 bags, 30 iterations -> /m"
    assert summary("report", StageResult("p", "/r.md", False, {})) == "report  done    no labelled bags of both classes: no metrics -> /r.md"


def test_progress_bars_say_how_far_a_stage_is():
    from tasks.prefect_tasks import progress_bar

    assert progress_bar(0, 4, width=8) == "[........] 0/4"
    assert progress_bar(3, 4, width=8) == "[######..] 3/4"
    assert progress_bar(0, 0, width=4) == "[....] 0/0"


def test_a_clam_h5_folder_with_a_labels_section_runs_end_to_end_with_level0_heatmaps(tmp_path, capsys):
    """A CLAM/TRIDENT feature folder is a config source; labels come from a target expression; the
    report paints level-0 coordinates at thumbnail size (over the slide when its folder is given)
    and writes per-instance tables and QuPath GeoJSON."""
    import h5py

    from tasks.ingest.synthetic import write_pyramid

    rng = np.random.default_rng(0)
    folder, slides = tmp_path / "h5", tmp_path / "slides"
    folder.mkdir()
    slides.mkdir()
    rows = []
    for i in range(16):
        n, positive = int(rng.integers(8, 20)), i % 2
        X = rng.normal(size=(n, 6)).astype(np.float32)
        X[: 3 * positive, 0] += 4.0  # witnesses
        grid = rng.choice(400, size=n, replace=False)
        with h5py.File(folder / f"case_{i:02d}.h5", "w") as handle:
            handle["features"] = X
            handle["coords"] = np.stack([grid % 20, grid // 20], axis=1) * 512  # level-0 pixels, 512-px patches
            if i == 5:  # a file that says its patch size (TRIDENT): its own, though its grid is the cohort's
                handle["coords"].attrs["patch_size_level0"] = 1024
        rows.append({"slide_id": f"case_{i:02d}", "grade": 3 * positive})
    pd.DataFrame(rows).to_csv(tmp_path / "clinical.csv", index=False)
    write_pyramid(slides / "case_01.svs", np.full((1024, 1024, 3), 230, dtype=np.uint8), mpp=10.0, flavour="aperio", levels=1)
    config = write_config(tmp_path, tmp_path / "h5.zarr", ingest={
        "kind": "h5", "source": str(folder), "slides": str(slides),
        "labels": {"file": str(tmp_path / "clinical.csv"), "target": "grade > 2"}},
        prediction={"n_heatmaps": 16})
    results = pipeline(config)
    cohort = open_cohort(tmp_path / "h5.zarr")
    assert cohort.n_bags == 16 and list(cohort.bag_labels) == [i % 2 for i in range(16)]
    out = Path(results["report"].path).parent
    instances = pd.read_parquet(out / "instance_predictions.parquet")
    assert list(instances.columns[:4]) == ["bag_id", "instance", "x", "y"] and instances["x"].max() > 5000
    geojson = json.loads((out / "geojson" / safe_filename("case_03", ".geojson")).read_text())
    ring = geojson["features"][0]["geometry"]["coordinates"][0]
    assert ring[1][0] - ring[0][0] == 512  # the patch size, from the coordinates' grid step
    own = json.loads((out / "geojson" / safe_filename("case_05", ".geojson")).read_text())
    assert own["bag_id"] == "case_05" and own["features"][0]["geometry"]["coordinates"][0][1][0] - own["features"][0]["geometry"]["coordinates"][0][0][0] == 1024
    assert len(list((out / "heatmaps").glob("*.png"))) == 16
    fewer = write_config(tmp_path, tmp_path / "h5.zarr", ingest={
        "kind": "h5", "source": str(folder), "slides": str(slides),
        "labels": {"file": str(tmp_path / "clinical.csv"), "target": "grade > 2"}}, prediction={"n_heatmaps": 2})
    assert Path(pipeline(fewer)["report"].path).parent == out
    assert len(list((out / "heatmaps").glob("*.png"))) == 2  # not 2 new beside 14 stale ones

    # The training folder predicted as a 'new' cohort: its report does not call the metrics held out.
    from flows.cli import main

    assert main(["predict", config, results["train"].path, "--source", str(folder), "--store", str(tmp_path / "again.zarr")]) == 0
    (again,) = [p for p in (tmp_path / "out" / "predictions").glob("*/report.md") if p.parent != out]
    assert "**16 of these 16 bags are bags the model was trained on" in again.read_text()
    assert "held-out cohort" not in again.read_text()

    # A new cohort whose slides have one patch each: its squares are the training cohort's patch size (they were 1 px).
    (tmp_path / "single").mkdir()
    for i in range(2):
        with h5py.File(tmp_path / "single" / f"one_{i}.h5", "w") as handle:
            handle["features"], handle["coords"] = rng.normal(size=(1, 6)).astype(np.float32), np.array([[1024 * i, 512]])
    assert main(["predict", config, results["train"].path, "--source", str(tmp_path / "single"), "--store", str(tmp_path / "single.zarr")]) == 0
    (single,) = [p.parent for p in (tmp_path / "out" / "predictions").glob("*/report.md") if p.parent not in (out, again.parent)]
    ring = json.loads((single / "geojson" / safe_filename("one_1", ".geojson")).read_text())["features"][0]["geometry"]["coordinates"][0]
    assert ring[0] == [1024, 512] and ring[2] == [1536, 1024]
    # Its store left to gpmil (under output_dir/stores): evaluate without --store says where the key is.
    assert main(["predict", config, results["train"].path, "--source", str(tmp_path / "single")]) == 0
    capsys.readouterr()
    assert main(["evaluate", config, results["train"].path, single.name]) == 2
    (made,) = (tmp_path / "out" / "stores").glob("*.zarr")
    assert f"it is in {made}: give --store {made}" in capsys.readouterr().err

    # Features of another extractor, or a labels file that is not there: refused before the ingest
    # (a whole cohort was ingested into a new store, left behind, before the width was compared).
    (tmp_path / "wide").mkdir()
    with h5py.File(tmp_path / "wide" / "w0.h5", "w") as handle:
        handle["features"], handle["coords"] = np.zeros((3, 7), np.float32), np.zeros((3, 2), np.int64)
    assert main(["predict", config, results["train"].path, "--source", str(tmp_path / "wide"), "--store", str(tmp_path / "wide.zarr")]) == 2
    assert f"--source: {tmp_path / 'wide' / 'w0.h5'} has 7 features per instance, but the model was trained on 6" in capsys.readouterr().err
    assert main(["predict", config, results["train"].path, "--source", str(folder), "--labels", str(tmp_path / "none.csv"),
                 "--store", str(tmp_path / "n.zarr")]) == 2
    assert f"--labels: {tmp_path / 'none.csv'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "wide.zarr").exists() and not (tmp_path / "n.zarr").exists()


def test_a_parquet_table_with_named_columns_runs_end_to_end_with_its_coordinates_as_x_y(tmp_path):
    """A team's Parquet export (slide id, label, x, y, a tile path, feat_*) through ingest.columns:
    x, y are coordinates, not features, and the report paints and exports them as for .h5 folders."""
    rng = np.random.default_rng(1)
    parts = []
    for i in range(16):
        n, positive = int(rng.integers(8, 20)), i % 2
        X = rng.normal(size=(n, 4)).astype(np.float32)
        X[: 3 * positive, 0] += 4.0
        grid = rng.choice(400, size=n, replace=False)
        part = pd.DataFrame(X, columns=[f"feat_{j}" for j in range(4)])
        part["x"], part["y"] = grid % 20 * 256, grid // 20 * 256
        part["slide_id"], part["label"], part["tile"] = f"case_{i:02d}", positive, [f"t{k}.png" for k in range(n)]
        parts.append(part)
    pd.concat(parts).to_parquet(tmp_path / "tiles.parquet")
    config = write_config(tmp_path, tmp_path / "t.zarr", ingest={
        "kind": "features", "source": str(tmp_path / "tiles.parquet"),
        "columns": {"bag": "slide_id", "features": "feat_*", "coords": ["x", "y"]}}, prediction={"n_heatmaps": 2})
    results = pipeline(config)
    cohort = open_cohort(tmp_path / "t.zarr")
    assert cohort.n_features == 4 and cohort.attrs["coords_meaning"] == "x,y (table columns x, y)"
    out = Path(results["report"].path).parent
    instances = pd.read_parquet(out / "instance_predictions.parquet")
    assert list(instances.columns[:4]) == ["bag_id", "instance", "x", "y"]
    np.testing.assert_array_equal(instances["x"], parts[0]["x"].tolist() + [v for p in parts[1:] for v in p["x"]])
    ring = json.loads((out / "geojson" / safe_filename("case_03", ".geojson")).read_text())["features"][0]["geometry"]["coordinates"][0]
    assert ring[1][0] - ring[0][0] == 256  # the tile side, from the coordinates' grid step
    assert len(list((out / "heatmaps").glob("*.png"))) == 2

    # A new cohort's table with its feature columns in another order is read by the model's column names.
    from flows.cli import main

    model_dir = results["train"].path
    shuffled = pd.concat(parts)[["slide_id", "label", "x", "y", "feat_3", "feat_1", "feat_0", "feat_2"]]
    shuffled.assign(slide_id="new_" + shuffled["slide_id"]).to_parquet(tmp_path / "new.parquet")
    assert main(["predict", config, model_dir, "--source", str(tmp_path / "new.parquet"), "--store", str(tmp_path / "new.zarr")]) == 0
    assert open_cohort(tmp_path / "new.zarr").attrs["feature_columns"] == ["feat_0", "feat_1", "feat_2", "feat_3"]
    (new_report,) = [p for p in (tmp_path / "out" / "predictions").glob("*/report.md") if p.parent != out]
    assert "these predictions and metrics are on a held-out cohort" in new_report.read_text()  # other bags
    (tmp_path / "labels.csv").write_text("slide_id,label\nnew_case_00,1\n")
    assert main(["predict", config, model_dir, "--source", str(tmp_path / "new.parquet"), "--labels", str(tmp_path / "labels.csv"),
                 "--store", str(tmp_path / "other.zarr")]) == 2
    assert not (tmp_path / "other.zarr").exists()


def test_one_command_predicts_a_new_folder_with_the_training_extractor_and_prints_a_summary(demo_run, tmp_path, capsys):
    from flows.cli import main

    workdir, reports, configs = demo_run
    model_dir = next((Path(reports["wsi"].split("predictions")[0]) / "models").iterdir())
    new_folder = tmp_path / "new"
    shutil.copytree(workdir / "raw" / "wsi-heldout", new_folder / "site_b")  # slides in a sub-folder
    shutil.move(new_folder / "site_b" / "labels.csv", new_folder / "labels.csv")
    (new_folder / "site_b" / "export.ndpi").write_bytes(b"not a slide")
    labels = pd.read_csv(new_folder / "labels.csv")
    unlisted = labels["image_id"].iloc[-1]  # a slide the labels do not give: predicted, unlabelled, not left out
    listed = labels.iloc[:-1].copy()
    positive = listed["isup_grade"] > 0
    pending = listed.index[positive == positive.mode()[0]][0]  # listed before its grade is known (blank): predicted too
    listed.loc[pending, ["isup_grade", "gleason_score"]] = None
    pd.concat([listed, pd.DataFrame([{"image_id": "export", "data_provider": "synthetic", "isup_grade": 0,
                                      "gleason_score": "0+0"}])]).to_csv(new_folder / "labels.csv", index=False)
    code = main(["predict", str(configs["wsi"]), str(model_dir), "--source", str(new_folder),
                 "--labels", str(new_folder / "labels.csv"), "--store", str(tmp_path / "new.zarr")])
    out = capsys.readouterr().out
    assert code == 0 and "6 bags predicted:" in out and "most likely positive:" in out and "bag_auc" in out
    new = open_cohort(tmp_path / "new.zarr")
    stored = dict(zip(new.bag_ids, new.bag_labels))
    assert stored[unlisted] == stored[listed.at[pending, "image_id"]] == -1 and (np.asarray(new.bag_labels) >= 0).sum() == 4
    assert "instance table: " in out and "QuPath GeoJSON" in out
    assert "export.ndpi: UnreadableFileError: OpenSlide" in out  # every file left out, with its reason
    trained = open_cohort(workdir / "stores" / "wsi.zarr")
    assert open_cohort(tmp_path / "new.zarr").attrs["feature_extractor"] == trained.attrs["feature_extractor"]


def test_evaluate_refuses_a_key_that_is_not_a_complete_prediction_of_its_store_by_its_model(demo_run, capsys, tmp_path):
    """A key from another store, another model's folder, a made-up or path-like key: exit 2 in one
    line naming PREDICTION_KEY, before Prefect starts, and the existing report is left as it was."""
    from flows.cli import main

    workdir, reports, configs = demo_run
    models = {m: next((Path(reports[m].split("predictions")[0]) / "models").iterdir()) for m in ("wsi", "ct")}
    report = Path(reports["wsi"])
    key, before = report.parent.name, report.read_text()
    wsi, training_store = str(configs["wsi"]), str(workdir / "stores" / "wsi.zarr")
    for args, message in [
        ([wsi, str(models["ct"]), key], f"PREDICTION_KEY: {key} was predicted with the model {models['wsi']}, not MODEL_DIR {models['ct']}"),
        ([wsi, str(models["wsi"]), "badkey"], f"PREDICTION_KEY: no prediction badkey in {workdir / 'stores' / 'wsi-heldout.zarr'} (its predictions: {key})"),
        ([wsi, str(models["wsi"]), "../../x"], "PREDICTION_KEY: '../../x' is not a prediction key"),
        ([wsi, str(models["wsi"]), key, "--store", training_store], f"PREDICTION_KEY: no prediction {key} in {training_store} (its predictions: none)"),
    ]:
        assert main(["evaluate", *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert report.read_text() == before
    from tasks.store import BagData, append_bags

    grown = tmp_path / "grown.zarr"  # a nightly ingest added a bag since: evaluate crashed ('All arrays must be of the same length')
    shutil.copytree(workdir / "stores" / "wsi-heldout.zarr", grown)
    cohort = open_cohort(grown)
    append_bags(grown, [BagData("added", 0, "memory", np.zeros((2, cohort.n_features), np.float32),
                                np.zeros((2, cohort.attrs["coords_dim"]), np.int32), np.full(2, -1, np.int8))])
    assert main(["evaluate", wsi, str(models["wsi"]), key, "--store", str(grown)]) == 2
    err = capsys.readouterr().err
    assert f"PREDICTION_KEY: {key} predicted {cohort.n_bags} bags and {grown} now holds {cohort.n_bags + 1}" in err, err
    other_rule = Path(wsi).with_name("wsi-max-rule.yaml")  # the report would name it and show the other rule's numbers
    settings = yaml.safe_load(Path(wsi).read_text())
    other_rule.write_text(yaml.safe_dump({**settings, "prediction": {**(settings.get("prediction") or {}), "rule": "max"}}))
    assert main(["evaluate", str(other_rule), str(models["wsi"]), key]) == 2
    err = capsys.readouterr().err
    assert f"PREDICTION_KEY: {key} was predicted with prediction.method: probit, prediction.rule: null; this configuration has " \
           "prediction.method: probit, prediction.rule: max" in err and err.count("\n") == 1, err
    assert report.read_text() == before

    from tasks.store import label_unlabelled_bags

    unlabelled = tmp_path / "unlabelled.zarr"  # ingested for prediction before its labels arrived
    shutil.copytree(workdir / "stores" / "wsi-heldout.zarr", unlabelled)
    root = zarr.open_group(str(unlabelled), mode="r+")
    labels, originals = root["bags/label"][:], root["bags/original_label"][:]
    root["bags/label"][:] = -1
    assert main(["evaluate", wsi, str(models["wsi"]), key, "--store", str(unlabelled)]) == 0
    assert not report.with_name("metrics.json").exists() and "No labelled bags" in report.read_text()
    label_unlabelled_bags(root, {bag_id: (int(label), str(original))
                                 for bag_id, label, original in zip(root["bags/id"][:], labels, originals)})
    assert main(["evaluate", wsi, str(models["wsi"]), key, "--store", str(unlabelled)]) == 0  # was the unlabelled report, reused
    assert "report reused" not in capsys.readouterr().out
    assert json.loads(report.with_name("metrics.json").read_text())["n_bags"] == cohort.n_bags
    assert main(["evaluate", wsi, str(models["wsi"]), key]) == 0  # its own model and store: the report
    assert str(report) in capsys.readouterr().out
    assert f"Cohort `{workdir / 'stores' / 'wsi-heldout.zarr'}`" in report.read_text()
    assert "Bag probabilities of this prediction: the model's bag rule `" in report.read_text()


def test_predict_refuses_labels_or_a_base_mpp_without_a_source_folder(demo_run, capsys):
    from flows.cli import main

    workdir, reports, configs = demo_run
    model_dir = next((Path(reports["wsi"].split("predictions")[0]) / "models").iterdir())
    assert main(["predict", str(configs["wsi"]), str(model_dir), "--labels", str(workdir / "raw" / "wsi-heldout" / "labels.csv")]) == 2
    assert "--labels gives the labels of a --source folder" in capsys.readouterr().err
    assert main(["predict", str(configs["wsi"]), str(model_dir), "--base-mpp", "0.5"]) == 2
    assert "--base-mpp gives the µm/px of a --source folder's slides" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["predict", str(configs["wsi"]), str(model_dir), "--source", str(workdir), "--base-mpp", "0"])
    assert "--base-mpp: '0' is not a number > 0" in capsys.readouterr().err


def test_a_model_folder_training_left_unfinished_is_refused_naming_the_file(demo_run, tmp_path, capsys):
    from flows.cli import main

    workdir, reports, configs = demo_run
    model_dir = next((Path(reports["wsi"].split("predictions")[0]) / "models").iterdir())
    for name, damage, message in [
        ("no-arrays", lambda d: (d / "model.npz").unlink(), "model.npz is missing (training did not finish?)"),
        ("cut-json", lambda d: (d / "model.json").write_text((d / "model.json").read_text()[:40]), "model.json is not readable JSON"),
        ("empty-json", lambda d: (d / "model.json").write_text("{}"), "model.json lacks store"),
    ]:
        damaged = tmp_path / name
        shutil.copytree(model_dir, damaged)
        damage(damaged)
        assert main(["predict", str(configs["wsi"]), str(damaged)]) == 2
        err = capsys.readouterr().err
        assert f"MODEL_DIR: {damaged / message.split()[0]}" in err and message in err and err.count("\n") == 1, err


@pytest.mark.parametrize("how", ["SIGTERM", "Ctrl-C in the terminal", "SIGKILL"])
def test_a_killed_run_leaves_no_temporary_prefect_server_behind(tmp_path, how):
    """A scheduler's timeout (SIGTERM) killed gpmil at once and left its temporary Prefect server
    running, re-parented to init: one leaked server per killed run; so did SIGKILL (the OOM killer).
    Ctrl-C in the terminal reached the server too (one process group): it died first and the run
    spent minutes retrying to report its crash. The server now runs in its own session, stopped
    with gpmil whatever ends it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    X, bags, y, _ = make_toy_bags(n_bags=40, seed=3)
    pd.DataFrame(np.column_stack([y, bags, X])).to_csv(tmp_path / "t.csv", header=False, index=False)
    config = write_config(tmp_path, tmp_path / "t.zarr", ingest={"kind": "features", "source": str(tmp_path / "t.csv")},
                          model={"name": "VGPMIL", "params": {"n_inducing": 8, "max_iter": 100000, "tol": 0.0,
                                                              "kernel": {"variance": 4.0}, "random_state": 0}},
                          dask={"n_workers": 1, "processes": False}, training={"checkpoint_every": 1})
    # A terminal's foreground job: its own process group, Ctrl-C at its default. A suite started in the
    # background (`pytest … &` in a script) passes Ctrl-C on ignored, and Python then keeps ignoring it.
    foreground = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); "
                  "os.execv(sys.executable, [sys.executable, '-m', 'flows.cli', 'run', sys.argv[1]])")
    run = subprocess.Popen([sys.executable, "-c", foreground, config], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, cwd=Path(__file__).parents[1], start_new_session=True)
    servers = []
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "t.zarr" / "training").exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        servers = [p for p in psutil.Process(run.pid).children(recursive=True) if "uvicorn" in " ".join(p.cmdline())]
        assert run.poll() is None and len(servers) == 1, run.stdout.read() if run.poll() is not None else servers
        started = time.monotonic()
        if how == "Ctrl-C in the terminal":
            os.killpg(run.pid, signal.SIGINT)
        else:
            run.send_signal(getattr(signal, how))
        output = run.communicate(timeout=120)[0]
        expected = {"SIGTERM": 128 + signal.SIGTERM, "Ctrl-C in the terminal": 130, "SIGKILL": -signal.SIGKILL}[how]
        assert run.returncode == expected and time.monotonic() - started < 60, output
        psutil.wait_procs(servers, timeout=15)
        assert not servers[0].is_running(), "the temporary Prefect server outlived the killed run"
    finally:  # a failing run leaves nothing behind either
        for process in [run, *servers]:
            if (process.poll() is None) if process is run else process.is_running():
                process.kill()


def test_an_input_error_is_one_line_on_the_console_and_a_bug_keeps_its_traceback(tmp_path):
    """Prefect logged each input error (here: every bag of a table refused) with a traceback of the
    pipeline's own frames before the one-line 'gpmil ingest failed'; the line says it all."""
    import logging
    import subprocess
    import sys

    from flows.cli import _WithoutInputTracebacks
    from tasks.ingest.errors import NothingIngestedError
    from tasks.training.errors import CohortError

    (tmp_path / "t.csv").write_text("".join(f"2,bag{b},{b}.0\n" for b in range(6)))
    table = write_config(tmp_path, tmp_path / "t.zarr", ingest={"kind": "features", "source": str(tmp_path / "t.csv")})
    run = subprocess.run([sys.executable, "-m", "flows.cli", "ingest", table], capture_output=True, text=True,
                         timeout=600, cwd=Path(__file__).parents[1])
    assert run.returncode == 1, run.stderr
    assert "Encountered exception during execution: NothingIngestedError" in run.stderr and "Traceback" not in run.stderr

    formatter = _WithoutInputTracebacks(logging.Formatter("%(message)s"))
    for error, traceback in ((NothingIngestedError("nothing", path="t.csv"), False), (KeyError("bug"), True),
                             (CohortError("cohort t.zarr needs labelled bags of both classes"), False)):
        try:
            raise error
        except Exception:
            record = logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
        assert ("Traceback" in formatter.format(record)) is traceback
        assert record.exc_info[1] is error  # the Prefect UI's handler still gets the traceback


def test_an_ingest_that_gives_the_store_no_bag_fails_saying_why(tmp_path, demo_run, capsys, monkeypatch):
    """An empty slide folder and a table whose every bag is refused end with a non-zero exit naming
    the source and the first reason, not 'done' / 'reused' with 0 bags; a new folder predicted into
    the model's training store is refused before anything runs (its bags would have joined the
    training data), and that store gets no prediction."""
    from flows.cli import main

    (tmp_path / "empty").mkdir()
    (tmp_path / "labels.csv").write_text("image_id,data_provider,isup_grade,gleason_score\nslide_a,synthetic,0,0+0\n")
    empty = write_config(tmp_path, tmp_path / "e.zarr", ingest={"kind": "wsi", "source": str(tmp_path / "empty"),
                                                                "labels": str(tmp_path / "labels.csv")})
    assert main(["ingest", empty]) == 1
    assert f"no slide to ingest: 0 slide file(s) found, 1 left out; first left out: {tmp_path / 'empty' / 'slide_a'}" in capsys.readouterr().err
    (tmp_path / "t.csv").write_text("".join(f"2,bag{b},{b}.0\n" for b in range(6)))  # label 2 on every bag
    table = write_config(tmp_path, tmp_path / "t.zarr", ingest={"kind": "features", "source": str(tmp_path / "t.csv")})
    assert main(["ingest", table]) == 1
    err = capsys.readouterr().err
    assert "no bag ingested" in err and f"6 input(s), 6 left out; first left out: {tmp_path / 't.csv'} [bag bag0]: MissingLabelError: bag label must be" in err

    workdir, reports, configs = demo_run
    model_dir = next((Path(reports["wsi"].split("predictions")[0]) / "models").iterdir())
    training_store = workdir / "stores" / "wsi.zarr"

    def predictions_in(store):
        group = zarr.open_group(str(store), mode="r")
        return sorted(group["predictions"].group_keys()) if "predictions" in group else []

    before = predictions_in(training_store)
    n_bags = open_cohort(training_store).n_bags

    def prefect_started():
        raise AssertionError("Prefect was set up for a command refused by its inputs")

    monkeypatch.setattr("flows.cli._prefect_for_the_command", prefect_started)
    assert main(["predict", str(configs["wsi"]), str(model_dir), "--source", str(workdir / "raw" / "wsi-heldout"),
                 "--store", str(training_store)]) == 2
    err = capsys.readouterr().err
    assert f"--store: {training_store} is the store the model was trained on" in err
    assert err.count("\n") == 1, err  # refused before Prefect starts
    held_out = workdir / "stores" / "wsi-heldout.zarr"  # another cohort's store: the new one would be reported with it
    held_out_before = predictions_in(held_out), open_cohort(held_out).n_bags
    assert main(["predict", str(configs["wsi"]), str(model_dir), "--source", str(workdir / "raw" / "wsi"),
                 "--store", str(held_out)]) == 2
    err = capsys.readouterr().err
    assert (f"--store: {held_out} already holds 6 bag(s) not from --source {workdir / 'raw' / 'wsi'} (e.g. "
            f"'{open_cohort(held_out).bag_ids[0]}' from {workdir / 'raw' / 'wsi-heldout'}") in err, err
    assert (predictions_in(held_out), open_cohort(held_out).n_bags) == held_out_before
    # no --store: a store of its own, not the config's prediction.store (refused as another cohort's): past the checks
    assert main(["predict", str(configs["wsi"]), str(model_dir), "--source", str(workdir / "raw" / "wsi")]) == 1
    assert "AssertionError: Prefect was set up" in capsys.readouterr().err
    moved = tmp_path / "moved-model"
    shutil.copytree(model_dir, moved)
    meta = json.loads((moved / "model.json").read_text())
    (moved / "model.json").write_text(json.dumps({**meta, "store": str(tmp_path / "gone.zarr")}))
    assert main(["predict", str(configs["wsi"]), str(moved), "--source", str(workdir / "raw" / "wsi-heldout"),
                 "--store", str(tmp_path / "new.zarr")]) == 2  # its slides need the training store's extractor
    assert f"MODEL_DIR: the model was trained on {tmp_path / 'gone.zarr'}, which is gone" in capsys.readouterr().err
    assert open_cohort(training_store).n_bags == n_bags
    assert predictions_in(training_store) == before


def test_the_gibbs_reference_trains_and_predicts_through_the_pipeline_from_the_config(tmp_path, cohort):
    """The sampler from the config: its chain on the cluster is the serial chain (keyed draws), so the
    report's bag probabilities are those of ``fit`` on the same bags; the trace is the chain's log density."""
    from mil_core import VGPMILPRGibbs

    import logging

    params = {"n_inducing": 6, "n_samples": 20, "burn_in": 5, "thin": 1, "random_state": 0}
    progress: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: progress.append(record.getMessage())
    logging.getLogger("prefect.task_runs").addHandler(handler)
    try:
        result = pipeline(write_config(tmp_path, cohort, model={"name": "VGPMILPRGibbs", "params": params}, training={"standardize": False}))
    finally:
        logging.getLogger("prefect.task_runs").removeHandler(handler)
    table = pd.read_parquet(result["report"].path.replace("report.md", "bag_predictions.parquet"))
    X, bags, y, _ = make_toy_bags(n_bags=30, seed=1)
    X = X.astype(np.float32).astype(np.float64)  # the store keeps float32
    serial = VGPMILPRGibbs(**params, standardize=False).fit(X, bags, y)  # as training.standardize: false
    np.testing.assert_allclose(table["probability"], serial.predict_bag_proba(X, bags)[1], rtol=1e-8)
    info = json.loads((Path(result["train"].path) / "model.json").read_text())
    assert info["model"] == "VGPMILPRGibbs" and info["n_iter"] == 25 and len(info["objective"]) == 25
    np.testing.assert_allclose(info["objective"], serial.objective_, rtol=1e-9)
    # Its trace is the chain's log joint, and is named so: not an ELBO, in the log, model.json and the report.
    sweeps = [line for line in progress if line.startswith("training [")]
    assert len(sweeps) == 25 and all(" log joint " in line and "ELBO" not in line for line in sweeps), sweeps[:2]
    assert info["objective_name"] == "log joint" and "elbo" not in info
    text = Path(result["report"].path).read_text()
    assert "training objective: log joint, `objective.png`" in text and "ELBO" not in text
    assert (Path(result["report"].path).parent / "objective.png").is_file()
    assert not serial.converged_ and any("split-R-hat" in w and "n_samples" in w for w in info["warnings"])  # 20 samples: far from mixed


def test_absmil_trains_and_predicts_through_the_pipeline_from_the_config(tmp_path, cohort):
    from mil_core import AbSMIL

    params = {"max_iter": 40, "random_state": 0}
    result = pipeline(write_config(tmp_path, cohort, model={"name": "AbSMIL", "params": params}, training={"standardize": False}))
    table = pd.read_parquet(result["report"].path.replace("report.md", "bag_predictions.parquet"))
    X, bags, y, _ = make_toy_bags(n_bags=30, seed=1)
    serial = AbSMIL(**params, standardize=False).fit(X.astype(np.float32).astype(np.float64), bags, y)  # the store keeps float32
    np.testing.assert_allclose(table["probability"], serial.predict_bag_proba(X.astype(np.float32).astype(np.float64), bags)[1], rtol=1e-8)
    assert result["report"].info["bag_auc"] > 0.8
    # A point estimate has no std to review by (the list was the first bags in cohort order, std nan),
    # and bags without positions get no figure (they were drawn as CT slices).
    out = Path(result["report"].path).parent
    assert "AbSMIL gives no predictive std: no bags to review by it." in (out / "report.md").read_text()
    assert not (out / "uncertain_bags.csv").exists() and not (out / "slices").exists() and not (out / "heatmaps").exists()
    settings = json.loads(json.loads((out / "report-settings.json").read_text())["settings"])
    assert settings["store"] == str(Path(cohort).resolve())  # the store predicted (prediction.store, unset, overwrote it)



def test_a_running_scheduler_is_joined_with_the_config_files_settings_and_a_silent_port_fails_fast(tmp_path, cohort):
    """No pipeline test used dask.scheduler_address: a port where no scheduler answers (a dashboard)
    hung the run, and the config_file was not applied to the client."""
    import socket
    import time

    from distributed import LocalCluster

    (tmp_path / "dask.yaml").write_text("distributed: {comm: {timeouts: {connect: 7s}}}\n")
    with LocalCluster(n_workers=1, processes=False, threads_per_worker=1, dashboard_address=":0") as cluster:
        config = write_config(tmp_path, cohort, dask={"scheduler_address": cluster.scheduler_address,
                                                      "config_file": str(tmp_path / "dask.yaml")})
        assert train_model(config).path
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        config = write_config(tmp_path, cohort, dask={"scheduler_address": f"tcp://127.0.0.1:{silent.getsockname()[1]}",
                                                      "worker_timeout_s": 2})
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="sent no Dask handshake within 2 s"):
            train_model(config)
        assert time.monotonic() - started < 60


def test_gpmils_own_log_lines_reach_prefect_and_a_users_extra_loggers_stay(monkeypatch):
    """gpmil's INFO lines (``gpmil.training``: the run's partitions, mode and device, a resumed
    kernel choice) reached no handler, not even with ``-v``, and its warnings (``gpmil.lease``: a
    taken-over lease) only the console, never the Prefect UI. Its loggers are Prefect's extra
    loggers now, beside a user's own."""
    import logging
    import os

    from flows.cli import _quiet_libraries

    monkeypatch.setenv("PREFECT_LOGGING_EXTRA_LOGGERS", "my_lab")
    for name in ("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "DASK_LOGGING__DISTRIBUTED"):  # set by the call: restored after
        monkeypatch.delenv(name, raising=False)
    for name in ("gpmil", "httpx", "prefect.server", "uvicorn"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.getLogger(name).level)
    logging.getLogger("gpmil").setLevel(logging.NOTSET)
    _quiet_libraries(verbose=False)
    assert os.environ["PREFECT_LOGGING_EXTRA_LOGGERS"] == "my_lab,gpmil"
    _quiet_libraries(verbose=False)
    assert os.environ["PREFECT_LOGGING_EXTRA_LOGGERS"] == "my_lab,gpmil"  # once
    assert logging.getLogger("gpmil.training").getEffectiveLevel() == logging.INFO  # the handlers' levels decide
