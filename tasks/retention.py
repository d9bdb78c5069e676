"""What a nightly schedule leaves behind: one record per completed ``gpmil run`` in
``<output_dir>/runs/``, and, with ``keep_runs: N``, the removal of what only older runs use.

Every run on a new cohort writes a model (``<output_dir>/models/<model key>/``), a training
checkpoint (``<store>/training/<model key>``), predictions (``<store>/predictions/<prediction
key>``) and a report folder (``<output_dir>/predictions/<prediction key>/``, instance tables,
GeoJSON and heatmaps); a nightly run adds them night after night. With ``keep_runs: N`` a run, once
complete, keeps the outputs of the newest ``N`` distinct results (a rerun that changed nothing is
the same result) and removes each older one's, unless a kept result uses it (a model shared with a
newer prediction).

Only what a record names by its keys is removed, at paths built from the keys (a record is a file
others can write: an id that is no 16-digit hexadecimal key, or a store that is not one of this
configuration's, is never followed). Store groups go under the store's writer lease, a report
folder under its own; a lease held elsewhere leaves that result for the next run. A record is
deleted last, so a run killed while removing is finished by the next. Outputs of runs before
records were kept, of ``gpmil predict`` and of single stages are never removed."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import zarr

from tasks.lease import StoreLockedError, writer_lease

__all__ = ["RUNS", "RunRecord", "record_run", "read_records", "prune_runs"]

log = logging.getLogger("gpmil.retention")

RUNS = "runs"
"""The folder of ``output_dir`` holding one JSON record per completed ``gpmil run``."""

_KEY = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True)
class RunRecord:
    """One completed run: when it finished, and the keys and stores of what it used."""

    path: Path
    finished: str
    store: str
    model_key: str
    predicted_store: str
    prediction_key: str

    @property
    def result(self) -> tuple[str, str, str, str]:
        """What the run produced, whatever the time: two reruns of an unchanged cohort are one result."""
        return _resolved(self.store), self.model_key, _resolved(self.predicted_store), self.prediction_key


def record_run(output_dir: str | Path, latest: dict, model_key: str) -> Path:
    """Write the record of a completed run (the ``latest-run.json`` fields and its model key),
    whole or not at all, named so that names sort by the time it was written."""
    folder = Path(output_dir) / RUNS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{time.time_ns():020d}-{latest['prediction_key']}-{os.getpid()}.json"
    staged = folder / f".{path.name}.writing"
    staged.write_text(json.dumps({**latest, "model_key": model_key}, indent=1))
    staged.replace(path)
    return path


def read_records(output_dir: str | Path) -> list[RunRecord]:
    """The readable records of ``output_dir``, oldest first (by name); one that is not (cut short, edited,
    keys that are no content keys) is named in the log and left alone."""
    records = []
    for path in sorted((Path(output_dir) / RUNS).glob("*.json")):
        try:
            fields = json.loads(path.read_text())
            record = RunRecord(path, str(fields["finished"]), str(fields["store"]), str(fields["model_key"]),
                               str(fields["predicted_store"]), str(fields["prediction_key"]))
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning("run record %s is unreadable (%s): left alone", path, error)
            continue
        if not (_KEY.fullmatch(record.model_key) and _KEY.fullmatch(record.prediction_key)):
            log.warning("run record %s names keys that are no content keys (%r, %r): left alone", path,
                        record.model_key, record.prediction_key)
            continue
        records.append(record)
    return records


def prune_runs(output_dir: str | Path, stores: Iterable[str | Path], keep: int) -> list[str]:
    """Keep the newest ``keep`` distinct results of ``output_dir``'s records and remove what only
    older records use: their models, report folders and, in ``stores`` (the configuration's store
    and prediction store; a record naming another store has its groups there left alone), their
    training checkpoints and predictions. Returns what was removed."""
    if keep < 1:
        raise ValueError(f"keep_runs={keep}: keep at least the newest run")
    records = read_records(output_dir)
    newest: dict[tuple, RunRecord] = {}
    for record in records:
        newest[record.result] = record
    kept = sorted(newest.values(), key=lambda r: r.path.name)[-keep:]
    in_use = _uses(kept)
    ours = {_resolved(s) for s in stores}
    removed: list[str] = []
    for record in records:
        if record in kept:
            continue
        try:
            removed += _remove_unused(Path(output_dir), record, in_use, ours)
        except StoreLockedError as error:
            log.warning("the outputs of the run recorded in %s stay until a later run: %s", record.path.name, error)
            continue
        record.path.unlink(missing_ok=True)
    return removed


def _uses(records: Sequence[RunRecord]) -> dict[str, set]:
    return {"models": {r.model_key for r in records}, "reports": {r.prediction_key for r in records},
            "training": {(_resolved(r.store), r.model_key) for r in records},
            "predictions": {(_resolved(r.predicted_store), r.prediction_key) for r in records}}


def _remove_unused(output_dir: Path, record: RunRecord, in_use: dict[str, set], stores: set[str]) -> list[str]:
    removed = []
    for store, group, used in [(record.store, f"training/{record.model_key}", (_resolved(record.store), record.model_key) in in_use["training"]),
                               (record.predicted_store, f"predictions/{record.prediction_key}",
                                (_resolved(record.predicted_store), record.prediction_key) in in_use["predictions"])]:
        if not used and _resolved(store) in stores and _has_group(store, group):
            with writer_lease(store, f"gpmil keep_runs: removing {group}"):
                del zarr.open_group(store, mode="a")[group]
            removed.append(f"{store}/{group}")
    report = output_dir / "predictions" / record.prediction_key
    if record.prediction_key not in in_use["reports"] and report.is_dir():
        with writer_lease(report, f"gpmil keep_runs: removing {report}"):
            shutil.rmtree(report)
        removed.append(str(report))
    model = output_dir / "models" / record.model_key
    if record.model_key not in in_use["models"] and model.is_dir():
        shutil.rmtree(model)
        removed.append(str(model))
    return removed


def _has_group(store: str, group: str) -> bool:
    try:
        return group in zarr.open_group(store, mode="r")
    except FileNotFoundError:
        return False


def _resolved(path: str | Path) -> str:
    return str(Path(path).resolve())
