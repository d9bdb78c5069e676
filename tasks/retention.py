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
others can write: an id that is no 16-digit hexadecimal key, a path that does not resolve, or a
store that is not one of this configuration's, is never followed). The leases of the report
folders that may go (none another configuration's record or a kept result names: those stay, and
their own runs write them meanwhile) are all taken first: a result whose report another process
writes stays whole, and so does everything it shares with other older results. A result whose model a process is reading (its reader lease,
:func:`tasks.lease.reader_lease`) stays whole. Store groups go under the store's writer lease. Any error
removing (a permission, a damaged store) leaves that result, logged, with its record, for the next
run; a record is deleted last, so a run killed while removing is finished by the next. The run that
prunes is always kept, and only records of its own configuration (by name) are removed: what
another configuration's records in the same ``output_dir`` use stays. Outputs of runs
before records were kept, of ``gpmil predict`` and of single stages are not recorded (removed only
where they are one of a removed run's results: the same model, cohort and settings). The records
also name the model ``latest`` stands for (:func:`newest_model_dir`)."""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from collections.abc import Collection, Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

from tasks.lease import ensure_still_held, live_readers, writer_lease

__all__ = ["RUNS", "LATEST_RUN", "LATEST_MODEL", "RunRecord", "record_run", "read_records", "newest_model_dir", "prune_runs"]

log = logging.getLogger("gpmil.retention")

RUNS = "runs"
"""The folder of ``output_dir`` holding one JSON record per completed ``gpmil run``."""

LATEST_RUN = "latest-run.json"
"""Written into ``output_dir`` by each completed pipeline run: which model and report are the newest
(their folders are named by content keys, and an older one's files can be newer)."""

LATEST_MODEL = "latest"
"""``MODEL_DIR``'s word for the model of the newest completed ``gpmil run`` of the configuration
(:func:`newest_model_dir`): a served prediction follows the nightly retraining, and ``keep_runs``
never removes that model."""

_KEY = re.compile(r"[0-9a-f]{16}")
_ASIDE = ".removing-"  # a model folder being removed: models/.removing-<key>


@dataclass(frozen=True)
class RunRecord:
    """One completed run: its configuration's name, and the keys and resolved stores of what it used."""

    path: Path
    config: str
    store: str
    model_key: str
    predicted_store: str
    prediction_key: str

    @property
    def result(self) -> tuple[str, str, str, str, str]:
        """What the run produced, whatever the time: two reruns of an unchanged cohort are one result."""
        return self.config, self.store, self.model_key, self.predicted_store, self.prediction_key


def record_run(output_dir: str | Path, latest: dict, model_key: str) -> Path:
    """Write ``latest-run.json`` (``latest``) and the run's record in ``runs/`` (those fields, its
    model key, its stores resolved: a symbolic link moved later does not move the record), each
    whole or not at all; the record's name sorts by the time it was written. Returns its path."""
    from mil_core.persist import write_whole  # here: the CLI reads this module before it imports mil_core

    folder = Path(output_dir) / RUNS
    folder.mkdir(parents=True, exist_ok=True)
    write_whole(Path(output_dir) / LATEST_RUN, json.dumps(latest, indent=1).encode())
    path = folder / f"{time.time_ns():020d}-{latest['prediction_key']}-{os.getpid()}.json"
    write_whole(path, json.dumps({**latest, "store": _resolved(latest["store"]), "predicted_store": _resolved(latest["predicted_store"]),
                                  "model_key": model_key}, indent=1).encode())
    return path


def read_records(output_dir: str | Path, *, skip: Collection[Path] = ()) -> list[RunRecord]:
    """The readable records of ``output_dir`` but those at ``skip``, oldest first (by name), stores
    resolved; one that is not (cut short, edited, keys that are no content keys, a path that does
    not resolve) is named in the log and left alone."""
    records = []
    for path in sorted(set((Path(output_dir) / RUNS).glob("*.json")) - set(skip)):
        try:
            fields = json.loads(path.read_text())
            record = RunRecord(path, str(fields["config"]), _resolved(str(fields["store"])), str(fields["model_key"]),
                               _resolved(str(fields["predicted_store"])), str(fields["prediction_key"]))
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:  # RuntimeError: a symbolic link loop
            log.warning("run record %s is unreadable (%s): left alone", path, error)
            continue
        if not (_KEY.fullmatch(record.model_key) and _KEY.fullmatch(record.prediction_key)):
            log.warning("run record %s names keys that are no content keys (%r, %r): left alone", path,
                        record.model_key, record.prediction_key)
            continue
        records.append(record)
    return records


def newest_model_dir(output_dir: str | Path, config: str) -> Path | None:
    """The model folder of the newest record of configuration ``config`` in ``output_dir`` (built
    from its key), or None when no run of it is recorded."""
    own = [r for r in read_records(output_dir) if r.config == config]
    return Path(output_dir) / "models" / own[-1].model_key if own else None


def prune_runs(output_dir: str | Path, config: str, stores: Iterable[str | Path], keep: int, current: Path) -> list[str]:
    """Keep the newest ``keep`` distinct results of configuration ``config``'s records in
    ``output_dir``, and the run recorded at ``current`` whatever the clocks say; remove what only
    its older records use: their models, report folders and, in ``stores`` (the configuration's
    store and prediction store; groups in another store stay, and the record with them), their
    training checkpoints and predictions. What any other configuration's record uses stays, and
    so does everything of a result whose report folder (one that may go) another process holds. Returns what was
    removed."""
    if keep < 1:
        raise ValueError(f"keep_runs={keep}: keep at least the newest run")
    output_dir = Path(output_dir)
    known = set((output_dir / RUNS).glob("*.json"))
    records = read_records(output_dir)
    own = [r for r in records if r.config == config]
    newest = {r.result: r for r in own}
    kept = sorted(newest.values(), key=lambda r: r.path.name)[-keep:]
    kept_results = {r.result for r in kept} | {r.result for r in own if r.path == current}
    older = [r for r in own if not (r.result in kept_results and r is newest[r.result])]
    ours = {_resolved(s): str(s) for s in stores}
    removed: list[str] = []
    others = [r for r in records if r.config != config or r.result in kept_results]
    shared = _uses(others)["reports"]  # report folders that stay: not leased, so that their own runs write them meanwhile
    with ExitStack() as leases:
        held = [r for r in older if r.prediction_key not in shared
                and not _report_lease(leases, output_dir / "predictions" / r.prediction_key)]
        in_use = _uses(others + held)
        for record in older:
            if record in held:
                continue
            try:
                if _remove_unused(output_dir, record, in_use, ours, removed, known):
                    record.path.unlink(missing_ok=True)
            except Exception as error:  # a permission, a damaged store: the next run tries again
                log.warning("the outputs of the run recorded in %s stay (for a later run to remove): %s: %s", record.path.name,
                            type(error).__name__, error)
    return removed


def _report_lease(leases: ExitStack, report: Path) -> bool:
    """Hold ``report``'s writer lease for the pruning (if the folder is there); False if another
    process holds it (logged: that result stays whole, for a later run)."""
    if report.is_symlink() or not report.is_dir():  # a link is left alone (logged when its record is handled)
        return True
    try:
        leases.enter_context(writer_lease(report, f"gpmil keep_runs: removing {report}"))
    except Exception as error:  # StoreLockedError, or an unreadable lease
        log.warning("%s and what its result shares stay (for a later run to remove): %s: %s", report, type(error).__name__, error)
        return False
    return True


def _uses(records: Sequence[RunRecord]) -> dict[str, set]:
    return {"models": {r.model_key for r in records}, "reports": {r.prediction_key for r in records},
            "training": {(r.store, r.model_key) for r in records},
            "predictions": {(r.predicted_store, r.prediction_key) for r in records}}


def _remove_unused(output_dir: Path, record: RunRecord, in_use: dict[str, set], ours: dict[str, str], removed: list[str],
                   known: set[Path]) -> bool:
    """Remove ``record``'s outputs that ``in_use`` does not hold (its report folder's lease is held
    by the caller), each added to ``removed`` as it goes. Nothing goes while a process reads the
    record's model (:func:`~tasks.lease.reader_lease`: a run started by hand with its settings
    writes its predictions and report), nor what a record written since the pruning began (not
    in ``known``; read after that look, so a run that let go of the model has written it) uses.
    A model that goes is held under its writer lease from that look until it is gone, so a reader
    that comes meanwhile waits and finds it gone. Whether everything of the record is handled (no
    group left in a store that is not this configuration's)."""
    model = output_dir / "models" / record.model_key
    may_go = record.model_key not in in_use["models"] and not model.is_symlink() and (model.is_dir() or _aside(model).is_dir())
    with ExitStack() as removing:
        if may_go:
            removing.enter_context(writer_lease(model, f"gpmil keep_runs: removing {model}"))
        if model.is_dir() and not model.is_symlink() and (readers := live_readers(model)):
            log.warning("the outputs of the run recorded in %s stay (for a later run to remove): its model %s is read by %s",
                        record.path.name, model, "; ".join(readers))
            return False
        newer = _uses(read_records(output_dir, skip=known))
        in_use = {kind: uses | newer[kind] for kind, uses in in_use.items()}
        if may_go and record.model_key not in in_use["models"]:
            if _aside(model).is_dir():
                shutil.rmtree(_aside(model))  # left by a kill: its removal was decided
            if model.is_dir():
                ensure_still_held(model)  # a remover frozen past the lease's ttl stops here
                os.rename(model, _aside(model))  # the model path goes at once; what rmtree leaves on a kill is aside
                shutil.rmtree(_aside(model))
            removed.append(str(model))
    if record.model_key not in in_use["models"] and model.is_symlink():
        _is_folder(model)  # a link is logged and left alone
    return _remove_groups_and_report(output_dir, record, in_use, ours, removed)


def _remove_groups_and_report(output_dir: Path, record: RunRecord, in_use: dict[str, set], ours: dict[str, str],
                              removed: list[str]) -> bool:
    """The record's store groups (under each store's writer lease) and report folder that
    ``in_use`` does not hold; whether no group was left in a store that is not this configuration's."""
    whole = True
    for store, key, kind, unused in [(record.store, record.model_key, "training", (record.store, record.model_key) not in in_use["training"]),
                                     (record.predicted_store, record.prediction_key, "predictions",
                                      (record.predicted_store, record.prediction_key) not in in_use["predictions"])]:
        if not unused:
            continue
        if store not in ours:
            whole = False  # another store: not this configuration's to change
            continue
        configured = ours[store]  # the configuration's own path, not the record's string
        folders = _group_folders(Path(configured) / kind, key)
        if folders:
            with writer_lease(configured, f"gpmil keep_runs: removing {kind}/{key}"):
                for folder in folders:
                    shutil.rmtree(folder)
                    removed.append(f"{configured}/{kind}/{folder.name}")
    report = output_dir / "predictions" / record.prediction_key
    if record.prediction_key not in in_use["reports"] and _is_folder(report):
        shutil.rmtree(report)
        removed.append(str(report))
    return whole


def _aside(model: Path) -> Path:
    return model.with_name(f"{_ASIDE}{model.name}")


def _group_folders(parent: Path, key: str) -> list[Path]:
    """The folders of ``key``'s groups under a store's ``training`` or ``predictions``: the key's
    own and, for EmbeddedGPMIL's checkpoints, ``<key>-member<k>`` and ``<key>-features<k>``. Read
    from the file system, so that a group a kill left without its ``zarr.json`` is found too."""
    pattern = re.compile(rf"{key}(-(member|features)\d+)?")
    return sorted(p for p in parent.iterdir() if p.is_dir() and not p.is_symlink() and pattern.fullmatch(p.name)) if parent.is_dir() else []


def _is_folder(path: Path) -> bool:
    """A folder of its own; a symbolic link in its place (made by hand) is left alone, logged."""
    if path.is_symlink():
        log.warning("%s is a symbolic link, not a folder gpmil wrote: left alone", path)
        return False
    return path.is_dir()


def _resolved(path: str | Path) -> str:
    return str(Path(path).resolve())
