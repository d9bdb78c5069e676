"""Zarr 3 cohort store: ragged MIL bags in CSR layout, its writers and its read API.

Layout (see ``docs/STORE.md`` for dtypes, chunks and codecs)::

    <cohort>.zarr/
      instances/features (N, D) float32   instances/bag (N,) int32
      instances/coords   (N, k) int32     instances/label (N,) int8   (-1 = unknown)
      instances/instance_id (N,) str      (only stores whose spec names ``instance_ids``, e.g. CT SOPInstanceUIDs)
      bags/offsets (B+1,) int64   bags/id (B,) str   bags/label (B,) int8   bags/source (B,) str
      bags/original_label (B,) str  (the label as the labels file gave it, JSON text; "" = none)
      bags/input_stamp (B,) str  (what the bag's input was at ingest: ``tasks.ingest.stamps``; "" = none)
      bags/done (B,) bool
      staging/<key>/{features,coords,label[,instance_id]}   (per-bag work area of the parallel ingest)
      predictions/<run>/...                  (written by ``tasks.training.predict_cohort``)

Instances of bag ``b`` are rows ``offsets[b]:offsets[b+1]``. Bags are appended by one writer
(:func:`append_bags`): instance rows first, then the bag arrays, then ``bags/done`` last, so a bag is
visible to readers only once all of it is written. A crash leaves trailing rows or bags with
``done == False``; readers ignore them and :func:`repair` (run by every append) truncates them.
Parallel ingest never writes the CSR arrays concurrently: each worker writes one bag into its own
``staging/<key>`` group (:class:`StagingWriter`), and the driver appends finished bags in order.

Read with :func:`open_cohort` (:class:`Cohort`: bag arrays, bag-aligned :class:`Partition` s,
:class:`StoredBags` blocks of whole bags). :func:`write_cohort_from_arrays` writes a store from
instance-level arrays in one pass.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

import numpy as np
import zarr
from zarr.codecs import BloscCodec

from tasks.ingest.errors import DuplicateIdError, FeatureDimensionError, IngestError, NonFiniteFeaturesError, StoreMismatchError

SCHEMA_VERSION = 1
FEATURE_DTYPE = np.dtype(np.float32)
BAG_INDEX_DTYPE = np.dtype(np.int32)
COORD_DTYPE = np.dtype(np.int32)
LABEL_DTYPE = np.dtype(np.int8)
OFFSET_DTYPE = np.dtype(np.int64)
UNKNOWN_LABEL = -1
BAG_CHUNK = 16384
TARGET_CHUNK_BYTES = 4 * 2**20

_NUMERIC_CODEC = BloscCodec(cname="zstd", clevel=3, shuffle="shuffle")
_INSTANCE_ARRAYS = ("features", "bag", "coords", "label")
_BAG_ARRAYS = ("id", "label", "source", "original_label", "input_stamp", "offsets", "done")
_ADDED_BAG_ARRAYS = ("original_label", "input_stamp")  # text arrays a store written before them gets, "" for its bags
# Attributes that must agree between an existing store and a new ingest into it.
_COMPATIBLE_ATTRS = ("n_features", "coords_dim", "coords_meaning", "feature_extractor", "tiling", "instance_ids")
# Settings of ``tiling`` that say where a cohort's pictures are, not what its features are: a later
# ingest may add them or move them (the project folder moved), and the store keeps the latest.
_WHERE_SETTINGS = ("slides_dir",)


def non_integer_coords(coords: np.ndarray) -> np.ndarray:
    """Mask of the coordinates the store cannot keep (it keeps int32): missing, fractional, or beyond
    int32 (a NaN was stored as -2147483648, 255.9 as 255, 2**31 + 5 as -2147483643)."""
    values = np.asarray(coords, dtype=np.float64)
    return ~np.isfinite(values) | (values != np.round(values)) | (np.abs(values) > np.iinfo(COORD_DTYPE).max)


def _what_tiling_makes(tiling: Any) -> Any:
    """``tiling`` without the settings that only say where pictures are (None when nothing is left)."""
    if not isinstance(tiling, dict):
        return tiling
    return {k: v for k, v in tiling.items() if k not in _WHERE_SETTINGS} or None


# ------------------------------------------------------------------------------ original labels
def encode_original_label(value: Any) -> str:
    """The label a labels file gave a bag (ISUP grade ``3``, ``"tumor"``, RSNA subtypes
    ``{"any": 1, "subdural": 1, ...}``) as the JSON text stored in ``bags/original_label``; ``""``
    for none (``None``, NaN). NumPy scalars become Python numbers, integral floats integers
    (``3.0`` read from a CSV column with gaps is grade ``3``)."""
    def plain(v: Any) -> Any:
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, float):
            if not math.isfinite(v):
                return None
            return int(v) if v.is_integer() else v
        if v is None or isinstance(v, (bool, int, str)):
            return v
        return str(v)  # a date, a decimal: kept as its text

    value = plain(value)
    return "" if value is None else json.dumps(value, sort_keys=True, ensure_ascii=False)


def decode_original_label(text: str) -> Any:
    """:func:`encode_original_label` reversed (``None`` for ``""``): plain JSON, nothing executed."""
    return None if not text else json.loads(text)


# --------------------------------------------------------------------------------------- specs
@dataclass(frozen=True)
class CohortSpec:
    """What a store is: fixed when it is created, checked when more bags are added.

    ``feature_extractor`` is ``{"name", "version", "params"}``; ``tiling`` holds tile size, level,
    magnification etc. for slide cohorts and ``None`` otherwise. ``coords_meaning`` names the
    columns of ``instances/coords`` (e.g. ``"tile_row,tile_col"``, ``"slice_index"``).
    """

    name: str
    n_features: int
    coords_dim: int
    coords_meaning: str
    feature_extractor: dict[str, Any] = field(default_factory=lambda: {"name": "precomputed"})
    tiling: dict[str, Any] | None = None
    chunk_rows: int | None = None
    instance_ids: str | None = None  # what ``instances/instance_id`` holds (e.g. "SOPInstanceUID"); None: no such array
    labels: dict[str, Any] | None = None  # where bag labels come from (file, column, target): ``labels`` attribute
    feature_columns: Sequence[str] | None = None  # a named table's feature columns, in order: ``feature_columns`` attribute

    def resolved_chunk_rows(self) -> int:
        """Rows per chunk: about 4 MiB of features, a power of two in [1024, 262144]."""
        if self.chunk_rows is not None:
            return int(self.chunk_rows)
        rows = TARGET_CHUNK_BYTES / (FEATURE_DTYPE.itemsize * max(self.n_features, 1))
        return int(np.clip(2 ** round(math.log2(rows)), 1024, 262144))


@dataclass(frozen=True)
class BagData:
    """One bag in memory: ``features`` (n, D), ``coords`` (n, k), ``instance_labels`` (n,);
    ``original_label`` is JSON text (:func:`encode_original_label`), ``instance_ids`` (n,) str
    for stores that keep them, ``input_stamp`` what the input was (:mod:`tasks.ingest.stamps`)."""

    bag_id: str
    label: int
    source: str
    features: np.ndarray
    coords: np.ndarray
    instance_labels: np.ndarray
    original_label: str = ""
    instance_ids: np.ndarray | None = None
    input_stamp: str = ""

    @property
    def n_instances(self) -> int:
        return int(self.features.shape[0])


@dataclass(frozen=True)
class Partition:
    """A block of whole bags: bags ``[bag_start, bag_stop)`` = rows ``[row_start, row_stop)``."""

    index: int
    bag_start: int
    bag_stop: int
    row_start: int
    row_stop: int

    @property
    def n_bags(self) -> int:
        return self.bag_stop - self.bag_start

    @property
    def n_rows(self) -> int:
        return self.row_stop - self.row_start


@dataclass(frozen=True)
class StoredBags:
    """Whole bags ``[bag_start, bag_stop)`` read into memory.

    ``bag`` is the global bag index of each row; ``offsets`` are local (``offsets[0] == 0``).
    """

    bag_start: int
    bag_stop: int
    features: np.ndarray
    bag: np.ndarray
    coords: np.ndarray
    instance_labels: np.ndarray
    bag_ids: np.ndarray
    bag_labels: np.ndarray
    offsets: np.ndarray

    @property
    def n_bags(self) -> int:
        return self.bag_stop - self.bag_start

    def select(self, start: int, stop: int) -> StoredBags:
        """Bags ``[start, stop)`` (store positions, within this block) as a block of their own."""
        a, b = start - self.bag_start, stop - self.bag_start
        rows = slice(int(self.offsets[a]), int(self.offsets[b]))
        return StoredBags(bag_start=start, bag_stop=stop, features=self.features[rows], bag=self.bag[rows],
                          coords=self.coords[rows], instance_labels=self.instance_labels[rows],
                          bag_ids=self.bag_ids[a:b], bag_labels=self.bag_labels[a:b],
                          offsets=self.offsets[a:b + 1] - self.offsets[a])


# -------------------------------------------------------------------------------------- create
def create_cohort(path: str | Path, spec: CohortSpec, *, overwrite: bool = False) -> zarr.Group:
    """Create an empty cohort store at ``path`` (``overwrite`` replaces an existing one). It is built
    in a hidden folder beside ``path`` and renamed into place: a run killed while creating it left
    a ``zarr.json`` without attributes, which every later run refused as schema version None."""
    target = Path(path).resolve()  # a store reached through a link is made in the folder the link names
    for leftover in target.parent.glob(f".{target.name}.creating-*"):  # of a creator killed before its rename
        shutil.rmtree(leftover, ignore_errors=True)
    if target.exists() and (overwrite or not any(target.iterdir())):
        shutil.rmtree(target)
    elif target.exists():
        raise StoreMismatchError("the folder exists and is not a cohort store: give a new or empty folder", path=str(path))
    building = target.parent / f".{target.name}.creating-{uuid.uuid4().hex[:12]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    _build_empty_cohort(zarr.open_group(zarr.storage.LocalStore(str(building)), mode="w-", zarr_format=3), spec)
    os.rename(building, target)
    return zarr.open_group(zarr.storage.LocalStore(str(target)), mode="r+", zarr_format=3)


def _build_empty_cohort(root: zarr.Group, spec: CohortSpec) -> None:
    chunk_rows = spec.resolved_chunk_rows()
    instances = root.create_group("instances")
    numeric = {"compressors": _NUMERIC_CODEC}
    instances.create_array("features", shape=(0, spec.n_features), chunks=(chunk_rows, spec.n_features),
                           dtype=FEATURE_DTYPE, fill_value=0.0, **numeric)
    instances.create_array("bag", shape=(0,), chunks=(chunk_rows,), dtype=BAG_INDEX_DTYPE,
                           fill_value=-1, **numeric)
    instances.create_array("coords", shape=(0, spec.coords_dim), chunks=(chunk_rows, spec.coords_dim),
                           dtype=COORD_DTYPE, fill_value=0, **numeric)
    instances.create_array("label", shape=(0,), chunks=(chunk_rows,), dtype=LABEL_DTYPE,
                           fill_value=UNKNOWN_LABEL, **numeric)
    if spec.instance_ids is not None:
        instances.create_array("instance_id", shape=(0,), chunks=(chunk_rows,), dtype=str)
    bags = root.create_group("bags")
    offsets = bags.create_array("offsets", shape=(1,), chunks=(BAG_CHUNK,), dtype=OFFSET_DTYPE,
                                fill_value=0, **numeric)
    offsets[:] = 0
    bags.create_array("id", shape=(0,), chunks=(BAG_CHUNK,), dtype=str)
    bags.create_array("source", shape=(0,), chunks=(BAG_CHUNK,), dtype=str)
    for name in _ADDED_BAG_ARRAYS:
        bags.create_array(name, shape=(0,), chunks=(BAG_CHUNK,), dtype=str)
    bags.create_array("label", shape=(0,), chunks=(BAG_CHUNK,), dtype=LABEL_DTYPE,
                      fill_value=UNKNOWN_LABEL, **numeric)
    bags.create_array("done", shape=(0,), chunks=(BAG_CHUNK,), dtype=bool, fill_value=False)
    root.create_group("staging")
    root.update_attributes({
        "schema_version": SCHEMA_VERSION,
        "cohort_name": spec.name,
        "n_features": spec.n_features,
        "coords_dim": spec.coords_dim,
        "coords_meaning": spec.coords_meaning,
        "feature_extractor": spec.feature_extractor,
        "tiling": spec.tiling,
        "instance_ids": spec.instance_ids,
        "labels": spec.labels,
        "feature_columns": None if spec.feature_columns is None else list(spec.feature_columns),
        "chunk_rows": chunk_rows,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    })


def open_or_create_cohort(path: str | Path, spec: CohortSpec) -> zarr.Group:
    """Open the store at ``path`` for appending (checking it matches ``spec``) or create it (also
    over one that a run of an earlier version, killed while creating it, left without attributes)."""
    if not (Path(path) / "zarr.json").exists():
        return create_cohort(path, spec)
    if _half_created(path):
        return create_cohort(path, spec, overwrite=True)
    root = zarr.open_group(zarr.storage.LocalStore(str(path)), mode="r+", zarr_format=3)
    check_compatible(root, spec, path=str(path))
    where = {k: v for k, v in (_as_json(spec.tiling) or {}).items() if k in _WHERE_SETTINGS}
    if where and any((root.attrs.get("tiling") or {}).get(k) != v for k, v in where.items()):
        root.attrs["tiling"] = {**(root.attrs.get("tiling") or {}), **where}  # slides given now, or moved since
    if spec.labels is not None and root.attrs.get("labels") is None:
        root.attrs["labels"] = spec.labels  # a store first filled without labels gets its labels' description
    if spec.feature_columns is not None and root.attrs.get("feature_columns") is None:
        root.attrs["feature_columns"] = list(spec.feature_columns)  # a store from unnamed columns learns the names
    return root


def open_or_start_afresh(path: str | Path, spec: CohortSpec) -> tuple[zarr.Group, bool]:
    """:func:`open_or_create_cohort`, and whether it created the store; a store that holds no
    committed bag — an ingest killed before its first commit, which only removes its empty store
    when it finishes — is made again where ``spec`` differs from it (settings, feature width): its
    settings are no cohort's, and a corrected configuration must not meet them as a mismatch. Its
    staged bags, of the other settings, go with it. The caller holds the writer lease."""
    created = not (Path(path) / "zarr.json").exists()
    try:
        return open_or_create_cohort(path, spec), created
    except (StoreMismatchError, FeatureDimensionError):
        if created or stored_bag_count(path) != 0:  # a folder that is no store, or a cohort: refused as it was
            raise
    create_cohort(path, spec, overwrite=True)  # through a link: the folder it names
    return zarr.open_group(zarr.storage.LocalStore(str(path)), mode="r+", zarr_format=3), True


def stored_bag_count(path: str | Path) -> int | None:
    """The committed bags of the cohort store at ``path``; None where there is none (no
    ``zarr.json``, or a group without the bag arrays). A store of 0 bags is one an ingest killed
    before its first commit left: no cohort's (:func:`open_or_start_afresh`)."""
    if not (Path(path) / "zarr.json").exists():
        return None
    root = zarr.open_group(zarr.storage.LocalStore(str(path), read_only=True), mode="r", zarr_format=3)
    return committed_bag_count(root) if "bags" in root else None


