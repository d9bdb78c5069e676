"""keep_runs: a nightly schedule's older results removed, never what a kept result uses, never
what a record names outside this configuration (real pipeline runs, a real Zarr store, a lease
held by another process)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
import zarr

from flows.config import ConfigError
from flows.pipeline import pipeline
from tasks.lease import READERS, lease_path, reader_lease
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


def test_keep_runs_removes_older_results_but_what_a_kept_one_uses(tmp_path, capsys, monkeypatch):
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
        assert b["prediction"] in left["predictions"]  # nothing of B goes while its report is written
    finally:
        holder.kill()
        holder.wait()
    assert _run(tmp_path, store, 5, keep_runs=2) == d
    assert _contents(tmp_path, store) == {"models": {c["model"], d["model"]}, "reports": {c["prediction"], d["prediction"]},
                                          "training": {c["model"], d["model"]}, "predictions": {c["prediction"], d["prediction"]},
                                          "records": {c["prediction"], d["prediction"]}}

    # MODEL_DIR `latest`: the newest run's model (D's, its prediction of the store reused), on the command line as in a flow
    from flows.cli import main
    from flows.pipeline import predict_cohort

    config = str(tmp_path / "nightly.yaml")
    assert predict_cohort(config, "latest").key == d["prediction"]
    assert main(["predict", config, "latest"]) == 0 and d["prediction"] in capsys.readouterr().out
    assert main(["evaluate", config, "latest", d["prediction"]]) == 2  # evaluate names the model its prediction was made with
    assert "MODEL_DIR: latest is for predict; evaluate reads the model its prediction was made with" in capsys.readouterr().err
    monkeypatch.chdir(tmp_path)  # ./latest is a folder of that name, not the word
    assert main(["predict", config, "./latest"]) == 2 and f"MODEL_DIR: {tmp_path / 'latest'}" in capsys.readouterr().err
    other = tmp_path / "weekly.yaml"
    other.write_text(Path(config).read_text().replace("name: nightly", "name: weekly"))
    assert main(["predict", str(other), "latest"]) == 2
    assert (f"MODEL_DIR: latest: no completed `gpmil run` of configuration 'weekly' is recorded in {tmp_path / 'out' / RUNS}"
            in capsys.readouterr().err)


def _key(n: int) -> str:
    return f"{n:016x}"


def _write_record(runs: Path, name: str, config: str, model: int | str, prediction: int, store: str, predicted: str | None = None) -> Path:
    """A run record with the fields ``prune_runs`` reads (keys from numbers, or a model key as given)."""
    runs.mkdir(parents=True, exist_ok=True)
    path = runs / f"{name}.json"
    path.write_text(json.dumps({"config": config, "store": store, "model_key": model if isinstance(model, str) else _key(model),
                                "predicted_store": predicted or store, "prediction_key": _key(prediction), "finished": "x"}))
    return path


def test_only_this_configurations_older_results_go_and_nothing_a_record_names_outside_it(tmp_path, caplog):
    """Another configuration's records in the same output_dir, a parallel run that finished after
    this one, records anyone could write (keys that are paths, another store, a path that does not
    resolve), a folder replaced by a link, a store and a report another process writes (and what
    that report's result shares): each is left alone, and the rest still goes."""
    X, bags, y, _ = make_toy_bags(n_bags=8, seed=2)
    ours, other = write_store(tmp_path / "ours.zarr", X, bags, y), write_store(tmp_path / "other.zarr", X, bags, y)
    busy = write_store(tmp_path / "busy.zarr", X, bags, y)
    out, victim = tmp_path / "out", tmp_path / "victim"
    victim.mkdir()
    for n in [1, 2, 3, 4, 5, 6]:
        (out / "models" / _key(n)).mkdir(parents=True, exist_ok=True)
        zarr.open_group(ours, mode="a").require_group(f"training/{_key(n)}")
    for n in [8, 10, 12]:
        (out / "models" / _key(n)).mkdir(parents=True)
    (out / "models" / f".removing-{_key(11)}").mkdir()  # a removal a kill interrupted
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True).stdout.strip()
    (out / "models" / _key(10) / READERS).mkdir()  # a reader killed with -9: its file stays, its process is gone
    (out / "models" / _key(10) / READERS / "gone.json").write_text(json.dumps(
        {"host": socket.gethostname(), "pid": int(dead), "pid_start": "0", "purpose": "a killed prediction", "started": 0.0, "token": "t"}))
    for n in [101, 102, 103, 104, 111, 112, 114, 115, 116, 117, 118]:
        (out / "predictions" / _key(n)).mkdir(parents=True, exist_ok=True)
        zarr.open_group(ours, mode="a").require_group(f"predictions/{_key(n)}")
    (out / "predictions" / _key(110) / "instances").mkdir(parents=True)  # a group a kill left without its zarr.json
    (Path(ours) / "predictions" / _key(110) / "instances").mkdir(parents=True)
    for name in [f"{_key(9)}-member0", f"{_key(9)}-features1"]:  # EmbeddedGPMIL's checkpoints
        zarr.open_group(ours, mode="a").require_group(f"training/{name}")
    zarr.open_group(other, mode="a").require_group(f"predictions/{_key(106)}")
    zarr.open_group(busy, mode="a").require_group(f"predictions/{_key(103)}")
    (out / "models" / _key(9)).symlink_to(victim)
    runs = out / RUNS
    runs.mkdir()

    def record(name: str, config: str, model: int | str, prediction: int, store: str = ours, predicted: str = ours) -> Path:
        return _write_record(runs, name, config, model, prediction, store, predicted)

    record("00", "nightly", 3, 110)  # older: its model is this run's too
    record("01", "nightly", 1, 101)  # older: its model is the weekly configuration's too
    record("02", "weekly", 1, 102)  # another configuration's: never ours to remove
    record("03", "nightly", 2, 103, predicted=busy)  # its prediction store is being written by another process
    record("04", "nightly", 9, 104)  # EmbeddedGPMIL's checkpoints; its model folder was replaced by a link
    record("04a", "nightly", 6, 111)  # its report is being written by another process
    record("04b", "nightly", 6, 112)  # shares its model with 04a
    record("04c", "nightly", 8, 114)  # its model is being read by another process (a run with its settings)
    record("04d", "nightly", 10, 115)  # its model's only reader is gone
    record("04e", "nightly", 11, 116)  # its model's removal was interrupted
    record("04f", "nightly", 12, 117)  # its model is being removed by another process (a parallel run's keep_runs)
    record("04g", "nightly", 4, 118)  # its model is 09's (kept), and being read by another process
    record("05", "nightly", 5, 106, store=other, predicted=other)  # a store that is not this configuration's
    record("06", "nightly", "../../victim", 107)  # keys that are paths
    record("06a", "nightly", 7, 113, store="a\x00b")  # a path that does not resolve
    (runs / "07.json").write_text('{"config": ')  # cut short
    current = record("08", "nightly", 3, 108)  # this run
    record("09", "nightly", 4, 109)  # a parallel run of the same configuration that finished after this one
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from contextlib import ExitStack\n"
                               "from tasks.lease import reader_lease, writer_lease\n"
                               "with ExitStack() as held:\n    [held.enter_context(writer_lease(p, 'a writer')) for p in sys.argv[3:]]\n"
                               "    [held.enter_context(reader_lease(p, 'a prediction')) for p in sys.argv[1:3]]\n"
                               "    print('held', flush=True); time.sleep(600)", str(out / "models" / _key(8)), str(out / "models" / _key(4)),
                               str(out / "predictions" / _key(111)), busy, str(out / "models" / _key(12))],
                              stdout=subprocess.PIPE, text=True, cwd=Path(__file__).parents[1])
    try:
        assert holder.stdout.readline().strip() == "held"
        removed = prune_runs(out, "nightly", [ours, busy], keep=1, current=current)
    finally:
        holder.kill()
        holder.wait()

    assert removed == [f"{ours}/predictions/{_key(110)}", str(out / "predictions" / _key(110)),  # 00: its model is this run's
                       f"{ours}/predictions/{_key(101)}", str(out / "predictions" / _key(101)),  # 01: its model is weekly's
                       str(out / "models" / _key(2)), f"{ours}/training/{_key(2)}",  # 03: what went before the busy store was reached
                       f"{ours}/training/{_key(9)}-features1", f"{ours}/training/{_key(9)}-member0",  # 04: not the linked folder
                       f"{ours}/predictions/{_key(104)}", str(out / "predictions" / _key(104)),
                       f"{ours}/predictions/{_key(112)}", str(out / "predictions" / _key(112)),  # 04b: its model is 04a's
                       str(out / "models" / _key(10)), f"{ours}/predictions/{_key(115)}", str(out / "predictions" / _key(115)),
                       str(out / "models" / _key(11)), f"{ours}/predictions/{_key(116)}", str(out / "predictions" / _key(116)),
                       str(out / "models" / _key(5))]  # 05: its groups in the other store stay
    assert sorted(p.stem for p in runs.glob("*.json")) == ["02", "03", "04a", "04c", "04f", "04g", "05", "06", "06a", "07", "08", "09"]
    assert {p.name for p in (out / "models").iterdir()} == {_key(n) for n in (1, 3, 4, 6, 8, 9, 12)} | {f"{_key(12)}.writer-lease.json"}
    assert "04f.json stay (for a later run to remove): StoreLockedError" in caplog.text
    assert f"04c.json stay (for a later run to remove): its model {out / 'models' / _key(8)} is read by a prediction (host" in caplog.text
    assert all((out / "predictions" / _key(n)).is_dir() and _key(n) in zarr.open_group(ours, mode="r")["predictions"]
               for n in (114, 117, 118))  # nothing of a result goes while its model is read (kept or not), or removed by another run
    assert f"04g.json stay (for a later run to remove): its model {out / 'models' / _key(4)} is read by a prediction" in caplog.text
    assert {_key(6), _key(1)} <= set(zarr.open_group(ours, mode="r")["training"].group_keys())
    assert (out / "predictions" / _key(111)).is_dir() and _key(103) in zarr.open_group(busy, mode="r")["predictions"]
    assert _key(106) in zarr.open_group(other, mode="r")["predictions"] and victim.is_dir()
    assert f"{_key(9)} is a symbolic link, not a folder gpmil wrote: left alone" in caplog.text
    assert "03.json stay (for a later run to remove): StoreLockedError" in caplog.text
    assert f"{_key(111)} and what its result shares stay" in caplog.text
    assert "06.json names keys that are no content keys" in caplog.text and "07.json is unreadable" in caplog.text
    assert "06a.json is unreadable" in caplog.text
    with pytest.raises(ValueError, match="keep_runs=0"):
        prune_runs(out, "nightly", [ours], keep=0, current=current)


