"""Feature tables users already have.

Two shapes of input:

- **one table for the whole cohort** (rows = instances): the MIL CSV layout of the MUSK files
  (bag label, bag id, features; no header), Parquet, NumPy ``.npz``. Read with
  :func:`read_mil_csv` / :func:`read_parquet_table` / :func:`read_npz_table` into a
  :class:`FeatureTable`; ``tasks.ingest.cohort.ingest_table`` appends it bag by bag.
- **one file per bag**: CLAM/TRIDENT ``<slide_id>.h5`` (datasets ``features`` (N, D) or (1, N, D)
  and ``coords`` (N, 2)) with a labels CSV, and torchmil-style per-bag ``.npy`` folders
  (``features/<bag>.npy``, ``labels/<bag>.npy``, optionally ``inst_labels/`` and ``coords/``).
  These go through the parallel, resumable ingest driver with the workers below, which copy a
  file into the store ``batch_rows`` rows at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tasks.ingest.errors import FeatureDimensionError, IngestError, UnreadableFileError


@dataclass(frozen=True)
class FeatureTable:
    """Instance rows of a cohort: ``X`` (N, D), ``bag_ids`` (N,), per-row bag ``labels`` (N,).

    ``coords`` (N, k) and ``instance_labels`` (N,) are optional; ``source`` names the file.
    """

    X: np.ndarray
    bag_ids: np.ndarray
    labels: np.ndarray
    source: str
    coords: np.ndarray | None = None
    instance_labels: np.ndarray | None = None


def read_mil_csv(path: str | Path, *, label_column: int = 0, bag_column: int = 1) -> FeatureTable:
    """The MIL CSV layout (no header): bag label, bag id, then the features (the MUSK files)."""
    import pandas as pd

    try:
        table = pd.read_csv(path, header=None)
    except Exception as error:
        raise UnreadableFileError(f"cannot read CSV: {type(error).__name__}: {error}", path=str(path)) from error
    feature_columns = [c for c in table.columns if c not in (label_column, bag_column)]
    X = table[feature_columns].to_numpy(dtype=np.float32)
    return FeatureTable(X=X, bag_ids=table[bag_column].astype(str).to_numpy(dtype=object),
                        labels=table[label_column].to_numpy(), source=str(path))


def read_parquet_table(path: str | Path, *, bag_column: str = "bag_id", label_column: str = "label",
                       instance_label_column: str | None = None,
                       feature_columns: list[str] | None = None) -> FeatureTable:
    """A Parquet table with a bag-id column, a bag-label column and feature columns.

    ``feature_columns`` defaults to every other numeric column. The file is read a row group and
    8 columns at a time into one preallocated float32 array, so peak memory is the features plus
    8 columns of one row group.
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:
        raise UnreadableFileError(f"cannot read Parquet: {type(error).__name__}: {error}", path=str(path)) from error
    schema = parquet.schema_arrow
    missing = {bag_column, label_column, instance_label_column} - set(schema.names) - {None}
    if missing:
        raise IngestError(f"Parquet table lacks columns {sorted(missing)}", path=str(path))
    if feature_columns is None:
        reserved = {bag_column, label_column, instance_label_column}
        feature_columns = [f.name for f in schema if f.name not in reserved
                           and (pa.types.is_integer(f.type) or pa.types.is_floating(f.type))]
    others = [c for c in (bag_column, label_column, instance_label_column) if c is not None]
    X = np.empty((parquet.metadata.num_rows, len(feature_columns)), dtype=np.float32)
    columns: dict[str, list[np.ndarray]] = {c: [] for c in others}
    start = 0
    try:  # a row group and 8 columns at a time: Arrow decodes a whole row group per read
        for group in range(parquet.num_row_groups):
            stop = start + parquet.metadata.row_group(group).num_rows
            for first in range(0, len(feature_columns), 8):
                names = feature_columns[first:first + 8]
                part = parquet.read_row_group(group, columns=names)
                for j, name in enumerate(names, start=first):
                    X[start:stop, j] = part.column(name).to_numpy()
            part = parquet.read_row_group(group, columns=others)
            for name in others:
                columns[name].append(part.column(name).to_numpy())
            start = stop
    except Exception as error:
        raise UnreadableFileError(f"cannot read Parquet: {type(error).__name__}: {error}", path=str(path)) from error
    merged = {name: np.concatenate(parts) if parts else np.zeros(0) for name, parts in columns.items()}
    return FeatureTable(
        X=X, bag_ids=merged[bag_column].astype(str).astype(object), labels=merged[label_column], source=str(path),
        instance_labels=None if instance_label_column is None else merged[instance_label_column])


