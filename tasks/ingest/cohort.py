"""The cohort ingest driver: parallel per bag, resumable, reporting what it skipped.

:func:`run_ingest` takes a list of :class:`IngestItem` (one per slide / scan / feature file) and a
*bag writer* ``bag_writer(item, staging_writer)`` that streams that item's instances, a batch at a
time, into :class:`tasks.store.StagingWriter`. Items run in parallel (a Dask ``client`` if given,
else ``max_workers`` processes, else inline); each writes only its own staging group, so workers
never share a Zarr chunk. The driver (:class:`IngestRun`, the only writer of the CSR arrays) appends
finished bags in item order, ``commit_every`` at a time, and marks them ``done`` last. The Prefect
ingest flow uses the same pieces: a plan task opens the :class:`IngestRun`, one Prefect task per
item runs :func:`stage_item` on the Dask cluster, and a finalise task records the outcomes.

Resumption: an item whose bag id is committed with the same source is skipped; a bag staged
completely by an interrupted run is committed without recomputing it; a half-staged bag is redone.
Bad input never stops the run: each failing item becomes a :class:`Skipped` entry (error type,
file, reason) in the returned :class:`IngestReport` and in the JSON report written next to the store.

The ``ingest_*`` functions are the entry points (plain functions of paths; the flows wrap them):
:func:`ingest_table` (MIL CSV / Parquet / ``.npz``), :func:`ingest_h5_features` (CLAM/TRIDENT),
:func:`ingest_bag_files` (torchmil), :func:`ingest_slides` (WSI) and :func:`ingest_ct` (DICOM).
"""

from __future__ import annotations

import functools
import json
import multiprocessing
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.ingest.errors import DuplicateIdError, IngestError, MissingLabelError, NoTissueError
from tasks.store import (
    UNKNOWN_LABEL,
    BagData,
    CohortSpec,
    StagingWriter,
    _open_root,
    append_bags,
    committed_bag_count,
    drop_staged,
    open_or_create_cohort,
    read_staged,
    repair,
    staged_status,
)

BagWriter = Callable[["IngestItem", StagingWriter], None]


@dataclass(frozen=True)
class IngestItem:
    """One bag to ingest: its id, source file, bag label (-1 unlabelled) and reader-specific payload."""

    bag_id: str
    source: str
    label: int
    payload: Any = None


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

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["skipped"] = [asdict(s) for s in self.skipped]
        return out


def default_report_path(store: str | Path) -> Path:
    """``<store>.ingest_report.json`` next to the store directory."""
    store = Path(store)
    return store.with_name(store.name + ".ingest_report.json")


def stage_item(store: str, item: IngestItem, bag_writer: BagWriter) -> int:
    """Run ``bag_writer`` for ``item`` into its own staging group; return its number of instances.

    On failure the half-written staging group is dropped and the error propagates (the Prefect
    per-slide task fails with it; :func:`run_ingest` turns it into a :class:`Skipped` entry).
    """
    try:
        writer = StagingWriter(store, item.bag_id, item.label, item.source)
        bag_writer(item, writer)
        if writer.n_instances == 0:
            raise NoTissueError("no instances were produced", path=item.source, bag_id=item.bag_id)
        return writer.finish()
    except Exception:
        drop_staged(_open_root(store, "r+"), [item.bag_id])
        raise


def _stage_one(store: str, item: IngestItem, bag_writer: BagWriter) -> tuple[int, Skipped | None]:
    """:func:`stage_item`, with a failure returned as (0, skipped) instead of raised."""
    try:
        return stage_item(store, item, bag_writer), None
    except Exception as error:  # any failure of one input is reported, the others go on
        return 0, Skipped.from_error(error, item)