def test_the_pruning_leaves_the_report_folders_it_keeps_free_for_their_own_runs(tmp_path, monkeypatch):
    """Two configurations on one output_dir sharing a result: the nightly one's pruning held the
    writer lease of every older report folder, the weekly one's too, which it keeps; the weekly run
    writing its report meanwhile failed (``StoreLockedError: … gpmil keep_runs: removing …``)."""
    import tasks.retention as retention

    X, bags, y, _ = make_toy_bags(n_bags=8, seed=2)
    store = write_store(tmp_path / "ours.zarr", X, bags, y)
    out = tmp_path / "out"
    for n in (1, 2, 3):
        (out / "models" / _key(n)).mkdir(parents=True)
    for n in (101, 102, 103):
        (out / "predictions" / _key(n)).mkdir(parents=True)
    runs = out / RUNS
    _write_record(runs, "01", "nightly", 1, 101, store)  # older, and the weekly configuration's newest result
    _write_record(runs, "02", "weekly", 1, 101, store)
    _write_record(runs, "03", "nightly", 2, 102, store)  # older, only nightly's: goes
    current = _write_record(runs, "04", "nightly", 3, 103, store)
    attempts = []
    remove = retention._remove_unused

    def weekly_writes_its_report(*args, **kwargs):  # the weekly run, in another process, while the pruning goes
        attempts.append(subprocess.run([sys.executable, "-c", "import sys; from tasks.lease import writer_lease\n"
                                        "with writer_lease(sys.argv[1], 'report 101'): print('written')", str(out / "predictions" / _key(101))],
                                       capture_output=True, text=True, cwd=Path(__file__).parents[1]))
        return remove(*args, **kwargs)

    monkeypatch.setattr(retention, "_remove_unused", weekly_writes_its_report)
    removed = prune_runs(out, "nightly", [store], keep=1, current=current)
    assert [a.stdout.strip() for a in attempts] == ["written", "written"], [a.stderr[-300:] for a in attempts]
    assert str(out / "models" / _key(2)) in removed and (out / "predictions" / _key(101)).is_dir()