def _half_created(path: str | Path) -> bool:
    """A root ``zarr.json`` without the store's attributes and no bag offsets: nothing was ever committed."""
    root = zarr.open_group(zarr.storage.LocalStore(str(path), read_only=True), mode="r", zarr_format=3)
    return "schema_version" not in root.attrs and not (Path(path) / "bags" / "offsets").exists()


def check_compatible(root: zarr.Group, spec: CohortSpec, *, path: str | None = None) -> None:
    """Raise if ``spec`` disagrees with the store's schema, feature dimension or settings."""
    attrs = dict(root.attrs)
    if attrs.get("schema_version") != SCHEMA_VERSION:
        raise StoreMismatchError(
            f"store schema version {attrs.get('schema_version')} != supported {SCHEMA_VERSION}", path=path)
    wanted = _as_json({
        "n_features": spec.n_features, "coords_dim": spec.coords_dim,
        "coords_meaning": spec.coords_meaning, "feature_extractor": spec.feature_extractor,
        "tiling": spec.tiling, "instance_ids": spec.instance_ids,
    })
    for key in _COMPATIBLE_ATTRS:
        have, want = attrs.get(key), wanted[key]
        if key == "tiling":
            have, want = _what_tiling_makes(have), _what_tiling_makes(want)
        if have != want:
            error = FeatureDimensionError if key == "n_features" else StoreMismatchError
            if isinstance(have, dict) and isinstance(want, dict):  # name the settings that differ, not both dicts
                fields = sorted(k for k in have.keys() | want.keys() if have.get(k) != want.get(k))
                detail = ", ".join(f"{key}.{k}: store {have.get(k)!r}, this ingest {want.get(k)!r}" for k in fields)
            else:
                detail = f"store has {key}={have!r}, this ingest has {want!r}"
            hint = ("; a store holds one kind of cohort (slides, CT, features): ingest into another store"
                    if key in ("coords_dim", "coords_meaning") else "; ingest into a new store for other settings")
            raise error(detail + hint, path=path)
    stored, given = attrs.get("labels") or {}, _as_json(spec.labels) or {}
    changed = [k for k in ("column", "target", "positive") if stored and given and stored.get(k) != given.get(k)]
    if changed:  # the stored original labels would mean two things
        raise StoreMismatchError(f"store's bag labels come from {stored}, this ingest's from {given} "
                                 f"({', '.join(changed)} differ): ingest into a new store", path=path)
    stored, given = attrs.get("feature_columns"), _as_json(spec.feature_columns)
    if stored and given and stored != given:  # the same width, other columns: features that do not compare
        raise StoreMismatchError(f"store's features are the table columns {_column_list(stored)}, this ingest's "
                                 f"{_column_list(given)} ({column_difference(stored, given, 'store', 'this ingest')}): "
                                 "name the store's columns in its order (feature_columns / ingest.columns.features), or "
                                 "ingest into a new store", path=path)


