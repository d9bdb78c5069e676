"""keep_runs: a nightly schedule's older results removed, never what a kept result uses, never
what a record names outside this configuration (real pipeline runs, a real Zarr store, a lease
held by another process)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
import zarr

from flows.pipeline import pipeline
from tasks.lease import lease_path
from tasks.retention import RUNS, prune_runs
from tests.conftest import make_toy_bags
from tests.test_distributed import write_store

pytestmark = [pytest.mark.timeout(600), pytest.mark.usefixtures("prefect_server")]


def _run(tmp_path: Path, store: str, max_iter: int, rule: str | None = None, keep_runs: int | None = None) -> dict:
    config = {"name": "nightly", "store": store, "output_dir": str(tmp_path / "out"),
              "model": {"name": "VGPMIL", "params": {"n_inducing": 6, "max_iter": max_iter, "kernel": {"variance": 4.0}, "random_state": 0}},
              "prediction": {"rule": rule, "n_heatmaps": 0}, "dask": {"n_workers": 1, "processes": False},
              **({"keep_runs": keep_runs} if keep_runs else {})}
    path = tmp_path / "nightly.yaml"
    path.write_text(yaml.safe_dump(config))
    results = pipeline(str(path))
    return {"model": results["train"].key, "prediction": results["report"].key}


def _contents(tmp_path: Path, store: str) -> dict[str, set[str]]:
    root = zarr.open_group(store, mode="r")
    return {"models": {p.name for p in (tmp_path / "out" / "models").iterdir()},
            "reports": {p.name for p in (tmp_path / "out" / "predictions").iterdir() if p.is_dir()},
            "training": set(root["training"].group_keys()), "predictions": set(root["predictions"].group_keys()),
            "records": {json.loads(p.read_text())["prediction_key"] for p in (tmp_path / "out" / RUNS).glob("*.json")}}


def test_keep_runs_removes_older_results_but_what_a_kept_one_uses(tmp_path):
    X, bags, y, _ = make_toy_bags(n_bags=16, seed=5)
    store = write_store(tmp_path / "cohort.zarr", X, bags, y)
    a = _run(tmp_path, store, 3)  # before keep_runs was set: recorded, nothing removed
    b = _run(tmp_path, store, 4)
    assert _contents(tmp_path, store)["reports"] == {a["prediction"], b["prediction"]}
    c = _run(tmp_path, store, 4, rule="max", keep_runs=2)  # B's model, another prediction
    assert c["model"] == b["model"] and c["prediction"] != b["prediction"]
    assert _contents(tmp_path, store) == {"models": {b["model"]}, "reports": {b["prediction"], c["prediction"]},
                                          "training": {b["model"]}, "predictions": {b["prediction"], c["prediction"]},
                                          "records": {b["prediction"], c["prediction"]}}
    assert _run(tmp_path, store, 4, rule="max", keep_runs=2) == c  # a rerun that changed nothing is the same result
    assert _contents(tmp_path, store)["reports"] == {b["prediction"], c["prediction"]}
    assert len(list((tmp_path / "out" / RUNS).glob("*.json"))) == 2  # C's earlier record went, its outputs stayed

    # B's report folder is being written by another process: B's result stays, for the next run to remove.
    report_b = tmp_path / "out" / "predictions" / b["prediction"]
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from tasks.lease import writer_lease\n"
                               "with writer_lease(sys.argv[1], 'a reader of the old report'):\n    print('held', flush=True); time.sleep(600)",
                               str(report_b)], stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    try:
        assert holder.stdout.readline().strip() == "held"
        d = _run(tmp_path, store, 5, keep_runs=2)
        left = _contents(tmp_path, store)
        assert report_b.is_dir() and b["prediction"] in left["records"] and lease_path(report_b).exists()
        assert b["prediction"] not in left["predictions"]  # the store's groups went before the report was reached
    finally:
        holder.kill()
        holder.wait()
    assert _run(tmp_path, store, 5, keep_runs=2) == d
    assert _contents(tmp_path, store) == {"models": {c["model"], d["model"]}, "reports": {c["prediction"], d["prediction"]},
                                          "training": {c["model"], d["model"]}, "predictions": {c["prediction"], d["prediction"]},
                                          "records": {c["prediction"], d["prediction"]}}


def test_a_record_naming_paths_outside_the_configuration_removes_nothing_there(tmp_path, caplog):
    """A record is a file anyone with write access to output_dir can write: its keys are checked,
    and only the configuration's stores are touched."""
    X, bags, y, _ = make_toy_bags(n_bags=8, seed=2)
    ours = write_store(tmp_path / "ours.zarr", X, bags, y)
    other = write_store(tmp_path / "other.zarr", X, bags, y)
    zarr.open_group(other, mode="a").require_group("predictions/00000000000000aa")
    (tmp_path / "out" / "models" / "00000000000000bb").mkdir(parents=True)
    (tmp_path / "victim").mkdir()
    runs = tmp_path / "out" / RUNS
    runs.mkdir()
    records = {"1-old.json": {"finished": "x", "store": other, "model_key": "00000000000000cc", "predicted_store": other,
                              "prediction_key": "00000000000000aa"},
               "2-crafted.json": {"finished": "x", "store": ours, "model_key": "../../victim", "predicted_store": ours,
                                  "prediction_key": "00000000000000dd"},
               "3-cut.json": '{"finished": ',
               "4-new.json": {"finished": "x", "store": ours, "model_key": "00000000000000bb", "predicted_store": ours,
                              "prediction_key": "00000000000000ee"}}
    for name, record in records.items():
        (runs / name).write_text(record if isinstance(record, str) else json.dumps(record))
    assert prune_runs(tmp_path / "out", [ours], keep=1) == []
    assert "00000000000000aa" in zarr.open_group(other, mode="r")["predictions"]  # not this configuration's store
    assert (tmp_path / "victim").is_dir() and (tmp_path / "out" / "models" / "00000000000000bb").is_dir()
    assert sorted(p.name for p in runs.iterdir()) == ["2-crafted.json", "3-cut.json", "4-new.json"]
    assert "2-crafted.json names keys that are no content keys" in caplog.text and "3-cut.json is unreadable" in caplog.text
    with pytest.raises(ValueError, match="keep_runs=0"):
        prune_runs(tmp_path / "out", [ours], keep=0)