def test_a_prediction_that_comes_while_its_model_is_removed_waits_and_finds_it_gone(tmp_path, monkeypatch):
    """The remover reads the model's readers under the model's writer lease; a prediction whose
    reader lease comes just after that look waits for the lease and meets a folder that is gone
    (FileNotFoundError before it reads anything), never one that goes while it reads."""
    import tasks.retention as retention

    out, store = tmp_path / "out", str(tmp_path / "cohort.zarr")
    model = out / "models" / _key(1)
    model.mkdir(parents=True)
    (model / "model.json").write_text("{}")
    runs = out / RUNS
    for name, key, prediction in [("01", 1, 101), ("02", 2, 102)]:
        _write_record(runs, name, "nightly", key, prediction, store)
    real, late = retention.live_readers, {}

    def read_the_model():
        try:
            with reader_lease(model, "a late prediction"):
                late["entered"] = True
                late["read"] = (model / "model.json").read_text()
        except FileNotFoundError as error:
            late["refused"] = error

    def a_reader_comes_after_the_look(folder):
        found = real(folder)
        late["thread"] = threading.Thread(target=read_the_model)
        late["thread"].start()
        deadline = time.monotonic() + 30
        while not list((model / READERS).glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.01)  # its lease file is made before the removal goes on
        return found

    renamed_under_the_lease, rename = [], os.rename

    def rename_noting_the_lease(source, target):
        renamed_under_the_lease.append(lease_path(model).exists())
        rename(source, target)

    monkeypatch.setattr(retention, "live_readers", a_reader_comes_after_the_look)
    monkeypatch.setattr(retention.os, "rename", rename_noting_the_lease)
    assert prune_runs(out, "nightly", [store], keep=1, current=runs / "02.json") == [str(model)]
    late["thread"].join(30)
    assert renamed_under_the_lease == [True]
    assert "entered" not in late and "was removed as this reader came" in str(late["refused"]), late
    assert sorted(p.name for p in (out / "models").iterdir()) == []  # no folder aside, no lease file left