def _column_list(names: Sequence[str]) -> str:
    return "[" + ", ".join(names[:4]) + (f", … ({len(names)})" if len(names) > 4 else "") + "]"


def column_difference(first: Sequence[str], second: Sequence[str], first_name: str, second_name: str) -> str:
    """Where two stores' feature columns first differ, for messages: ``first difference at feature
    j: <first_name> 'a', <second_name> 'b'``."""
    j = next((j for j, (a, b) in enumerate(zip(first, second)) if a != b), min(len(first), len(second)))

    def at(names: Sequence[str]) -> str:
        return repr(names[j]) if j < len(names) else "none"

    return f"first difference at feature {j}: {first_name} {at(first)}, {second_name} {at(second)}"


def _as_json(value: Any) -> Any:
    """``value`` as it reads back from the group attributes (tuples become lists, ...)."""
    return json.loads(json.dumps(value))


def _open_root(target: str | Path | zarr.Group, mode: str) -> zarr.Group:
    if isinstance(target, zarr.Group):
        return target
    return zarr.open_group(zarr.storage.LocalStore(str(target), read_only=mode == "r"), mode=mode, zarr_format=3)


# --------------------------------------------------------------------------------------- write
def committed_bag_count(root: zarr.Group) -> int:
    """Number of leading bags with ``done == True``: the bags readers see."""
    done = root["bags/done"][:]
    not_done = np.flatnonzero(~done)
    return int(not_done[0]) if not_done.size else int(done.size)


