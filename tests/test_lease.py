"""One writer per store: the writer lease between real processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tasks.lease import StoreLockedError, lease_path, read_lease, writer_lease

HOLDER = """
import sys, time
from pathlib import Path
from tasks.lease import writer_lease
with writer_lease(sys.argv[1], "test holder"):
    print("held", flush=True)
    while not Path(sys.argv[2]).exists():
        time.sleep(0.05)
"""


def _start_holder(store: Path, release: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(store), str(release)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_writer_process_is_refused_at_once_and_gets_the_lease_after_release(tmp_path):
    store, release = tmp_path / "c.zarr", tmp_path / "release"
    holder = _start_holder(store, release)
    try:
        started = time.monotonic()
        with pytest.raises(StoreLockedError, match=rf"being written by another run: test holder \(host .*PID {holder.pid}"):
            with writer_lease(store, "second run"):
                pass
        assert time.monotonic() - started < 2.0  # immediate, no waiting
    finally:
        release.touch()
        assert holder.wait(timeout=30) == 0
    assert not lease_path(store).exists()  # released by its holder
    with writer_lease(store, "second run"):
        assert read_lease(store)[0].pid == os.getpid()


def test_the_lease_of_a_killed_writer_is_taken_over(tmp_path, caplog):
    store = tmp_path / "c.zarr"
    holder = _start_holder(store, tmp_path / "never")
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert read_lease(store)[0].pid == holder.pid  # left behind by the kill
    with writer_lease(store, "rerun"):
        assert read_lease(store)[0].purpose == "rerun"
    assert "took over the writer lease" in caplog.text and f"process {holder.pid}" in caplog.text


def _foreign_lease(store: Path, age: float) -> None:
    path = lease_path(store)
    path.write_text(json.dumps({"host": "other-node", "pid": 1, "pid_start": None, "purpose": "run on other-node",
                                "started": time.time() - age, "token": "x"}))
    os.utime(path, (time.time() - age, time.time() - age))


def test_of_two_runs_taking_over_one_stale_lease_only_one_gets_it(tmp_path, monkeypatch):
    """Two runs find the same stale lease; the other takes it over (renames it aside and makes its
    own) between this run's look and its rename: this run moved the other's live lease aside and
    held the store beside it. Now it puts the lease back and is refused."""
    import tasks.lease

    store, release = tmp_path / "c.zarr", tmp_path / "release"
    _foreign_lease(store, age=10_000)
    looked = tasks.lease._read_lease_record
    holders = []

    def look_then_lose_the_race(path):
        current = looked(path)
        if not holders and path == lease_path(store):  # this run judged the stale lease; the other run takes it over now
            holders.append(_start_holder(store, release))
        return current

    monkeypatch.setattr(tasks.lease, "_read_lease_record", look_then_lose_the_race)
    try:
        with pytest.raises(StoreLockedError, match=r"being written by another run: test holder") as refused:
            with writer_lease(store, "second run"):
                pass
        assert f"PID {holders[0].pid}," in str(refused.value)
        assert read_lease(store)[0].pid == holders[0].pid
        assert sorted(p.name for p in tmp_path.iterdir()) == ["c.zarr.writer-lease.json"]
    finally:
        release.touch()
        for holder in holders:
            assert holder.wait(timeout=30) == 0


def test_a_half_written_lease_that_replaced_an_unreadable_stale_one_is_not_taken(tmp_path, monkeypatch):
    """An unreadable stale lease (a writer killed while creating it) and, before this run's rename,
    another run's new lease not yet written (unreadable too): the two read alike, so the file
    itself (its inode) tells them apart; the new one is put back and this run refused."""
    import tasks.lease

    store = tmp_path / "c.zarr"
    path = lease_path(store)
    path.write_text("{cut")
    old = time.time() - 10_000
    os.utime(path, (old, old))
    looked = tasks.lease._read_lease_record

    def look_then_lose_the_race(where):
        current = looked(where)
        if where == path and path.read_text() == "{cut":  # the other run takes the stale one over and has just created its lease
            os.rename(path, tmp_path / "theirs-aside")
            (tmp_path / "theirs-aside").unlink()
            path.touch()
        return current

    monkeypatch.setattr(tasks.lease, "_read_lease_record", look_then_lose_the_race)
    with pytest.raises(StoreLockedError, match="being written by another run: unreadable lease file"):
        with writer_lease(store, "second run"):
            pass
    assert path.exists() and path.read_text() == ""  # the other run's, put back for it to write
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]


def test_a_lease_from_another_host_holds_until_it_expires(tmp_path):
    store = tmp_path / "c.zarr"
    _foreign_lease(store, age=5)
    with pytest.raises(StoreLockedError, match="run on other-node.*host other-node"):
        with writer_lease(store, "mine", ttl=60):
            pass
    _foreign_lease(store, age=120)
    with writer_lease(store, "mine", ttl=60):
        assert read_lease(store)[0].host == socket.gethostname()


def test_the_lease_is_reentrant_in_one_process_and_refreshed_while_held(tmp_path):
    store = tmp_path / "new" / "folder" / "c.zarr"  # a store about to be created
    with writer_lease(store, "flow", ttl=0.4):
        first = lease_path(store).stat().st_mtime
        with writer_lease(store, "library call inside the flow"):
            assert read_lease(store)[0].purpose == "flow"
        assert lease_path(store).exists()
        time.sleep(0.5)
        assert lease_path(store).stat().st_mtime > first  # the heartbeat kept it fresh (ttl 0.4 s)
    assert not lease_path(store).exists()


def test_readers_ignore_the_lease(tmp_path):
    import numpy as np

    from tasks.store import open_cohort
    from tests.conftest import make_toy_bags
    from tests.test_distributed import write_store

    X, bags, y, _ = make_toy_bags(n_bags=4, seed=0)
    store = Path(write_store(tmp_path / "c.zarr", X, bags, y))
    release = tmp_path / "release"
    holder = _start_holder(store, release)
    try:
        cohort = open_cohort(store)
        assert cohort.n_bags == 4 and np.asarray(cohort.offsets)[-1] == len(X)
    finally:
        release.touch()
        holder.wait(timeout=30)


def test_training_and_prediction_hold_the_lease_so_a_second_process_is_refused(tmp_path):
    """fit_cohort / predict_cohort write the store (checkpoints, predictions): a run while another
    process holds the lease fails at once, before any write."""
    import zarr
    from distributed import Client, LocalCluster

    from mil_core import VGPMIL
    from tasks.training import fit_cohort, predict_cohort
    from tests.conftest import make_toy_bags
    from tests.test_distributed import write_store

    X, bags, y, _ = make_toy_bags(n_bags=8, seed=0)
    store = Path(write_store(tmp_path / "c.zarr", X, bags, y))
    release = tmp_path / "release"
    holder = _start_holder(store, release)
    try:
        with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
            with pytest.raises(StoreLockedError, match="test holder"):
                fit_cohort(VGPMIL(n_inducing=4, max_iter=2), store, client, run="r")
            model = VGPMIL(n_inducing=4, max_iter=2, random_state=0).fit(X, bags, y)
            with pytest.raises(StoreLockedError, match="test holder"):
                predict_cohort(model, store, client, run="p")
    finally:
        release.touch()
        holder.wait(timeout=30)
    root = zarr.open_group(str(store), mode="r")
    assert "training" not in root and "predictions" not in root  # nothing was written


def test_a_run_whose_lease_was_taken_over_stops_before_its_next_commit(tmp_path):
    import numpy as np

    from tasks.ingest.driver import IngestItem, run_ingest
    from tasks.store import CohortSpec, open_cohort

    store = tmp_path / "c.zarr"
    spec = CohortSpec(name="c", n_features=2, coords_dim=1, coords_meaning="index")

    def writer(item, staging):
        if item.bag_id == "b1":  # another process takes the lease over while this run is frozen
            lease_path(store).write_text(json.dumps({"host": "other-node", "pid": 1, "pid_start": None,
                                                     "purpose": "run on other-node", "started": 0.0, "token": "x"}))
        staging.write(np.ones((2, 2)), np.zeros((2, 1)), np.full(2, -1))

    items = [IngestItem(f"b{k}", f"/b{k}", 0, None) for k in range(3)]
    with pytest.raises(StoreLockedError, match="was lost while this run held it .*run on other-node"):
        run_ingest(store, spec, items, writer, commit_every=1)
    assert list(open_cohort(store).bag_ids) == ["b0"]  # committed before the take-over; nothing after


def test_a_training_run_whose_lease_was_taken_over_stops_before_its_next_checkpoint(tmp_path):
    import zarr
    from distributed import Client, LocalCluster

    from mil_core import VGPMIL
    from tasks.training import fit_cohort
    from tests.conftest import make_toy_bags
    from tests.test_distributed import write_store

    X, bags, y, _ = make_toy_bags(n_bags=8, seed=0)
    store = Path(write_store(tmp_path / "c.zarr", X, bags, y))

    def taken_over_at_3(iteration, objective):
        if iteration == 3:
            lease_path(store).write_text(json.dumps({"host": "other-node", "pid": 1, "pid_start": None,
                                                     "purpose": "run on other-node", "started": 0.0, "token": "x"}))

    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        with pytest.raises(StoreLockedError, match="was lost while this run held it"):
            fit_cohort(VGPMIL(n_inducing=4, max_iter=6, tol=0.0), store, client, run="r", checkpoint_every=2,
                       on_iteration=taken_over_at_3)
    assert zarr.open_group(str(store), mode="r")["training/r"].attrs["latest"] == 2  # the checkpoint before stays


def _taken_over(store: Path) -> None:
    lease_path(store).write_text(json.dumps({"host": "other-node", "pid": 1, "pid_start": None,
                                             "purpose": "run on other-node", "started": 0.0, "token": "x"}))


def test_a_prediction_whose_lease_was_taken_over_neither_removes_nor_completes_a_group(tmp_path, monkeypatch):
    """A prediction frozen past the ttl went on beside the writer that took the store over: it
    removed the group that writer wrote, wrote its partitions into the one that writer made whole
    and rewrote its attributes. Now it stops before each of these."""
    import zarr
    from distributed import Client, LocalCluster

    import tasks.training.predict
    from mil_core import RBF, VGPMIL
    from tasks.training import predict_cohort
    from tests.conftest import make_toy_bags
    from tests.test_distributed import write_store

    X, bags, y, _ = make_toy_bags(n_bags=8, seed=0)
    store = Path(write_store(tmp_path / "c.zarr", X, bags, y))
    model = VGPMIL(kernel=RBF(4.0), n_inducing=4, max_iter=3).fit(X, bags, y)
    completed = tasks.training.predict.as_completed

    def frozen_while_predicting(futures):  # meanwhile another run takes the store over and predicts "q" whole
        _taken_over(store)
        root = zarr.open_group(str(store), mode="a", zarr_format=3)
        del root["predictions/q"]
        root.require_group("predictions/q").attrs["complete"] = True
        return completed(futures)

    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        predict_cohort(model, store, client, run="p")
        monkeypatch.setattr(tasks.training.predict, "as_completed", frozen_while_predicting)
        with pytest.raises(StoreLockedError, match="was lost while this run held it .*run on other-node"):
            predict_cohort(model, store, client, run="q")
        assert dict(zarr.open_group(str(store), mode="r")["predictions/q"].attrs) == {"complete": True}  # the other run's
        assert [p.name for p in (store / "predictions" / "q").rglob("*") if p.is_file()] == ["zarr.json"]  # nothing written into it
        lease_path(store).unlink()  # that run ended; the next is taken over before it removes a group
        with pytest.raises(StoreLockedError, match="was lost"):
            with writer_lease(store, "frozen run"):
                _taken_over(store)
                tasks.training.predict.predict_cohort(model, store, client, run="p")
    assert zarr.open_group(str(store), mode="r")["predictions/p"].attrs["complete"]  # not removed


def test_a_table_ingest_whose_lease_was_taken_over_stops_before_its_next_bag(tmp_path, monkeypatch):
    """A table ingest frozen past the ttl while another run took the store over and committed a
    bag wrote its later bags' rows from where it had begun, resizing the arrays under that bag (its
    rows lost) before the commit's check stopped it. Now each bag is checked before its rows."""
    import numpy as np
    import pandas as pd

    import tasks.ingest.tables
    from tasks.ingest.tables import ingest_table, read_mil_csv
    from tasks.store import BagData, append_bags, open_cohort

    table = tmp_path / "t.csv"
    pd.DataFrame([[b % 2, f"b{b}", float(b)] for b in range(6) for _ in range(2)]).to_csv(table, header=False, index=False)
    store = tmp_path / "c.zarr"
    checked = tasks.ingest.tables.finite_rows
    calls = []

    def frozen_at_the_third_bag(*args, **kwargs):  # the other run takes over and commits a bag of 20 rows
        calls.append(1)
        if len(calls) == 3:
            _taken_over(store)
            append_bags(store, [BagData("taker", 1, "other", np.full((20, 1), 7.0), np.zeros((20, 1)), np.full(20, -1))])
        return checked(*args, **kwargs)

    monkeypatch.setattr(tasks.ingest.tables, "finite_rows", frozen_at_the_third_bag)
    with pytest.raises(StoreLockedError, match="was lost while this run held it .*run on other-node"):
        ingest_table(store, read_mil_csv(table), chunk_rows=2)
    cohort = open_cohort(store)
    assert list(cohort.bag_ids) == ["taker"]
    np.testing.assert_array_equal(cohort.read_bags(0, 1).features, np.full((20, 1), 7.0))