def test_a_run_and_a_prediction_hold_the_models_reader_lease_while_they_predict(tmp_path, monkeypatch):
    """While ``gpmil run`` and ``gpmil predict`` (a folder or ``latest``) predict with a model, the
    model folder shows their reader lease, which ``keep_runs`` of another run respects: a run from
    before its training stage reuses a model trained before until its record names the model. It
    is gone once they are done."""
    import tasks.prefect_tasks as t
    from flows.pipeline import predict_cohort
    from tasks.lease import live_readers

    real, seen = t.predict_cohort, []

    def predict_cohort_noting_readers(model, store, client, **kwargs):
        seen.append(live_readers(kwargs["provenance"]["model_dir"]))
        return real(model, store, client, **kwargs)

    real_train, seen_in_training = t.train, []

    def train_noting_readers(config, store, model_key, scheduler_address):
        model = Path(config.output_dir) / "models" / model_key
        seen_in_training.append(live_readers(model) if model.is_dir() else None)
        return real_train(config, store, model_key, scheduler_address)

    import flows.pipeline

    real_record, seen_at_record = flows.pipeline.record_run, []

    def record_run_noting_readers(output_dir, latest, model_key):
        seen_at_record.append(live_readers(latest["model_dir"]))
        return real_record(output_dir, latest, model_key)

    monkeypatch.setattr(t, "predict_cohort", predict_cohort_noting_readers)
    monkeypatch.setattr(t, "train", train_noting_readers)
    monkeypatch.setattr(flows.pipeline, "record_run", record_run_noting_readers)  # held until the record names the model
    X, bags, y, _ = make_toy_bags(n_bags=8, seed=4)
    cohort = write_store(tmp_path / "cohort.zarr", X, bags, y)
    first = _run(tmp_path, cohort, 3)
    model = tmp_path / "out" / "models" / first["model"]
    assert _run(tmp_path, cohort, 3) == first  # the model reused: its lease is taken before the training stage reuses it
    assert seen_in_training[0] is None and [r.split(" (host ")[0] for r in seen_in_training[1]] == [f"nightly: run with {first['model']}"]
    assert [len(readers) for readers in seen_at_record] == [1, 1]
    config = str(tmp_path / "nightly.yaml")
    X, bags, y, _ = make_toy_bags(n_bags=6, seed=9)
    predict_cohort(config, str(model), store=write_store(tmp_path / "new.zarr", X, bags, y))
    X, bags, y, _ = make_toy_bags(n_bags=5, seed=10)
    predict_cohort(config, "latest", store=write_store(tmp_path / "newer.zarr", X, bags, y))
    not_a_model = tmp_path / "not-a-model"  # a deployment's parameter naming the wrong folder
    not_a_model.mkdir()
    with pytest.raises(ConfigError, match=f"MODEL_DIR: {not_a_model / 'model.json'}"):
        predict_cohort(config, str(not_a_model), store=str(tmp_path / "new.zarr"))
    assert list(not_a_model.iterdir()) == []  # no lease file left in it
    assert [len(readers) for readers in seen] == [1, 1, 1], seen
    assert [readers[0].split(" (host ")[0] for readers in seen] == [f"nightly: {stage} with {first['model']}"
                                                                    for stage in ("run", "predict", "predict")]
    assert live_readers(model) == []