def committed_bag_ids(target: str | Path | zarr.Group) -> np.ndarray:
    """Ids of the committed bags, in store order."""
    root = _open_root(target, "r")
    return np.asarray(root["bags/id"][: committed_bag_count(root)], dtype=object)


def label_unlabelled_bags(root: zarr.Group, labels: dict[str, tuple[int, str]]) -> None:
    """Give committed bags that were ingested unlabelled (label -1) their label and original label
    (JSON text), e.g. from a labels file that arrived after the cohort was ingested for prediction.
    Only -1 is ever overwritten: a bag with a label keeps it (a changed label is a new store)."""
    if not labels:
        return
    n_bags = committed_bag_count(root)
    position = {bag_id: b for b, bag_id in enumerate(root["bags/id"][:n_bags].tolist())}
    stored = root["bags/label"][:n_bags]
    originals = np.asarray(root["bags/original_label"][:n_bags], dtype=object)
    for bag_id, (label, original) in labels.items():
        b = position[bag_id]
        if stored[b] != UNKNOWN_LABEL or label not in (0, 1):
            raise ValueError(f"bag {bag_id!r} has label {stored[b]}: only an unlabelled bag (-1) is given one, here {label}")
        _check_original(original, path=None, bag_id=bag_id)
        stored[b], originals[b] = label, original
    # whole arrays, once (a write per bag rewrote a chunk of 16,384 bags each time); labels last
    root["bags/original_label"][:n_bags] = np.asarray(originals.tolist(), dtype=np.dtypes.StringDType())
    root["bags/label"][:n_bags] = stored


def _instance_arrays(root: zarr.Group) -> tuple[str, ...]:
    """Names of the instance arrays of this store (``instance_id`` where the store keeps it)."""
    return _INSTANCE_ARRAYS + (("instance_id",) if "instance_id" in root["instances"] else ())


def repair(target: str | Path | zarr.Group) -> int:
    """Drop rows and bags left by an interrupted append; return the number of rows dropped.
    A store written before ``bags/original_label`` or ``bags/input_stamp`` existed gets them, empty
    for its bags."""
    root = _open_root(target, "r+")
    for name in _ADDED_BAG_ARRAYS:
        if name not in root["bags"]:
            root["bags"].create_array(name, shape=(root["bags/id"].shape[0],), chunks=(BAG_CHUNK,), dtype=str)
    n_bags = committed_bag_count(root)
    n_rows = int(root["bags/offsets"][n_bags])
    dropped = root["instances/bag"].shape[0] - n_rows
    for name in _instance_arrays(root):
        array = root[f"instances/{name}"]
        array.resize((n_rows, *array.shape[1:]))
    for name in _BAG_ARRAYS:
        array = root[f"bags/{name}"]
        array.resize((n_bags + (name == "offsets"),))
    return dropped


class _RowWriter:
    """Append instance rows in whole, chunk-aligned blocks (the buffer holds at most one chunk)."""

    def __init__(self, root: zarr.Group, start_row: int):
        self._arrays = {name: root[f"instances/{name}"] for name in _instance_arrays(root)}
        self._chunk = self._arrays["features"].chunks[0]
        self._next_row = start_row  # first row not yet written
        self._buffer: dict[str, list[np.ndarray]] = {name: [] for name in self._arrays}
        self._buffered = 0

    def add(self, block: dict[str, np.ndarray]) -> None:
        n = len(block["bag"])
        start = 0
        while start < n:
            room = self._chunk - (self._next_row + self._buffered) % self._chunk
            stop = min(n, start + room)
            for name in self._arrays:
                self._buffer[name].append(block[name][start:stop])
            self._buffered += stop - start
            if (self._next_row + self._buffered) % self._chunk == 0:
                self.flush()
            start = stop

    def flush(self) -> None:
        if not self._buffered:
            return
        stop = self._next_row + self._buffered
        for name, array in self._arrays.items():
            array.resize((stop, *array.shape[1:]))
            array[self._next_row:stop] = np.concatenate(self._buffer[name])
            self._buffer[name] = []
        self._next_row, self._buffered = stop, 0


NonFinitePolicy = Literal["reject", "drop"]


def check_text(bag_id: str, source: str) -> None:
    """Bag ids and sources are stored as UTF-8: a name decoded from non-UTF-8 bytes (lone
    surrogates, as ``os.listdir`` gives them) is refused for this item only."""
    for what, text in (("bag id", bag_id), ("source path", source)):
        try:
            str(text).encode("utf-8")
        except UnicodeEncodeError:
            def shown(name: str) -> str:  # the undecodable bytes as \xNN
                return str(name).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")

            raise IngestError(f"the {what} is not valid UTF-8 ({shown(text)}); rename the file",
                              path=shown(source), bag_id=shown(bag_id)) from None


def finite_rows(features: np.ndarray, policy: NonFinitePolicy, *, path: str | None, bag_id: str,
                first_row: int = 0, file_rows: np.ndarray | None = None, file_unit: str = "row",
                column_names: Sequence[str] | None = None) -> np.ndarray | None:
    """Rows of ``features`` (already in the store's dtype) to keep, or None when all are finite.

    ``policy="reject"`` raises :class:`NonFiniteFeaturesError` naming the bag, the file, the first
    offending rows (numbered within the bag from ``first_row``, or the rows of the input file
    ``file_rows`` when given: its ``file_unit`` "line" for a CSV's 1-based lines) and columns (by ``column_names`` where the file names them, else
    0-based among the features); ``"drop"`` returns the mask of finite rows (the caller counts what
    it dropped and reports it). A table's missing cells (nulls) are NaN here.
    """
    finite = np.isfinite(features)
    if finite.all():
        return None
    bad = np.flatnonzero(~finite.all(axis=1))
    if policy == "drop":
        return finite.all(axis=1)
    if policy != "reject":
        raise ValueError(f"nonfinite must be 'reject' or 'drop', got {policy!r}")
    columns = np.flatnonzero(~finite.all(axis=0))
    where = f"{(bad[:5] + first_row).tolist()}" if file_rows is None else f"{np.asarray(file_rows)[bad[:5]].tolist()}"
    named = (f"columns {[column_names[j] for j in columns[:5]]}" if column_names is not None
             else f"feature columns {columns[:5].tolist()} (0-based among the features)")
    raise NonFiniteFeaturesError(
        f"{bad.size} instance row(s) with missing, NaN or infinite features ({'row' if file_rows is None else file_unit}s {where}"
        f"{'…' if bad.size > 5 else ''} of the {'bag' if file_rows is None else 'file'}, {named}{'…' if columns.size > 5 else ''}; "
        "float32 overflow counts as infinite). Fix the features, or set ingest.nonfinite: drop to leave those "
        "instances out (counted in the ingest report)", path=path, bag_id=bag_id)


