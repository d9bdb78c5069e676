"""The cohort ingest driver: parallel per bag, resumable, reporting what it skipped.

:func:`run_ingest` takes a list of :class:`IngestItem` (one per slide / scan / feature file) and a
*bag writer* ``bag_writer(item, staging_writer)`` that streams that item's instances, a batch at a
time, into :class:`tasks.store.StagingWriter`. Items run in parallel (a Dask ``client`` if given,
else ``max_workers`` processes, else inline); each writes only its own staging group, so workers
never share a Zarr chunk. The driver (:class:`IngestRun`, the only writer of the CSR arrays) appends
finished bags in item order, ``commit_every`` at a time, and marks them ``done`` last. The Prefect
ingest flow uses the same pieces: a plan task opens the :class:`IngestRun`, one Prefect task per
item runs :func:`stage_item` on the Dask cluster, and a finalise task records the outcomes.

Resumption: an item whose bag id is committed with the same source is skipped, unless its files
changed since (:mod:`tasks.ingest.stamps`: then it is reported, and the store keeps what it has);
from another path, it is skipped too when its files are the ones ingested (a cohort moved or
copied since), else reported as a duplicate id; a bag staged completely by an interrupted run from
the same files is committed without recomputing it; a half-staged bag is redone.
Bad input never stops the run: each failing item becomes a :class:`Skipped` entry (error type,
file, reason) in the returned :class:`IngestReport` and in the JSON report written next to the store.

The per-format entry points (plain functions of paths; the flows wrap them) build the items and the
bag writer and call :func:`run_ingest`: :func:`tasks.ingest.tables.ingest_table` (MIL CSV / Parquet /
``.npz``), :func:`tasks.ingest.h5.ingest_h5_features` (CLAM/TRIDENT), :func:`tasks.ingest.npy.ingest_bag_files`
(torchmil), :func:`tasks.ingest.wsi.ingest_slides` (WSI) and :func:`tasks.ingest.ct.ingest_ct` (DICOM).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any


from tasks.ingest.errors import DuplicateIdError, IngestError, LabelChangedError, NoTissueError, SourceChangedError
from tasks.ingest.stamps import file_change, file_stamp
from tasks.lease import ensure_still_held, writer_lease
from tasks.store import (
    UNKNOWN_LABEL,
    CohortSpec,
    NonFinitePolicy,
    StagingWriter,
    _open_root,
    append_bags,
    committed_bag_count,
    drop_staged,
    drop_staged_of_gone_inputs,
    label_unlabelled_bags,
    open_cohort,
    open_or_start_afresh,
    read_staged,
    repair,
    staged_dropped,
    staged_input_stamp,
    staged_status,
    stored_bag_count,
)

BagWriter = Callable[["IngestItem", StagingWriter], None]


@dataclass(frozen=True)
class IngestItem:
    """One bag to ingest: its id, source file, bag label (-1 unlabelled), reader-specific payload,
    the label as the labels file gave it (JSON text, :func:`tasks.store.encode_original_label`) and
    the files it is read from when they are not just ``source`` (a CT series' slices, a bag's
    ``.npy`` files)."""

    bag_id: str
    source: str
    label: int
    payload: Any = None
    original_label: str = ""
    inputs: tuple[str, ...] = ()

    def input_files(self) -> tuple[str, ...]:
        """The files whose :func:`~tasks.ingest.stamps.file_stamp` the store keeps for this bag."""
        return self.inputs or (self.source,)


@dataclass(frozen=True)
class Skipped:
    """An input left out, and why."""

    path: str | None
    bag_id: str | None
    error: str
    reason: str

    @classmethod
    def from_error(cls, error: BaseException, item: IngestItem | None = None) -> Skipped:
        path = getattr(error, "path", None) or (item.source if item else None)
        bag_id = getattr(error, "bag_id", None) or (item.bag_id if item else None)
        reason = getattr(error, "reason", None) or str(error)
        return cls(path=path, bag_id=bag_id, error=type(error).__name__, reason=reason)

    def line(self) -> str:
        """``<path> [bag <id>]: <error>: <reason>``; the bag only where the path does not name it
        (a row of a labels file, a series in a DICOM folder)."""
        bag = f" [bag {self.bag_id}]" if self.bag_id and self.bag_id != Path(self.path or "").stem else ""
        return f"{self.path}{bag}: {self.error}: {self.reason}"


UNSTAMPED = ("; the store has no input stamp for it (ingested before stamps existed), so the same file at another "
             "path cannot be recognised: ingest from the path it was first ingested from, or into a new store")


def same_source(stored: str, given: str) -> bool:
    """Whether two spellings name one input: equal, or the same file or folder once resolved
    (a relative path, a symlinked folder)."""
    return stored == given or os.path.realpath(stored) == os.path.realpath(given)


def summarise_left_out(found: str, skipped: Sequence[Skipped]) -> str:
    """``<found>, N left out; first left out: <its line>``: the tail of the message of an ingest
    that has nothing to ingest (no slide, no .h5 or .npy file, no bag)."""
    first = f"; first left out: {skipped[0].line()}" if skipped else ""
    return f"{found}, {len(skipped)} left out{first}"


LEFT_OUT_SHOWN = 20
"""Inputs left out that a log or the console names one line each; the rest are counted (the ingest
report's JSON and the ``skipped-inputs`` artifact list every one)."""


def left_out_lines(skipped: Sequence[Skipped], report_path: str | None) -> list[str]:
    """A line per input left out, the first :data:`LEFT_OUT_SHOWN` of them, then a count of the
    others pointing at the report that lists them all (a labels file of 10,000 slides beside a
    folder of one night's 100 printed 9,900 lines)."""
    lines = [f"skipped {s.line()}" for s in skipped[:LEFT_OUT_SHOWN]]
    if len(skipped) > LEFT_OUT_SHOWN:
        lines.append(f"… and {len(skipped) - LEFT_OUT_SHOWN} more left out: every one in {report_path or 'the ingest report'}")
    return lines


@dataclass(frozen=True)
class IngestReport:
    """What one ingest did (small: ids and skipped entries, no data)."""

    store: str
    added: tuple[str, ...]
    already_done: tuple[str, ...]
    skipped: tuple[Skipped, ...]
    n_instances_added: int
    seconds: float
    report_path: str | None = None
    dropped_nonfinite: dict[str, int] = field(default_factory=dict)  # bag id -> instances left out (NaN/inf)
    labelled: tuple[str, ...] = ()  # of already_done: bags ingested unlabelled that this run's labels labelled

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["skipped"] = [asdict(s) for s in self.skipped]
        return out


def default_report_path(store: str | Path) -> Path:
    """``<store>.ingest_report.json`` next to the store directory."""
    store = Path(store)
    return store.with_name(store.name + ".ingest_report.json")


def stage_item(store: str, item: IngestItem, bag_writer: BagWriter, nonfinite: NonFinitePolicy = "reject") -> int:
    """Run ``bag_writer`` for ``item`` into its own staging group; return its number of instances.

    On failure the half-written staging group is dropped and the error propagates (the Prefect
    per-slide task fails with it; :func:`run_ingest` turns it into a :class:`Skipped` entry).
    """
    try:
        writer = StagingWriter(store, item.bag_id, item.label, item.source, nonfinite=nonfinite,
                               original_label=item.original_label, input_stamp=file_stamp(item.input_files()))
        bag_writer(item, writer)
        if writer.n_instances == 0:
            raise NoTissueError("no instances were produced", path=item.source, bag_id=item.bag_id)
        return writer.finish()
    except Exception:
        drop_staged(_open_root(store, "r+"), [item.bag_id])
        raise


def _stage_one(store: str, item: IngestItem, bag_writer: BagWriter, nonfinite: NonFinitePolicy) -> tuple[int, Skipped | None]:
    """:func:`stage_item`, with a failure returned as (0, skipped) instead of raised."""
    try:
        return stage_item(store, item, bag_writer, nonfinite), None
    except Exception as error:  # any failure of one input is reported, the others go on
        return 0, Skipped.from_error(error, item)


def _run_items(store: str, items: Sequence[IngestItem], bag_writer: BagWriter, client: Any,
               max_workers: int, nonfinite: NonFinitePolicy) -> Iterator[tuple[int, int, Skipped | None]]:
    """Yield ``(item index, n_instances, skipped)`` as items finish (any order)."""
    if not items:
        return
    if client is not None:
        from distributed import as_completed as dask_as_completed

        futures = {client.submit(_stage_one, store, item, bag_writer, nonfinite, pure=False): i for i, item in enumerate(items)}
        for future in dask_as_completed(futures):
            yield futures[future], *future.result()
            future.release()
    elif max_workers > 1:
        context = multiprocessing.get_context("spawn")  # zarr's I/O thread must not be forked
        with ProcessPoolExecutor(max_workers, mp_context=context) as pool:
            futures = {pool.submit(_stage_one, store, item, bag_writer, nonfinite): i for i, item in enumerate(items)}
            for future in as_completed(futures):
                yield futures[future], *future.result()
    else:
        for i, item in enumerate(items):
            yield i, *_stage_one(store, item, bag_writer, nonfinite)


class IngestRun:
    """One ingest in progress; the single writer of the store's CSR arrays.

    Opening it creates the store from ``spec`` (or checks an existing store against it), repairs an
    interrupted append and sorts ``items`` into already committed (same bag id, and same source or
    the same files at another path), rejected (duplicate ids; a committed bag whose files changed
    since, or whose labels file now gives another label: the store keeps what it has, a changed
    cohort is a new store) and pending. ``to_run`` are the pending items still to stage: a bag
    staged completely by an interrupted run, from files that have not changed since, is committed
    without recomputing it. Staging (one item at a time, in parallel, each into its own staging
    group: :func:`stage_item`) happens elsewhere; :meth:`record` is told of each outcome and commits
    finished bags in item order, ``commit_every`` at a time; :meth:`finish` commits every completely staged bag not yet
    committed — also those staged by an earlier, interrupted run and those after an item that
    never reported — and writes the report. Whatever else a run does, what is completely staged
    is committed by its end. The caller holds the store's writer lease (:mod:`tasks.lease`).
    """

    def __init__(self, store: str | Path, spec: CohortSpec, items: Sequence[IngestItem], *,
                 skipped: Iterable[Skipped] = (), commit_every: int = 16):
        self.started = time.perf_counter()
        self.store = str(store)
        self.commit_every = commit_every
        self.root, self.created = open_or_start_afresh(self.store, spec)  # created: removed again if nothing is committed
        repair(self.root)
        n_committed = committed_bag_count(self.root)
        bags = self.root["bags"]
        stored_ids = bags["id"][:n_committed].tolist()
        committed = dict(zip(stored_ids, bags["source"][:n_committed].tolist()))
        stored_label = dict(zip(stored_ids, zip(bags["label"][:n_committed].tolist(),
                                                bags["original_label"][:n_committed].tolist())))
        stored_stamp = dict(zip(stored_ids, bags["input_stamp"][:n_committed].tolist()))
        self.skipped = list(skipped)
        self.already_done: list[str] = []
        self.labelled: dict[str, tuple[int, str]] = {}  # committed unlabelled bags the labels now label
        self.pending: list[IngestItem] = []
        first_source: dict[str, str] = {}
        for item in items:
            if item.bag_id in first_source:
                self.skipped.append(Skipped.from_error(DuplicateIdError(
                    f"bag id also given by {first_source[item.bag_id]}", path=item.source, bag_id=item.bag_id)))
            elif item.bag_id in committed:
                label, original = stored_label[item.bag_id]
                change = file_change(item.input_files(), stored_stamp[item.bag_id])
                if not same_source(committed[item.bag_id], item.source) and (change or not stored_stamp[item.bag_id]):
                    self.skipped.append(Skipped.from_error(DuplicateIdError(
                        f"bag id already in the store from {committed[item.bag_id]}{'' if change else UNSTAMPED}",
                        path=item.source, bag_id=item.bag_id)))
                elif change:
                    self.skipped.append(Skipped.from_error(SourceChangedError(
                        f"bag already in the store, and its input changed since it was ingested ({change}). The store "
                        "keeps the features it has: ingest into a new store to use the new input",
                        path=item.source, bag_id=item.bag_id)))
                elif item.label != UNKNOWN_LABEL and label == UNKNOWN_LABEL:  # labels that arrived after the ingest
                    self.labelled[item.bag_id] = (item.label, item.original_label)
                    self.already_done.append(item.bag_id)
                elif item.label != UNKNOWN_LABEL and (label, original) != (item.label, item.original_label):
                    self.skipped.append(Skipped.from_error(LabelChangedError(
                        f"bag already in the store with label {label} (original {original or 'none'}); the labels "
                        f"file now gives {item.label} (original {item.original_label or 'none'}). The store keeps "
                        "its label: ingest into a new store to relabel", path=item.source, bag_id=item.bag_id)))
                else:  # the same input, also when moved or copied since (same stamp, another path)
                    self.already_done.append(item.bag_id)
            else:
                self.pending.append(item)
            first_source.setdefault(item.bag_id, item.source)
        self._index = {item.bag_id: i for i, item in enumerate(self.pending)}
        self._finished: dict[int, bool] = {i: True for i, item in enumerate(self.pending)  # pending index -> staged?
                                           if staged_status(self.root, item.bag_id, source=item.source, label=item.label,
                                                            original_label=item.original_label) == "complete"
                                           and not file_change(item.input_files(), staged_input_stamp(self.root, item.bag_id))}
        self.to_run = [item for i, item in enumerate(self.pending) if i not in self._finished]
        self.added: list[str] = []
        self.dropped_nonfinite: dict[str, int] = {}
        self.n_rows = 0
        self._batch: list[str] = []
        self._next = 0

    def record(self, bag_id: str, failure: Skipped | None) -> None:
        """Note that the item ``bag_id`` of ``to_run`` was staged (``failure`` None) or failed, and
        commit the bags that are now next in item order."""
        self._finished[self._index[bag_id]] = failure is None
        if failure is not None:
            self.skipped.append(failure)
        while self._next in self._finished:
            if self._finished[self._next]:
                self._batch.append(self.pending[self._next].bag_id)
            self._next += 1
            if len(self._batch) >= self.commit_every:
                self._commit()

    def _commit(self) -> None:
        if self._batch:
            ensure_still_held(self.store)
            bags = [read_staged(self.root, bag_id) for bag_id in self._batch]
            dropped = {bag_id: n for bag_id in self._batch if (n := staged_dropped(self.root, bag_id))}
            append_bags(self.root, bags)
            drop_staged(self.root, self._batch)
            self.added.extend(self._batch)
            self.dropped_nonfinite |= dropped
            self.n_rows += sum(bag.n_instances for bag in bags)
            self._batch.clear()

    def finish(self, report_path: str | Path | None = None) -> IngestReport:
        """Commit the remaining staged bags and write the JSON report; items never recorded stay
        unstaged (a rerun stages them)."""
        self._batch += [self.pending[i].bag_id for i in sorted(self._finished) if i >= self._next and self._finished[i]]
        self._next = len(self.pending)
        self._commit()
        ensure_still_held(self.store)
        label_unlabelled_bags(self.root, self.labelled)
        drop_staged(self.root, self.already_done)  # left by a run killed between its commit and this clean-up
        drop_staged_of_gone_inputs(self.root, keep=(item.bag_id for item in self.pending))
        report = IngestReport(store=self.store, added=tuple(self.added), already_done=tuple(self.already_done),
                              labelled=tuple(self.labelled), skipped=tuple(self.skipped), n_instances_added=self.n_rows,
                              seconds=time.perf_counter() - self.started,
                              report_path=str(report_path or default_report_path(self.store)),
                              dropped_nonfinite=dict(self.dropped_nonfinite))
        from mil_core.persist import write_whole  # here: ingest processes do not import mil_core

        write_whole(report.report_path, json.dumps(report.to_json(), indent=1).encode())  # beside a shared store
        if self.created and not committed_bag_count(self.root):
            # a store this run created and filled with nothing would fix its settings (tiling, extractor, feature
            # dimension) for the next run, which a corrected config could then not use
            shutil.rmtree(Path(self.store).resolve())  # through a link: the folder it names
            return report
        self.root.attrs["last_ingest"] = {"added": len(self.added), "already_done": len(self.already_done),
                                          "skipped": len(self.skipped), "report": report.report_path,
                                          "instances_dropped_nonfinite": sum(self.dropped_nonfinite.values()),
                                          "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        return report


def run_ingest(store: str | Path, spec: CohortSpec, items: Sequence[IngestItem], bag_writer: BagWriter, *,
               skipped: Iterable[Skipped] = (), client: Any = None, max_workers: int = 1,
               commit_every: int = 16, report_path: str | Path | None = None, nonfinite: NonFinitePolicy = "reject",
               on_progress: Callable[[int, int, str, Skipped | None], None] | None = None) -> IngestReport:
    """Ingest ``items`` into the store at ``store`` (created from ``spec`` if absent).

    ``skipped`` are inputs the caller already rejected (unreadable, unlabelled): they go into the
    report. Raises only for a store that does not match ``spec`` (whole-run problems).
    ``on_progress(done, total, bag_id, failure)`` is called as each item finishes. ``nonfinite``:
    an item with NaN/inf features is skipped (``"reject"``) or loses those instances, counted in
    the report (``"drop"``). Holds the store's writer lease: a concurrent writer fails at once
    (:class:`tasks.lease.StoreLockedError`).
    """
    with writer_lease(store, f"ingest of {len(items)} items"):
        run = IngestRun(store, spec, items, skipped=skipped, commit_every=commit_every)
        for done, (i, _, failure) in enumerate(_run_items(run.store, run.to_run, bag_writer, client, max_workers, nonfinite),
                                               start=1):
            item = run.to_run[i]
            if on_progress is not None:
                on_progress(done, len(run.to_run), item.bag_id, failure)
            run.record(item.bag_id, failure)
        return run.finish(report_path)



@dataclass(frozen=True)
class IngestPlan:
    """Everything :func:`run_ingest` needs: the store spec, the items, the rejected inputs, the worker."""

    spec: CohortSpec
    items: list[IngestItem]
    skipped: list[Skipped]
    bag_writer: BagWriter



def existing_n_features(store: str | Path) -> int | None:
    """The feature dimension of the store at ``store``, or None if there is no store yet."""
    attrs = existing_attrs(store)
    return None if attrs is None else int(attrs["n_features"])


def ingested_from_elsewhere(store: str | Path, folder: str | Path) -> list[str]:
    """Ids of the bags of the store at ``store`` (none if there is no store yet) whose input lay
    outside ``folder``: a store fed one folder a night holds them, and a labels file that lists the
    whole cohort names them without their file being missing from ``folder``."""
    if not (Path(store) / "zarr.json").exists():
        return []
    cohort = open_cohort(store)
    inside = Path(folder).resolve()
    return [bag_id for bag_id, source in zip(cohort.bag_ids, cohort.sources) if not Path(source).resolve().is_relative_to(inside)]


def existing_attrs(store: str | Path) -> dict[str, Any] | None:
    """The cohort attributes of the store at ``store``, or None if there is no store yet (or none
    with a bag: :func:`~tasks.store.stored_bag_count`)."""
    return dict(_open_root(store, "r").attrs) if stored_bag_count(store) else None


def recorded_extractor(store: str | Path, extractor_from: str | Path | None) -> tuple[dict[str, Any] | None, str]:
    """The extractor spec recorded in ``store`` if it holds a bag, else in ``extractor_from`` if
    given (a new cohort featurised as its training store), and the store it was read from."""
    if stored_bag_count(store):
        return _open_root(store, "r").attrs["feature_extractor"], str(store)
    if extractor_from is None:
        return None, ""
    if not (Path(extractor_from) / "zarr.json").exists():
        raise IngestError("no cohort store to take the feature extractor from", path=str(extractor_from))
    return _open_root(extractor_from, "r").attrs["feature_extractor"], str(extractor_from)

