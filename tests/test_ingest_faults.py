"""Ingest under faults, in real processes: a kill between staging and commit, a full disk
(``RLIMIT_FSIZE``), two concurrent runs. Whatever happens, what is completely staged is committed by
the next run, half-staged bags are redone, and nothing committed is ever lost or changed."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import zarr

from tasks.ingest.driver import IngestItem, run_ingest
from tasks.lease import lease_path
from tasks.store import CohortSpec, open_cohort

N_FEATURES = 8
SPEC = CohortSpec(name="faults", n_features=N_FEATURES, coords_dim=1, coords_meaning="index", chunk_rows=4096)
ROOT = Path(__file__).resolve().parents[1]


def bag_features(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, N_FEATURES)).astype(np.float32)


def random_bag_writer(item: IngestItem, writer) -> None:
    """A featuriser stand-in: deterministic rows per bag, optionally slow."""
    time.sleep(item.payload.get("sleep", 0.0))
    n = item.payload["n"]
    writer.write(bag_features(item.payload["seed"], n), np.arange(n)[:, None], np.full(n, -1, dtype=np.int8))


def must_not_run(item: IngestItem, writer) -> None:
    raise AssertionError(f"{item.bag_id} was staged again although a complete staged copy existed")


def make_items(n_bags: int, n: int = 5, sleep: float = 0.0, first: int = 0) -> list[IngestItem]:
    return [IngestItem(f"bag{i:02d}", f"/src/bag{i:02d}.tiff", i % 2, {"seed": i, "n": n, "sleep": sleep})
            for i in range(first, first + n_bags)]


def committed(store) -> dict[str, np.ndarray]:
    cohort = open_cohort(store)
    features = zarr.open_group(str(store), mode="r")["instances/features"]
    return {str(b): features[cohort.bag_slice(i)] for i, b in enumerate(cohort.bag_ids)}


def child(mode: str, store: str, *args: str) -> None:
    """Entry point of the child processes (``python -c`` below)."""
    if mode == "kill-before-commit":
        def kill_at_the_end(done, total, bag_id, failure):
            if done == total:  # every bag staged, none committed yet (commit_every is larger)
                os.kill(os.getpid(), signal.SIGKILL)

        run_ingest(store, SPEC, make_items(6), random_bag_writer, commit_every=100, on_progress=kill_at_the_end)
    elif mode == "full-disk":
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail with EFBIG instead of killing
        limit = int(args[0])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
        try:
            run_ingest(store, SPEC, make_items(12, n=300), random_bag_writer, commit_every=2)
        except OSError as error:
            print(json.dumps({"errno": error.errno}), flush=True)
            sys.exit(3)
    elif mode == "slow":
        from tasks.lease import StoreLockedError

        try:
            report = run_ingest(store, SPEC, make_items(8, sleep=float(args[0])), random_bag_writer)
        except StoreLockedError as error:
            print(json.dumps({"locked": str(error)}), flush=True)
            sys.exit(4)
        print(json.dumps({"added": list(report.added)}), flush=True)


def run_child(*args: str, wait: bool = True) -> subprocess.CompletedProcess | subprocess.Popen:
    command = [sys.executable, "-c", "import sys; from tests.test_ingest_faults import child; child(*sys.argv[1:])", *args]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if wait:
        return subprocess.run(command, capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)


def test_bags_staged_by_a_run_killed_before_its_commit_are_committed_by_the_next_run(tmp_path):
    store = tmp_path / "c.zarr"
    result = run_child("kill-before-commit", str(store))
    assert result.returncode == -signal.SIGKILL, result.stderr
    assert open_cohort(store).n_bags == 0  # staged, not committed
    report = run_ingest(store, SPEC, make_items(6), must_not_run)  # nothing is staged again
    assert sorted(report.added) == [f"bag{i:02d}" for i in range(6)]
    bags = committed(store)
    for i in range(6):
        np.testing.assert_array_equal(bags[f"bag{i:02d}"], bag_features(i, 5))
    assert list(zarr.open_group(str(store), mode="r")["staging"].keys()) == []
    assert run_ingest(store, SPEC, make_items(6), must_not_run).already_done == tuple(f"bag{i:02d}" for i in range(6))


def test_a_half_staged_bag_is_redone_and_a_stale_staged_copy_is_replaced(tmp_path):
    from tasks.store import StagingWriter

    store = tmp_path / "c.zarr"
    run_ingest(store, SPEC, make_items(1), random_bag_writer)  # creates the store
    half = StagingWriter(store, "bag01", 1, "/src/bag01.tiff")
    half.write(np.zeros((2, N_FEATURES)), np.zeros((2, 1)), np.full(2, -1))  # never finished
    stale = StagingWriter(store, "bag02", 0, "/elsewhere/bag02.tiff")  # staged from another file
    stale.write(np.zeros((3, N_FEATURES)), np.zeros((3, 1)), np.full(3, -1))
    stale.finish()
    report = run_ingest(store, SPEC, make_items(3), random_bag_writer)
    assert report.added == ("bag01", "bag02") and report.already_done == ("bag00",)
    bags = committed(store)
    np.testing.assert_array_equal(bags["bag01"], bag_features(1, 5))
    np.testing.assert_array_equal(bags["bag02"], bag_features(2, 5))


def test_a_full_disk_during_commit_loses_nothing_and_the_rerun_commits_everything(tmp_path):
    store = tmp_path / "c.zarr"
    run_ingest(store, SPEC, make_items(4, n=300), random_bag_writer)
    before = committed(store)
    chunk = max(p.stat().st_size for p in (store / "instances" / "features").rglob("*") if p.is_file())
    result = run_child("full-disk", str(store), str(chunk + 20_000))  # room for two more bags in the chunk, not all
    assert result.returncode == 3, result.stderr[-2000:]
    assert json.loads(result.stdout)["errno"] == errno.EFBIG
    partial = committed(store)
    for bag_id, features in before.items():  # what was committed before is untouched
        np.testing.assert_array_equal(partial[bag_id], features)
    assert len(partial) < 12
    report = run_ingest(store, SPEC, make_items(12, n=300), random_bag_writer)
    bags = committed(store)
    assert sorted(bags) == [f"bag{i:02d}" for i in range(12)] and len(report.added) == 12 - len(partial)
    for i in range(12):
        np.testing.assert_array_equal(bags[f"bag{i:02d}"], bag_features(i, 300))


def test_two_concurrent_ingest_runs_one_fails_at_once_and_nothing_is_lost(tmp_path):
    store = tmp_path / "c.zarr"
    first = run_child("slow", str(store), "0.3", wait=False)
    deadline = time.monotonic() + 60
    while not lease_path(store).exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.05)
    started = time.monotonic()
    second = run_child("slow", str(store), "0.0")
    assert second.returncode == 4, second.stderr[-2000:]
    assert time.monotonic() - started < 30 and f"PID {first.pid}" in json.loads(second.stdout)["locked"]
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err[-2000:]
    assert len(json.loads(out)["added"]) == 8
    again = run_child("slow", str(store), "0.0")
    assert again.returncode == 0 and json.loads(again.stdout)["added"] == []
    bags = committed(store)
    assert sorted(bags) == [f"bag{i:02d}" for i in range(8)]
    for i in range(8):
        np.testing.assert_array_equal(bags[f"bag{i:02d}"], bag_features(i, 5))