def append_bags(target: str | Path | zarr.Group, bags: Iterable[BagData]) -> int:
    """Append bags to the store (one writer at a time); return the number appended.

    Bags are streamed: memory holds one bag and one chunk of rows. Raises
    :class:`DuplicateIdError` for an id already committed or repeated, and
    :class:`FeatureDimensionError` for a bag whose feature or coordinate width differs from the
    store's, and :class:`NonFiniteFeaturesError` for NaN/inf features (callers that drop such
    instances do it before: :func:`finite_rows`); in all cases nothing of this call is committed.
    """
    root = _open_root(target, "r+")
    repair(root)
    n_features, coords_dim = root.attrs["n_features"], root.attrs["coords_dim"]
    first_bag = committed_bag_count(root)
    seen = set(committed_bag_ids(root))
    offsets = [int(root["bags/offsets"][first_bag])]
    ids, labels, sources, originals, stamps = [], [], [], [], []
    keeps_ids = "instance_id" in root["instances"]
    id_kind = (root.attrs.get("instance_ids") or "instance id") if keeps_ids else None
    writer = _RowWriter(root, offsets[0])
    for bag in bags:
        check_text(bag.bag_id, bag.source)
        if bag.bag_id in seen:
            raise DuplicateIdError("bag id already in the store or repeated", path=bag.source, bag_id=bag.bag_id)
        if bag.features.ndim != 2 or bag.features.shape[1] != n_features or bag.coords.shape != (
                bag.n_instances, coords_dim) or bag.instance_labels.shape != (bag.n_instances,):
            raise FeatureDimensionError(
                f"features {bag.features.shape}, coords {bag.coords.shape}, labels "
                f"{bag.instance_labels.shape} do not fit the store's (n, {n_features}) / (n, {coords_dim})",
                path=bag.source, bag_id=bag.bag_id)
        if bag.n_instances == 0:
            raise IngestError("bag has no instances", path=bag.source, bag_id=bag.bag_id)
        if bag.label not in (UNKNOWN_LABEL, 0, 1):
            raise IngestError(f"bag label {bag.label!r} is not 0, 1 or {UNKNOWN_LABEL} (unlabelled)",
                              path=bag.source, bag_id=bag.bag_id)
        _check_original(bag.original_label, path=bag.source, bag_id=bag.bag_id)
        _check_instance_ids(bag.instance_ids, bag.n_instances, id_kind, path=bag.source, bag_id=bag.bag_id)
        with np.errstate(over="ignore"):  # float32 overflow becomes inf, which finite_rows reports
            features = np.asarray(bag.features, dtype=FEATURE_DTYPE)
        finite_rows(features, "reject", path=bag.source, bag_id=bag.bag_id)
        seen.add(bag.bag_id)
        block = {
            "features": features,
            "bag": np.full(bag.n_instances, first_bag + len(ids), dtype=BAG_INDEX_DTYPE),
            "coords": np.asarray(bag.coords, dtype=COORD_DTYPE),
            "label": np.asarray(bag.instance_labels, dtype=LABEL_DTYPE),
        }
        if keeps_ids:
            block["instance_id"] = np.asarray(bag.instance_ids, dtype=np.dtypes.StringDType())
        writer.add(block)
        ids.append(bag.bag_id)
        labels.append(bag.label)
        sources.append(bag.source)
        originals.append(bag.original_label)
        stamps.append(bag.input_stamp)
        offsets.append(offsets[-1] + bag.n_instances)
    writer.flush()
    if ids:
        _write_bag_arrays(root, first_bag, ids, labels, sources, offsets, originals, stamps)
    return len(ids)


def _check_instance_ids(ids: Sequence[str] | np.ndarray | None, n: int, kind: str | None, *, path: str | None, bag_id: str) -> None:
    """One instance id per row (``n``) where the store keeps them (``kind``, e.g. ``"SOPInstanceUID"``),
    none where it keeps none: the direct append and the staging writer refuse alike."""
    if (kind is not None) == (ids is not None) and (ids is None or np.shape(ids) == (n,)):
        return
    given = "no instance ids" if ids is None else f"instance ids of shape {np.shape(ids)}"
    kept = f"keeps instance ids ({kind}), one per instance" if kind is not None else "keeps no instance ids"
    raise FeatureDimensionError(f"{given} for {n} instances; the store {kept}", path=path, bag_id=bag_id)


def _check_original(text: str, *, path: str | None, bag_id: str) -> None:
    """An original label must be the JSON text :func:`encode_original_label` gives (or "")."""
    try:
        if not isinstance(text, str) or text and encode_original_label(json.loads(text)) != text:
            raise ValueError("not in the stored form")
    except ValueError as error:
        raise IngestError(f"original label {text!r} is not JSON text from encode_original_label ({error})",
                          path=path, bag_id=bag_id) from None


def _write_bag_arrays(root: zarr.Group, first: int, ids: list[str], labels: list[int],
                      sources: list[str], offsets: list[int], originals: list[str], stamps: list[str]) -> None:
    stop = first + len(ids)
    columns = {
        "id": np.asarray(ids, dtype=np.dtypes.StringDType()),
        "source": np.asarray(sources, dtype=np.dtypes.StringDType()),
        "original_label": np.asarray(originals, dtype=np.dtypes.StringDType()),
        "input_stamp": np.asarray(stamps, dtype=np.dtypes.StringDType()),
        "label": np.asarray(labels, dtype=LABEL_DTYPE),
    }
    for name, values in columns.items():
        root[f"bags/{name}"].resize((stop,))
        root[f"bags/{name}"][first:stop] = values
    root["bags/offsets"].resize((stop + 1,))
    root["bags/offsets"][first:stop + 1] = np.asarray(offsets, dtype=OFFSET_DTYPE)
    done = root["bags/done"]
    done.resize((stop,))
    done[first:stop] = True  # the commit point: written last