def read_npz_table(path: str | Path) -> FeatureTable:
    """A NumPy ``.npz`` with arrays ``X``, ``bag_ids``, ``labels`` and optionally ``coords``, ``instance_labels``."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except Exception as error:
        raise UnreadableFileError(f"cannot read .npz: {type(error).__name__}: {error}", path=str(path)) from error
    missing = {"X", "bag_ids", "labels"} - set(arrays)
    if missing:
        raise IngestError(f".npz lacks arrays {sorted(missing)}", path=str(path))
    return FeatureTable(X=arrays["X"], bag_ids=arrays["bag_ids"].astype(str).astype(object),
                        labels=arrays["labels"], source=str(path), coords=arrays.get("coords"),
                        instance_labels=arrays.get("instance_labels"))


# ------------------------------------------------------------------------------ per-bag files
def _h5_features(handle, path: str):
    if "features" not in handle:
        raise UnreadableFileError("h5 file has no 'features' dataset", path=path)
    features = handle["features"]
    if features.ndim == 3 and features.shape[0] == 1:  # TRIDENT/CLAM batch dimension
        return features, True
    if features.ndim != 2:
        raise FeatureDimensionError(f"'features' has shape {features.shape}; expected (N, D)", path=path)
    return features, False


def h5_feature_dim(path: str | Path) -> int:
    """Feature dimension D of a CLAM/TRIDENT ``.h5`` file."""
    import h5py

    try:
        with h5py.File(path, "r") as handle:
            return int(_h5_features(handle, str(path))[0].shape[-1])
    except IngestError:
        raise
    except Exception as error:
        raise UnreadableFileError(f"cannot read h5: {type(error).__name__}: {error}", path=str(path)) from error


def h5_bag_writer(item, writer, *, batch_rows: int = 65536) -> None:
    """Ingest worker: copy ``features`` and ``coords`` (zeros if absent) of one ``.h5`` file."""
    import h5py

    try:
        with h5py.File(item.source, "r") as handle:
            features, batched = _h5_features(handle, item.source)
            n = features.shape[-2]
            coords = handle["coords"] if "coords" in handle else None
            if coords is not None and coords.shape[0] != n:
                raise FeatureDimensionError(f"{coords.shape[0]} coords for {n} feature rows", path=item.source)
            for start in range(0, n, batch_rows):
                rows = slice(start, min(n, start + batch_rows))
                block = features[0, rows] if batched else features[rows]
                xy = np.zeros((len(block), 2), dtype=np.int64) if coords is None else np.asarray(coords[rows]).reshape(len(block), -1)
                writer.write(np.asarray(block, dtype=np.float32), xy, np.full(len(block), -1, dtype=np.int8))
    except IngestError:
        raise
    except Exception as error:
        raise UnreadableFileError(f"cannot read h5: {type(error).__name__}: {error}", path=item.source) from error


def npy_bag_writer(item, writer, *, batch_rows: int = 65536) -> None:
    """Ingest worker for torchmil-style per-bag ``.npy`` files (``item.payload`` holds their paths).

    ``payload``: ``features`` (path, (N, D)), and optionally ``inst_labels`` ((N,)) and
    ``coords`` ((N, k)); features are memory-mapped and copied ``batch_rows`` rows at a time.
    """
    paths = item.payload
    try:
        features = np.load(paths["features"], mmap_mode="r")
        inst = np.load(paths["inst_labels"]) if paths.get("inst_labels") else None
        coords = np.load(paths["coords"]) if paths.get("coords") else None
    except Exception as error:
        raise UnreadableFileError(f"cannot read .npy: {type(error).__name__}: {error}", path=item.source) from error
    if features.ndim != 2:
        raise FeatureDimensionError(f"features of shape {features.shape}; expected (N, D)", path=item.source)
    n = features.shape[0]
    for name, array in (("inst_labels", inst), ("coords", coords)):
        if array is not None and array.shape[0] != n:
            raise FeatureDimensionError(f"{name} has {array.shape[0]} rows for {n} instances", path=paths[name])
    for start in range(0, n, batch_rows):
        rows = slice(start, min(n, start + batch_rows))
        count = rows.stop - rows.start
        writer.write(np.asarray(features[rows], dtype=np.float32),
                     np.arange(rows.start, rows.stop)[:, None] if coords is None else coords[rows].reshape(count, -1),
                     np.full(count, -1, dtype=np.int8) if inst is None else np.asarray(inst[rows]).astype(np.int8))