def test_a_run_recorded_while_the_pruning_goes_keeps_what_it_uses(tmp_path, monkeypatch):
    """A parallel run that reused an older result's model lets go of its reader lease only once its
    record is written: a removal that read the records before that record existed reads them again
    after its look at the model's readers, and keeps what the new record uses (here the same
    result: model, predictions and report); the older record goes, its outputs now the new one's."""
    import tasks.retention as retention

    out, store = tmp_path / "out", str(tmp_path / "cohort.zarr")
    model, report = out / "models" / _key(1), out / "predictions" / _key(101)
    model.mkdir(parents=True)
    (model / "model.json").write_text("{}")
    report.mkdir(parents=True)
    runs = out / RUNS
    _write_record(runs, "01", "nightly", 1, 101, store)
    current = _write_record(runs, "02", "nightly", 2, 102, store)
    real = retention.live_readers

    def a_run_is_recorded_as_its_lease_goes(folder):
        found = real(folder)
        _write_record(runs, "03", "nightly", 1, 101, store)
        return found

    monkeypatch.setattr(retention, "live_readers", a_run_is_recorded_as_its_lease_goes)
    assert prune_runs(out, "nightly", [store], keep=1, current=current) == []
    assert (model / "model.json").is_file() and report.is_dir()
    assert sorted(p.stem for p in runs.glob("*.json")) == ["02", "03"]