def write_cohort_from_arrays(
    path: str | Path,
    X: np.ndarray,
    bag_ids: np.ndarray,
    bag_labels_per_instance: np.ndarray,
    *,
    coords: np.ndarray | None = None,
    instance_labels: np.ndarray | None = None,
    original_labels: np.ndarray | None = None,
    name: str = "cohort",
    chunk_rows: int | None = None,
    feature_extractor: dict[str, Any] | None = None,
    source: str = "arrays",
    overwrite: bool = False,
) -> Cohort:
    """Write a new store from instance-level arrays (the MIL table layout) and open it.

    ``X`` (N, D) may be a ``np.memmap``; rows are copied one chunk at a time, so memory holds the
    (N,) index arrays and one chunk of features, never a second copy of ``X``. Bags keep the order
    of their first row; rows of a bag keep their order (a stable sort when bags are interleaved).
    ``bag_labels_per_instance`` must be constant within each bag (0, 1, or -1 for unlabelled).
    ``coords`` defaults to the row's index within its bag (``coords_meaning="instance_index"``);
    ``instance_labels`` defaults to -1 (unknown). ``original_labels`` (per row, constant within a
    bag: ISUP grades, class names) are kept as each bag's original label (default: none).
    """
    import pandas as pd

    n = X.shape[0]
    if X.ndim != 2:
        raise ValueError(f"X must be 2-D (instances x features), got shape {X.shape}")
    codes, unique_ids = pd.factorize(np.asarray(bag_ids), sort=False)
    labels = np.asarray(bag_labels_per_instance)
    for what, array in (("bag_ids", codes), ("bag_labels_per_instance", labels)):
        if array.shape != (n,):
            raise ValueError(f"{what} must have shape ({n},), got {array.shape}")
    order = None if np.all(codes[1:] >= codes[:-1]) else np.argsort(codes, kind="stable")
    sorted_codes = codes if order is None else codes[order]
    sizes = np.bincount(codes, minlength=len(unique_ids))
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(OFFSET_DTYPE)
    sorted_labels = (labels if order is None else labels[order]).astype(np.int64)
    bag_labels = np.minimum.reduceat(sorted_labels, offsets[:-1]) if n else sorted_labels
    if n and np.any(np.maximum.reduceat(sorted_labels, offsets[:-1]) != bag_labels):
        raise ValueError("bag_labels_per_instance differs within a bag")
    if not np.isin(bag_labels, (UNKNOWN_LABEL, 0, 1)).all():
        raise ValueError(f"bag labels must be 0, 1 or {UNKNOWN_LABEL}, got {np.unique(bag_labels)}")
    originals = [""] * len(unique_ids)
    if original_labels is not None:
        values = np.asarray(original_labels, dtype=object)
        if values.shape != (n,):
            raise ValueError(f"original_labels must have shape ({n},), got {values.shape}")
        texts = [encode_original_label(v) for v in values]
        by_bag: dict[int, str] = {}
        for code, text in zip(codes.tolist(), texts):
            if by_bag.setdefault(code, text) != text:
                raise ValueError(f"original_labels differ within bag {str(unique_ids[code])!r}: {by_bag[code]} and {text}")
        originals = [by_bag[b] for b in range(len(unique_ids))]
    if coords is None:
        coords_dim, coords_meaning = 1, "instance_index"
    else:
        coords = np.asarray(coords).reshape(n, -1)
        coords_dim, coords_meaning = coords.shape[1], "given"
    spec = CohortSpec(name=name, n_features=int(X.shape[1]), coords_dim=coords_dim,
                      coords_meaning=coords_meaning,
                      feature_extractor=feature_extractor or {"name": "precomputed"}, chunk_rows=chunk_rows)
    root = create_cohort(path, spec, overwrite=overwrite)
    writer = _RowWriter(root, 0)
    step = root.attrs["chunk_rows"]
    for start in range(0, n, step):
        stop = min(n, start + step)
        rows = slice(start, stop) if order is None else order[start:stop]
        bag = sorted_codes[start:stop]
        writer.add({
            "features": np.asarray(X[rows], dtype=FEATURE_DTYPE),
            "bag": bag.astype(BAG_INDEX_DTYPE),
            "coords": (np.arange(start, stop) - offsets[bag])[:, None] if coords is None else coords[rows],
            "label": (np.full(stop - start, UNKNOWN_LABEL) if instance_labels is None
                      else np.asarray(instance_labels)[rows]).astype(LABEL_DTYPE),
        })
    writer.flush()
    if len(unique_ids):
        _write_bag_arrays(root, 0, [str(b) for b in unique_ids], bag_labels.tolist(),
                          [source] * len(unique_ids), offsets.tolist(), originals, [""] * len(unique_ids))
    return open_cohort(path)


# ------------------------------------------------------------------------------------- staging
def staging_key(bag_id: str) -> str:
    """Name of a bag's staging group: a hash, so any bag id is a safe path component."""
    return hashlib.sha1(bag_id.encode("utf-8", "surrogateescape")).hexdigest()[:24]


def staged_status(root: zarr.Group, bag_id: str, *, source: str | None = None, label: int | None = None,
                  original_label: str | None = None) -> str:
    """``"complete"``, ``"incomplete"`` (an interrupted write, metadata a full disk left
    unreadable, or — when ``source``/``label``/``original_label`` are given — staged from another
    file or with another label: the bag is staged again) or ``"absent"``."""
    try:
        attrs = dict(root[f"staging/{staging_key(bag_id)}"].attrs)
    except KeyError:
        return "absent"
    except (ValueError, OSError):
        return "incomplete"
    if (source is not None and attrs.get("source") != source) or (label is not None and attrs.get("label") != label) \
            or (original_label is not None and attrs.get("original_label", "") != original_label):
        return "incomplete"
    return "complete" if attrs.get("complete") else "incomplete"


def staged_input_stamp(root: zarr.Group, bag_id: str) -> str:
    """The input stamp a staged bag was written with (``""``: none)."""
    return root[f"staging/{staging_key(bag_id)}"].attrs.get("input_stamp", "")


def staged_dropped(root: zarr.Group, bag_id: str) -> int:
    """Instances a staged bag left out for NaN/inf features (``nonfinite="drop"``)."""
    return int(root[f"staging/{staging_key(bag_id)}"].attrs.get("n_dropped_nonfinite", 0))