def _run_items(store: str, items: Sequence[IngestItem], bag_writer: BagWriter, client: Any,
               max_workers: int) -> Iterator[tuple[int, int, Skipped | None]]:
    """Yield ``(item index, n_instances, skipped)`` as items finish (any order)."""
    if not items:
        return
    if client is not None:
        from distributed import as_completed as dask_as_completed

        futures = {client.submit(_stage_one, store, item, bag_writer, pure=False): i for i, item in enumerate(items)}
        for future in dask_as_completed(futures):
            yield futures[future], *future.result()
            future.release()
    elif max_workers > 1:
        context = multiprocessing.get_context("spawn")  # zarr's I/O thread must not be forked
        with ProcessPoolExecutor(max_workers, mp_context=context) as pool:
            futures = {pool.submit(_stage_one, store, item, bag_writer): i for i, item in enumerate(items)}
            for future in as_completed(futures):
                yield futures[future], *future.result()
    else:
        for i, item in enumerate(items):
            yield i, *_stage_one(store, item, bag_writer)


class IngestRun:
    """One ingest in progress; the single writer of the store's CSR arrays.

    Opening it creates the store from ``spec`` (or checks an existing store against it), repairs an
    interrupted append and sorts ``items`` into already committed (same bag id and source), rejected
    (duplicate ids) and pending. ``to_run`` are the pending items still to stage: a bag staged
    completely by an interrupted run is committed without recomputing it. Staging (one item at a
    time, in parallel, each into its own staging group: :func:`stage_item`) happens elsewhere;
    :meth:`record` is told of each outcome and commits finished bags in item order,
    ``commit_every`` at a time; :meth:`finish` commits the rest and writes the report.
    """

    def __init__(self, store: str | Path, spec: CohortSpec, items: Sequence[IngestItem], *,
                 skipped: Iterable[Skipped] = (), commit_every: int = 16):
        self.started = time.perf_counter()
        self.store = str(store)
        self.commit_every = commit_every
        self.root = open_or_create_cohort(self.store, spec)
        repair(self.root)
        n_committed = committed_bag_count(self.root)
        committed = dict(zip(self.root["bags/id"][:n_committed].tolist(), self.root["bags/source"][:n_committed].tolist()))
        self.skipped = list(skipped)
        self.already_done: list[str] = []
        self.pending: list[IngestItem] = []
        first_source: dict[str, str] = {}
        for item in items:
            if item.bag_id in first_source:
                self.skipped.append(Skipped.from_error(DuplicateIdError(
                    f"bag id also given by {first_source[item.bag_id]}", path=item.source, bag_id=item.bag_id)))
            elif item.bag_id in committed and committed[item.bag_id] == item.source:
                self.already_done.append(item.bag_id)
            elif item.bag_id in committed:
                self.skipped.append(Skipped.from_error(DuplicateIdError(
                    f"bag id already in the store from {committed[item.bag_id]}", path=item.source, bag_id=item.bag_id)))
            else:
                self.pending.append(item)
            first_source.setdefault(item.bag_id, item.source)
        self._index = {item.bag_id: i for i, item in enumerate(self.pending)}
        self._finished: dict[int, bool] = {i: True for i, item in enumerate(self.pending)  # pending index -> staged?
                                           if staged_status(self.root, item.bag_id) == "complete"}
        self.to_run = [item for i, item in enumerate(self.pending) if i not in self._finished]
        self.added: list[str] = []
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
            bags = [read_staged(self.root, bag_id) for bag_id in self._batch]
            append_bags(self.root, bags)
            drop_staged(self.root, self._batch)
            self.added.extend(self._batch)
            self.n_rows += sum(bag.n_instances for bag in bags)
            self._batch.clear()

    def finish(self, report_path: str | Path | None = None) -> IngestReport:
        """Commit the remaining staged bags and write the JSON report; items never recorded stay
        uncommitted (a rerun stages or commits them)."""
        self._commit()
        report = IngestReport(store=self.store, added=tuple(self.added), already_done=tuple(self.already_done),
                              skipped=tuple(self.skipped), n_instances_added=self.n_rows,
                              seconds=time.perf_counter() - self.started,
                              report_path=str(report_path or default_report_path(self.store)))
        Path(report.report_path).write_text(json.dumps(report.to_json(), indent=1))
        self.root.attrs["last_ingest"] = {"added": len(self.added), "already_done": len(self.already_done),
                                          "skipped": len(self.skipped), "report": report.report_path,
                                          "finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        return report


def run_ingest(store: str | Path, spec: CohortSpec, items: Sequence[IngestItem], bag_writer: BagWriter, *,
               skipped: Iterable[Skipped] = (), client: Any = None, max_workers: int = 1,
               commit_every: int = 16, report_path: str | Path | None = None,
               on_progress: Callable[[int, int, str, Skipped | None], None] | None = None) -> IngestReport:
    """Ingest ``items`` into the store at ``store`` (created from ``spec`` if absent).

    ``skipped`` are inputs the caller already rejected (unreadable, unlabelled): they go into the
    report. Raises only for a store that does not match ``spec`` (whole-run problems).
    ``on_progress(done, total, bag_id, failure)`` is called as each item finishes.
    """
    run = IngestRun(store, spec, items, skipped=skipped, commit_every=commit_every)
    for done, (i, _, failure) in enumerate(_run_items(run.store, run.to_run, bag_writer, client, max_workers), start=1):
        item = run.to_run[i]
        if on_progress is not None:
            on_progress(done, len(run.to_run), item.bag_id, failure)
        run.record(item.bag_id, failure)
    return run.finish(report_path)


# --------------------------------------------------------------------------------- labels
def _label_lookup(table, id_column: str, label_of: Callable[[Any], int], path: str) -> dict[str, int | Exception]:
    if id_column not in table.columns:
        raise IngestError(f"labels CSV has no column {id_column!r} (columns: {list(table.columns)})", path=path)
    labels: dict[str, int | Exception] = {}
    for bag_id, value in zip(table[id_column].astype(str), table.drop(columns=[id_column]).to_dict("records")):
        if bag_id in labels:
            labels[bag_id] = DuplicateIdError("bag id appears twice in the labels CSV", path=path, bag_id=bag_id)
            continue
        try:
            labels[bag_id] = label_of(value)
        except (KeyError, ValueError, TypeError) as error:
            labels[bag_id] = MissingLabelError(f"unusable label {value}: {error}", path=path, bag_id=bag_id)
    return labels


def _labelled_items(candidates: Iterable[tuple[str, str, Any]], labels: dict[str, int | Exception] | None,
                    labels_path: str | None) -> tuple[list[IngestItem], list[Skipped]]:
    """Attach bag labels (-1 without a labels table); unlabelled or badly labelled bags are skipped."""
    items, skipped = [], []
    for bag_id, source, payload in candidates:
        if labels is None:
            items.append(IngestItem(bag_id, source, UNKNOWN_LABEL, payload))
            continue
        label = labels.get(bag_id)
        if label is None:
            label = MissingLabelError(f"no label in {labels_path}", path=source, bag_id=bag_id)
        if isinstance(label, Exception):
            skipped.append(Skipped.from_error(label, IngestItem(bag_id, source, UNKNOWN_LABEL)))
        else:
            items.append(IngestItem(bag_id, source, int(label), payload))
    return items, skipped


def _binary(value: Any) -> int:
    number = float(value)
    if number not in (0.0, 1.0):
        raise ValueError("label must be 0 or 1")
    return int(number)


# -------------------------------------------------------------------------------- tables
def ingest_table(store: str | Path, table, *, name: str | None = None, chunk_rows: int | None = None,
                 report_path: str | Path | None = None) -> IngestReport:
    """Append a :class:`tasks.ingest.tables.FeatureTable` to a store, bag by bag.

    Bags keep the order of their first row. A bag whose rows disagree on the bag label, or whose
    label is not 0/1/-1, is skipped (:class:`MissingLabelError`); bags already in the store from the
    same file are skipped as done, from another file as duplicates. A feature dimension that differs
    from an existing store's raises (it concerns the whole file).
    """
    import pandas as pd

    started = time.perf_counter()
    X, n = table.X, table.X.shape[0]
    coords = None if table.coords is None else np.asarray(table.coords).reshape(n, -1)
    spec = CohortSpec(name=name or Path(str(store)).stem, n_features=int(X.shape[1]),
                      coords_dim=1 if coords is None else coords.shape[1],
                      coords_meaning="instance_index" if coords is None else "given", chunk_rows=chunk_rows)
    try:
        root = open_or_create_cohort(store, spec)
    except IngestError as error:
        raise type(error)(f"{error.reason}; store {store}", path=table.source) from error
    repair(root)
    n_committed = committed_bag_count(root)
    committed = dict(zip(root["bags/id"][:n_committed].tolist(), root["bags/source"][:n_committed].tolist()))
    codes, ids = pd.factorize(np.asarray(table.bag_ids), sort=False)
    order = np.argsort(codes, kind="stable")
    offsets = np.concatenate([[0], np.cumsum(np.bincount(codes, minlength=len(ids)))])
    skipped, done, added, rows_added = [], [], [], 0

    def bags() -> Iterator[BagData]:
        nonlocal rows_added
        for b, bag_id in enumerate(map(str, ids)):
            rows = order[offsets[b]:offsets[b + 1]]
            rows = slice(rows[0], rows[-1] + 1) if rows[-1] - rows[0] == len(rows) - 1 else rows
            if bag_id in committed:
                if committed[bag_id] == table.source:
                    done.append(bag_id)
                else:
                    skipped.append(Skipped.from_error(DuplicateIdError(
                        f"bag id already in the store from {committed[bag_id]}", path=table.source, bag_id=bag_id)))
                continue
            labels = np.unique(np.asarray(table.labels[rows]))
            if len(labels) != 1 or labels[0] not in (UNKNOWN_LABEL, 0, 1):
                skipped.append(Skipped.from_error(MissingLabelError(
                    f"bag label must be one of 0, 1, -1 and equal on all rows; got {labels.tolist()}",
                    path=table.source, bag_id=bag_id)))
                continue
            features = np.asarray(X[rows])
            added.append(bag_id)
            rows_added += len(features)
            yield BagData(bag_id=bag_id, label=int(labels[0]), source=table.source, features=features,
                          coords=np.arange(len(features))[:, None] if coords is None else coords[rows],
                          instance_labels=np.full(len(features), UNKNOWN_LABEL) if table.instance_labels is None
                          else np.asarray(table.instance_labels[rows]))

    append_bags(root, bags())
    report = IngestReport(store=str(store), added=tuple(added), already_done=tuple(done), skipped=tuple(skipped),
                          n_instances_added=rows_added, seconds=time.perf_counter() - started,
                          report_path=str(report_path or default_report_path(store)))
    Path(report.report_path).write_text(json.dumps(report.to_json(), indent=1))
    return report


def ingest_h5_features(store: str | Path, files: str | Path | Sequence[str | Path], labels_csv: str | Path | None,
                       *, id_column: str = "slide_id", label_column: str = "label",
                       positive: Sequence[Any] | None = None, name: str | None = None, client: Any = None,
                       max_workers: int = 1, report_path: str | Path | None = None) -> IngestReport:
    """Ingest CLAM/TRIDENT per-slide ``.h5`` feature files (a folder or a list); bag id = file stem.

    Labels: ``labels_csv`` with ``id_column`` and ``label_column``; the label is 1 for values in
    ``positive`` (e.g. ``["tumor"]``) if given, else the column must hold 0/1. Without a CSV the
    bags are unlabelled (-1).
    """
    import pandas as pd

    from tasks.ingest.tables import h5_bag_writer, h5_feature_dim

    paths = sorted(Path(files).glob("*.h5")) if isinstance(files, (str, Path)) else [Path(f) for f in files]
    labels = None
    if labels_csv is not None:
        positives = None if positive is None else {str(v) for v in positive}
        label_of = (lambda row: _binary(row[label_column])) if positives is None else (
            lambda row: int(str(row[label_column]) in positives))
        labels = _label_lookup(pd.read_csv(labels_csv, dtype={id_column: str}), id_column, label_of, str(labels_csv))
    items, skipped = _labelled_items(((p.stem, str(p), None) for p in paths), labels,
                                     None if labels_csv is None else str(labels_csv))
    n_features = _existing_n_features(store)
    for item in list(items):
        if n_features is not None:
            break
        try:
            n_features = h5_feature_dim(item.source)
        except IngestError as error:
            skipped.append(Skipped.from_error(error, item))
            items.remove(item)
    if n_features is None:
        raise IngestError("no readable .h5 feature file", path=str(files))
    spec = CohortSpec(name=name or Path(str(store)).stem, n_features=n_features, coords_dim=2,
                      coords_meaning="x,y (level-0 pixels, as in the .h5)")
    return run_ingest(store, spec, items, h5_bag_writer, skipped=skipped, client=client,
                      max_workers=max_workers, report_path=report_path)


def ingest_bag_files(store: str | Path, features_dir: str | Path, *, labels_dir: str | Path | None = None,
                     inst_labels_dir: str | Path | None = None, coords_dir: str | Path | None = None,
                     name: str | None = None, client: Any = None, max_workers: int = 1,
                     report_path: str | Path | None = None) -> IngestReport:
    """Ingest torchmil-style per-bag ``.npy`` folders: ``features_dir/<bag>.npy`` (N, D),
    ``labels_dir/<bag>.npy`` (the bag label), optional ``inst_labels_dir`` and ``coords_dir``."""
    from tasks.ingest.tables import npy_bag_writer

    feature_files = sorted(Path(features_dir).glob("*.npy"))
    labels: dict[str, int | Exception] | None = None
    if labels_dir is not None:
        labels = {}
        for path in sorted(Path(labels_dir).glob("*.npy")):
            try:
                labels[path.stem] = _binary(np.load(path).reshape(-1)[0])
            except Exception as error:
                labels[path.stem] = MissingLabelError(f"unusable label file: {error}", path=str(path), bag_id=path.stem)

    def optional(folder: str | Path | None, stem: str) -> str | None:
        path = None if folder is None else Path(folder) / f"{stem}.npy"
        return str(path) if path is not None and path.exists() else None

    candidates = [(p.stem, str(p), {"features": str(p), "inst_labels": optional(inst_labels_dir, p.stem),
                                    "coords": optional(coords_dir, p.stem)}) for p in feature_files]
    items, skipped = _labelled_items(candidates, labels, None if labels_dir is None else str(labels_dir))
    n_features, coords_dim = _existing_n_features(store), None
    for item in items:
        try:
            n_features = n_features or int(np.load(item.source, mmap_mode="r").shape[1])
            if item.payload["coords"]:
                coords_dim = int(np.prod(np.load(item.payload["coords"], mmap_mode="r").shape[1:]))
            break
        except Exception:  # reported by the worker
            continue
    if n_features is None:
        raise IngestError("no readable feature file", path=str(features_dir))
    spec = CohortSpec(name=name or Path(str(store)).stem, n_features=n_features,
                      coords_dim=coords_dim or 1, coords_meaning="given" if coords_dim else "instance_index")
    return run_ingest(store, spec, items, npy_bag_writer, skipped=skipped, client=client,
                      max_workers=max_workers, report_path=report_path)


def _existing_n_features(store: str | Path) -> int | None:
    if not (Path(store) / "zarr.json").exists():
        return None
    return int(_open_root(store, "r").attrs["n_features"])


# --------------------------------------------------------------------------------- slides
SLIDE_SUFFIXES = (".tif", ".tiff", ".svs", ".btf")


def read_panda_labels(path: str | Path) -> dict[str, int | Exception]:
    """image_id → 1 if ``isup_grade > 0`` else 0, from a PANDA-style CSV."""
    import pandas as pd

    table = pd.read_csv(path, dtype={"image_id": str})
    if "isup_grade" not in table.columns:
        raise IngestError(f"labels CSV has no isup_grade column (columns: {list(table.columns)})", path=str(path))

    def label_of(row: dict) -> int:
        grade = float(row["isup_grade"])
        if not (grade == int(grade) and 0 <= grade <= 5):
            raise ValueError("isup_grade must be an integer 0..5")
        return int(grade > 0)

    return _label_lookup(table, "image_id", label_of, str(path))


def ingest_slides(store: str | Path, slides: str | Path | Sequence[str | Path], *,
                  labels_csv: str | Path | None = None, params=None, extractor=None, batch_size: int = 64,
                  qc_dir: str | Path | None = None, name: str | None = None, client: Any = None,
                  max_workers: int = 1, fit_tiles: int = 512, seed: int = 0, extractor_from: str | Path | None = None,
                  report_path: str | Path | None = None, on_progress=None) -> IngestReport:
    """Tile slides (a folder or a list; bag id = file stem = PANDA ``image_id``) into the store.

    ``params`` is a :class:`tasks.ingest.wsi.TilingParams`; ``extractor`` defaults to
    :class:`tasks.ingest.features.HandcraftedHE`. An extractor that needs fitting is fitted once on
    up to ``fit_tiles`` tiles sampled from the first slides, or, when the store exists, taken from
    the store's recorded parameters (so a resumed or extended ingest uses the same features). A new
    store takes them from the store ``extractor_from`` if given: a new cohort gets the features of
    the cohort a model was trained on.
    """
    plan = plan_slides(store, slides, labels_csv=labels_csv, params=params, extractor=extractor,
                       batch_size=batch_size, qc_dir=qc_dir, name=name, fit_tiles=fit_tiles, seed=seed,
                       extractor_from=extractor_from)
    return run_ingest(store, plan.spec, plan.items, plan.bag_writer, skipped=plan.skipped, client=client,
                      max_workers=max_workers, report_path=report_path, on_progress=on_progress)


@dataclass(frozen=True)
class IngestPlan:
    """Everything :func:`run_ingest` needs: the store spec, the items, the rejected inputs, the worker."""

    spec: CohortSpec
    items: list[IngestItem]
    skipped: list[Skipped]
    bag_writer: BagWriter


def plan_slides(store: str | Path, slides: str | Path | Sequence[str | Path], *,
                labels_csv: str | Path | None = None, params=None, extractor=None, batch_size: int = 64,
                qc_dir: str | Path | None = None, name: str | None = None, fit_tiles: int = 512,
                seed: int = 0, extractor_from: str | Path | None = None) -> IngestPlan:
    """The plan of :func:`ingest_slides` (lists slides, reads labels, fits the extractor)."""
    from tasks.ingest.features import HandcraftedHE, extractor_from_spec, extractor_spec, needs_fit
    from tasks.ingest.wsi import TilingParams, sample_tiles, slide_bag_writer

    params = params or TilingParams()
    extractor = extractor or HandcraftedHE()
    paths = (sorted(p for p in Path(slides).iterdir() if p.suffix.lower() in SLIDE_SUFFIXES)
             if isinstance(slides, (str, Path)) else [Path(s) for s in slides])
    labels = None if labels_csv is None else read_panda_labels(labels_csv)
    items, skipped = _labelled_items(((p.stem, str(p), None) for p in paths), labels,
                                     None if labels_csv is None else str(labels_csv))
    if needs_fit(extractor):
        recorded = _recorded_extractor(store, extractor_from)
        if recorded is not None and recorded.get("name") == extractor.name:
            extractor = extractor_from_spec(recorded)
        else:
            extractor = extractor.fit(_fit_sample(items, params, fit_tiles, seed, sample_tiles))
    spec = CohortSpec(name=name or Path(str(store)).stem, n_features=int(extractor.n_features), coords_dim=2,
                      coords_meaning="tile_row,tile_col", feature_extractor=extractor_spec(extractor),
                      tiling=params.as_attrs())
    writer = functools.partial(slide_bag_writer, params=params, extractor=extractor, batch_size=batch_size,
                               qc_dir=None if qc_dir is None else str(qc_dir))
    return IngestPlan(spec, items, skipped, writer)


def _recorded_extractor(store: str | Path, extractor_from: str | Path | None) -> dict[str, Any] | None:
    """The extractor spec recorded in ``store`` if it exists, else in ``extractor_from`` if given."""
    if (Path(store) / "zarr.json").exists():
        return _open_root(store, "r").attrs["feature_extractor"]
    if extractor_from is None:
        return None
    if not (Path(extractor_from) / "zarr.json").exists():
        raise IngestError("no cohort store to take the feature extractor from", path=str(extractor_from))
    return _open_root(extractor_from, "r").attrs["feature_extractor"]


def _fit_sample(items: Sequence[IngestItem], params, n_tiles: int, seed: int, sample_tiles) -> np.ndarray:
    """Up to ``n_tiles`` tiles from the first (at most 8) readable slides with tissue."""
    rng = np.random.default_rng(seed)
    per_slide = -(-n_tiles // min(8, max(len(items), 1)))
    tiles, used = [], 0
    for item in items:
        try:
            sample = sample_tiles(item.source, params, per_slide, rng)
        except IngestError:
            continue  # the worker reports it
        if len(sample):
            tiles.append(sample)
            used += 1
        if used == 8 or sum(map(len, tiles)) >= n_tiles:
            break
    if not tiles:
        raise IngestError("no readable slide with tissue to fit the feature extractor on")
    return np.concatenate(tiles)[:n_tiles]


# ------------------------------------------------------------------------------------- CT
def ingest_ct(store: str | Path, dicom_root: str | Path, *, labels_csv: str | Path | None = None,
              extractor=None, batch_size: int = 32, name: str | None = None, client: Any = None,
              max_workers: int = 1, report_path: str | Path | None = None, on_progress=None) -> IngestReport:
    """Ingest every DICOM CT series under ``dicom_root`` (bag id = SeriesInstanceUID).

    With an RSNA-style ``labels_csv``, slice labels come from its ``_any`` rows and the bag label is
    1 if any slice is positive, 0 if all slices are labelled negative; a series with unlabelled
    slices and no positive one is skipped (:class:`MissingLabelError`).
    """
    plan = plan_ct(store, dicom_root, labels_csv=labels_csv, extractor=extractor, batch_size=batch_size, name=name)
    return run_ingest(store, plan.spec, plan.items, plan.bag_writer, skipped=plan.skipped, client=client,
                      max_workers=max_workers, report_path=report_path, on_progress=on_progress)


def plan_ct(store: str | Path, dicom_root: str | Path, *, labels_csv: str | Path | None = None,
            extractor=None, batch_size: int = 32, name: str | None = None) -> IngestPlan:
    """The plan of :func:`ingest_ct` (finds the series, reads the slice labels)."""
    from tasks.ingest.ct import WINDOWS, ct_bag_writer, read_rsna_labels, scan_dicom_dir
    from tasks.ingest.features import HandcraftedCT, extractor_spec

    extractor = extractor or HandcraftedCT()
    series, errors = scan_dicom_dir(dicom_root)
    skipped = [Skipped.from_error(error) for error in errors]
    slice_labels = None if labels_csv is None else read_rsna_labels(labels_csv)
    items = []
    for s in series:
        source = str(Path(s.files[0]).parent)
        if slice_labels is None:
            items.append(IngestItem(s.series_uid, source, UNKNOWN_LABEL,
                                    {"files": list(s.files), "instance_labels": [UNKNOWN_LABEL] * len(s.files)}))
            continue
        instance = np.array([slice_labels.get(uid, UNKNOWN_LABEL) for uid in s.sop_uids])
        if not np.isin(instance, (UNKNOWN_LABEL, 0, 1)).all():
            skipped.append(Skipped.from_error(MissingLabelError("slice labels must be 0 or 1", path=source,
                                                                bag_id=s.series_uid)))
            continue
        if not (instance == 1).any() and (instance == UNKNOWN_LABEL).any():
            skipped.append(Skipped.from_error(MissingLabelError(
                f"{int((instance == UNKNOWN_LABEL).sum())} of {len(instance)} slices have no label in "
                f"{labels_csv} and none is positive", path=source, bag_id=s.series_uid)))
            continue
        items.append(IngestItem(s.series_uid, source, int((instance == 1).any()),
                                {"files": list(s.files), "instance_labels": instance.tolist()}))
    spec = CohortSpec(name=name or Path(str(store)).stem, n_features=int(extractor.n_features), coords_dim=1,
                      coords_meaning="slice_index", feature_extractor=extractor_spec(extractor),
                      tiling={"instance": "slice", "windows": [list(w) for w in WINDOWS]})
    return IngestPlan(spec, items, skipped, functools.partial(ct_bag_writer, extractor=extractor, batch_size=batch_size))