def test_a_model_reader_counts_while_its_process_runs_here_or_while_it_is_refreshed_elsewhere(tmp_path, caplog):
    """Reader leases (:func:`reader_lease`): on this host a reader counts as long as its process
    runs, however old its file (a refresh that kept failing, a frozen mount); from another host
    while refreshed within the ttl; a refresh that fails is tried again at the next tick."""
    from tasks.lease import READERS, _process_start, live_readers, reader_lease

    model = tmp_path / "model"
    (model / READERS).mkdir(parents=True)
    hour_ago = time.time() - 3600
    for name, host, pid, age in [("this process, an hour old", socket.gethostname(), os.getpid(), 3600),
                                 ("elsewhere, fresh", "another-host", 1, 0), ("elsewhere, an hour old", "another-host", 1, 3600)]:
        path = model / READERS / f"{name}.json"
        path.write_text(json.dumps({"host": host, "pid": pid, "pid_start": _process_start(pid) if host != "another-host" else None,
                                    "purpose": name, "started": 0.0, "token": name}))
        os.utime(path, (time.time() - age, time.time() - age))
    assert sorted(r.split(" (host")[0] for r in live_readers(model, ttl=600)) == ["elsewhere, fresh", "this process, an hour old"]
    for path in (model / READERS).glob("*.json"):
        path.unlink()

    with reader_lease(model, "a long prediction", ttl=0.4):  # refreshed every 0.1 s
        [mine] = list((model / READERS).glob("*.json"))
        mine.rename(mine.with_suffix(".away"))
        mine.mkdir()  # reading the lease file fails (IsADirectoryError) for a few ticks
        time.sleep(0.35)
        mine.rmdir()
        mine.with_suffix(".away").rename(mine)
        os.utime(mine, (hour_ago, hour_ago))
        time.sleep(0.35)
        assert time.time() - mine.stat().st_mtime < 1.0  # refreshed again after the failures
    assert "could not refresh the lease" in caplog.text and not mine.exists()
    with pytest.raises(FileNotFoundError, match="is not there"):
        live_readers(tmp_path / "gone")