class StagingWriter:
    """Write one bag into its own ``staging/<key>`` group, batch by batch.

    Only this writer touches the group, so any number of them run in parallel. The ``complete``
    attribute is set by :meth:`finish` after all data is written.
    """

    def __init__(self, store_path: str | Path, bag_id: str, label: int, source: str, nonfinite: NonFinitePolicy = "reject",
                 original_label: str = "", input_stamp: str = ""):
        check_text(bag_id, source)
        _check_original(original_label, path=source, bag_id=bag_id)
        root = _open_root(store_path, "r+")
        self._n_features, self._coords_dim = root.attrs["n_features"], root.attrs["coords_dim"]
        self._chunk_rows = root.attrs["chunk_rows"]
        self._group = root["staging"].create_group(staging_key(bag_id), overwrite=True)
        self._group.update_attributes({"bag_id": bag_id, "label": int(label), "source": source,
                                       "original_label": original_label, "input_stamp": input_stamp, "complete": False})
        self._arrays = {
            "features": self._create("features", (0, self._n_features), FEATURE_DTYPE),
            "coords": self._create("coords", (0, self._coords_dim), COORD_DTYPE),
            "label": self._create("label", (0,), LABEL_DTYPE),
        }
        self.instance_ids = root.attrs.get("instance_ids")  # what the store's instance ids are, or None
        if self.instance_ids is not None:
            self._arrays["instance_id"] = self._group.create_array(
                "instance_id", shape=(0,), chunks=(self._chunk_rows,), dtype=str)
        self.bag_id, self.source, self.n_instances = bag_id, source, 0
        self.nonfinite, self.n_dropped, self._n_seen = nonfinite, 0, 0

    def _create(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> zarr.Array:
        chunks = (self._chunk_rows, *shape[1:])
        return self._group.create_array(name, shape=shape, chunks=chunks, dtype=dtype, compressors=_NUMERIC_CODEC)

    def write(self, features: np.ndarray, coords: np.ndarray, instance_labels: np.ndarray,
              instance_ids: Sequence[str] | None = None) -> None:
        """Append a batch of rows (checked against the store's feature dimension); ``instance_ids``
        (one string per row) are required by, and only by, a store that keeps them."""
        n = features.shape[0]
        _check_instance_ids(instance_ids, n, self.instance_ids, path=self.source, bag_id=self.bag_id)
        if features.ndim != 2 or features.shape[1] != self._n_features:
            raise FeatureDimensionError(
                f"features of shape {features.shape}; the store has {self._n_features} features",
                path=self.source, bag_id=self.bag_id)
        if coords.shape != (n, self._coords_dim) or instance_labels.shape != (n,):
            raise FeatureDimensionError(
                f"coords {coords.shape} / labels {instance_labels.shape} for {n} rows; the store has "
                f"{self._coords_dim} coordinate columns", path=self.source, bag_id=self.bag_id)
        with np.errstate(over="ignore"):  # float32 overflow becomes inf, which finite_rows reports
            features = np.asarray(features, dtype=FEATURE_DTYPE)
        keep = finite_rows(features, self.nonfinite, path=self.source, bag_id=self.bag_id, first_row=self._n_seen)
        self._n_seen += n
        columns = {"features": features, "coords": coords, "label": instance_labels}
        if instance_ids is not None:
            columns["instance_id"] = np.asarray(list(instance_ids), dtype=np.dtypes.StringDType())
        if keep is not None:
            columns = {name: values[keep] for name, values in columns.items()}
            self.n_dropped += n - int(keep.sum())
            n = int(keep.sum())
        stop = self.n_instances + n
        for name, values in columns.items():
            array = self._arrays[name]
            array.resize((stop, *array.shape[1:]))
            array[self.n_instances:stop] = values
        self.n_instances = stop

    def finish(self) -> int:
        """Mark the staged bag complete; return its number of instances. A bag left with no
        instance (all dropped as non-finite) is an error, not an empty bag."""
        if self.n_instances == 0 and self.n_dropped:
            raise NonFiniteFeaturesError(f"all {self.n_dropped} instances have NaN or infinite features",
                                         path=self.source, bag_id=self.bag_id)
        self._group.update_attributes({"n_instances": self.n_instances, "n_dropped_nonfinite": self.n_dropped, "complete": True})
        return self.n_instances


def read_staged(root: zarr.Group, bag_id: str) -> BagData:
    """Load a complete staged bag."""
    group = root[f"staging/{staging_key(bag_id)}"]
    attrs = dict(group.attrs)
    if not attrs.get("complete"):
        raise RuntimeError(f"staged bag {bag_id!r} is incomplete")
    return BagData(bag_id=attrs["bag_id"], label=attrs["label"], source=attrs["source"],
                   features=group["features"][:], coords=group["coords"][:],
                   instance_labels=group["label"][:], original_label=attrs.get("original_label", ""),
                   instance_ids=group["instance_id"][:] if "instance_id" in group else None,
                   input_stamp=attrs.get("input_stamp", ""))


def drop_staged(root: zarr.Group, bag_ids: Iterable[str]) -> None:
    """Delete staging groups (after their bags are committed)."""
    staging = root["staging"]
    for bag_id in bag_ids:
        key = staging_key(bag_id)
        if key in staging:
            del staging[key]


def drop_staged_of_gone_inputs(root: zarr.Group, keep: Iterable[str]) -> list[str]:
    """Delete the staging groups, but those of the bag ids ``keep``, whose input no longer exists (a
    slide staged by a killed run, then removed from its folder): no later ingest lists them, and
    they would stay for good. A group of an input still there (another folder's, fed on another
    night) stays for its rerun. Returns the bag ids dropped."""
    keep, dropped = set(keep), []
    staging = root["staging"]
    for key, group in list(staging.groups()):
        attrs = dict(group.attrs)
        if attrs.get("bag_id") not in keep and attrs.get("source") and _gone(attrs["source"]):
            del staging[key]
            dropped.append(str(attrs.get("bag_id")))
    return dropped


def _gone(path: str) -> bool:
    """Whether nothing is at ``path`` (not: whether it cannot be read now, a folder without
    permission or a stale network mount, which a later run may read again)."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


# ---------------------------------------------------------------------------------------- read
class Cohort:
    """Read access to a cohort store (only committed bags are visible).

    Bag-level arrays (ids, labels, offsets, sources) are loaded at open; instance arrays are read
    on demand, a range of whole bags at a time.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._root = _open_root(self.path, "r")
        self.attrs: dict[str, Any] = dict(self._root.attrs)
        if self.attrs.get("schema_version") != SCHEMA_VERSION:
            raise StoreMismatchError(
                f"store schema version {self.attrs.get('schema_version')} != supported {SCHEMA_VERSION}",
                path=str(path))
        n_bags = committed_bag_count(self._root)
        bags = self._root["bags"]
        self.offsets: np.ndarray = bags["offsets"][: n_bags + 1]
        self.bag_ids: np.ndarray = np.asarray(bags["id"][:n_bags], dtype=object)
        self.bag_labels: np.ndarray = bags["label"][:n_bags]
        self.sources: np.ndarray = np.asarray(bags["source"][:n_bags], dtype=object)
        self._original_texts: np.ndarray = (np.asarray(bags["original_label"][:n_bags], dtype=object)
                                            if "original_label" in bags else np.full(n_bags, "", dtype=object))
        self._instances = {name: self._root[f"instances/{name}"] for name in _instance_arrays(self._root)}

    def __repr__(self) -> str:
        return (f"Cohort({str(self.path)!r}, name={self.name!r}, n_bags={self.n_bags}, "
                f"n_instances={self.n_instances}, n_features={self.n_features})")

    @property
    def name(self) -> str:
        return self.attrs["cohort_name"]

    @property
    def original_labels(self) -> np.ndarray:
        """(B,) object array: each bag's label as its labels file gave it (an ISUP grade ``3``, a class
        name, RSNA subtypes as a dict), ``None`` where there was none; the binary target is
        :attr:`bag_labels`, where the labels came from is ``attrs["labels"]``."""
        out = np.empty(self.n_bags, dtype=object)
        for b, text in enumerate(self._original_texts):
            out[b] = decode_original_label(text)
        return out

    @property
    def input_stamps(self) -> np.ndarray:
        """(B,) object array of str: what each bag's input was at ingest (:mod:`tasks.ingest.stamps`),
        ``""`` for bags ingested before stamps existed or from no file."""
        bags = self._root["bags"]
        if "input_stamp" not in bags:
            return np.full(self.n_bags, "", dtype=object)
        return np.asarray(bags["input_stamp"][: self.n_bags], dtype=object)

    @property
    def instance_id_kind(self) -> str | None:
        """What :meth:`instance_ids` holds (``"SOPInstanceUID"`` for CT), or None if the store keeps none."""
        return self.attrs.get("instance_ids")

    def instance_ids(self, rows: slice | None = None) -> np.ndarray:
        """(rows,) object array of instance ids (CT: each slice's SOPInstanceUID), read from the
        store; ``rows`` defaults to every committed instance. Raises if the store keeps none."""
        if "instance_id" not in self._instances:
            raise KeyError(f"store {self.path} keeps no instance ids (coords_meaning {self.attrs.get('coords_meaning')!r})")
        rows = rows or slice(0, self.n_instances)
        return np.asarray(self._instances["instance_id"][rows], dtype=object)

    @property
    def n_bags(self) -> int:
        return int(self.bag_ids.size)

    @property
    def n_instances(self) -> int:
        return int(self.offsets[-1])

    @property
    def n_features(self) -> int:
        return int(self.attrs["n_features"])

    @property
    def coords_dim(self) -> int:
        return int(self.attrs["coords_dim"])

    @property
    def bytes_per_instance(self) -> int:
        """Bytes of one row across the four instance arrays, uncompressed."""
        return (FEATURE_DTYPE.itemsize * self.n_features + BAG_INDEX_DTYPE.itemsize
                + COORD_DTYPE.itemsize * self.coords_dim + LABEL_DTYPE.itemsize)

    def bag_slice(self, bag: int) -> slice:
        """Rows of bag ``bag``."""
        if not 0 <= bag < self.n_bags:
            raise IndexError(f"bag {bag} out of range [0, {self.n_bags})")
        return slice(int(self.offsets[bag]), int(self.offsets[bag + 1]))

    def read_bags(self, start: int, stop: int) -> StoredBags:
        """Read bags ``[start, stop)`` (whole bags) into memory."""
        if not 0 <= start <= stop <= self.n_bags:
            raise IndexError(f"bag range [{start}, {stop}) not within [0, {self.n_bags}]")
        row_start, row_stop = int(self.offsets[start]), int(self.offsets[stop])
        rows = slice(row_start, row_stop)
        return StoredBags(
            bag_start=start, bag_stop=stop,
            features=self._instances["features"][rows],
            bag=self._instances["bag"][rows].astype(np.int64),
            coords=self._instances["coords"][rows],
            instance_labels=self._instances["label"][rows],
            bag_ids=self.bag_ids[start:stop], bag_labels=self.bag_labels[start:stop],
            offsets=self.offsets[start:stop + 1] - row_start,
        )

    def read_partition(self, partition: Partition) -> StoredBags:
        """Read the bags of ``partition``."""
        return self.read_bags(partition.bag_start, partition.bag_stop)

    def partitions(self, target_bytes: int = 128 * 2**20) -> tuple[Partition, ...]:
        """Split the cohort into bag-aligned partitions of about ``target_bytes`` each.

        A partition starts at the first bag starting at or after each multiple of
        ``target_bytes // bytes_per_instance`` rows, so partitions hold roughly the target (one
        bag more at most) and a bag larger than the target is a partition of its own. Depends only
        on the offsets and ``target_bytes``: the same store gives the same partitions.
        """
        if target_bytes <= 0:
            raise ValueError("target_bytes must be positive")
        if self.n_bags == 0:
            return ()
        target_rows = max(1, target_bytes // self.bytes_per_instance)
        marks = np.arange(0, self.n_instances, target_rows)
        starts = np.unique(np.searchsorted(self.offsets[:-1], marks, side="left"))
        bounds = np.append(starts[starts < self.n_bags], self.n_bags)
        bounds[0] = 0
        return tuple(
            Partition(index=i, bag_start=int(b0), bag_stop=int(b1),
                      row_start=int(self.offsets[b0]), row_stop=int(self.offsets[b1]))
            for i, (b0, b1) in enumerate(zip(bounds[:-1], bounds[1:]))
        )


def open_cohort(path: str | Path) -> Cohort:
    """Open a cohort store for reading."""
    if not (Path(path) / "zarr.json").exists():
        raise FileNotFoundError(f"no cohort store at {path}")
    return Cohort(path)

