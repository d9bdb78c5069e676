"""Feature tables users already have: one table for the whole cohort (rows = instances).

The MIL CSV layout of the MUSK files (bag label, bag id, features; no header), Parquet, NumPy
``.npz``. Read with :func:`read_mil_csv` / :func:`read_parquet_table` / :func:`read_npz_table` into
a :class:`FeatureTable`; :func:`ingest_table` appends it to a store bag by bag. (One file per bag:
:mod:`tasks.ingest.h5` for CLAM/TRIDENT, :mod:`tasks.ingest.npy` for torchmil folders.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

import numpy as np

from tasks.ingest.driver import UNSTAMPED, IngestReport, Skipped, default_report_path, same_source
from tasks.ingest.errors import (BadValueError, DuplicateIdError, IngestError, LabelChangedError, MissingLabelError,
                                 NonFiniteFeaturesError, SourceChangedError, UnreadableFileError)
from tasks.ingest.labels import check_instance_labels
from tasks.ingest.stamps import rows_change, rows_stamp
from tasks.lease import ensure_still_held, writer_lease
from tasks.store import (FEATURE_DTYPE, UNKNOWN_LABEL, BagData, CohortSpec, NonFinitePolicy, append_bags, non_integer_coords,
                         committed_bag_count, encode_original_label, finite_rows, label_unlabelled_bags,
                         open_or_start_afresh, repair)


@dataclass(frozen=True)
class FeatureTable:
    """Instance rows of a cohort: ``X`` (N, D), ``bag_ids`` (N,), per-row bag ``labels`` (N,).

    ``coords`` (N, k) and ``instance_labels`` (N,) are optional; ``source`` names the file.
    ``original_labels`` (N,), optional, constant within a bag: the label the bag's target was
    derived from (an ISUP grade, a class name), kept as the bag's original label; without it the
    original label is the bag label itself (none for -1).
    ``row_problems``: row → why its features are NaN (a cell that is not a number).
    ``lines``: each row's 1-based line in the file (a CSV's: blank lines are dropped, so row ``r``
    need not be line ``r + 1``), for messages that point into it; ``None``: the rows are the file's.
    ``feature_names`` / ``coords_names``: the columns the features / coordinates came from, where
    the file names them (Parquet); the store keeps the feature names and refuses other ones.
    """

    X: np.ndarray
    bag_ids: np.ndarray
    labels: np.ndarray
    source: str
    coords: np.ndarray | None = None
    instance_labels: np.ndarray | None = None
    row_problems: dict[int, str] = field(default_factory=dict)
    original_labels: np.ndarray | None = None
    feature_names: tuple[str, ...] | None = None
    coords_names: tuple[str, ...] | None = None
    lines: np.ndarray | None = None

    def where(self, row: int) -> str:
        """Where row ``row`` is in the file, for a message: ``line 8`` of a CSV, else ``row 7``."""
        return _where(self.lines, row)

    def __post_init__(self) -> None:
        """The shapes every reader must deliver, checked once here: a table whose arrays disagree
        would be cut short or misaligned row by row, silently."""
        X = np.asarray(self.X)
        if X.ndim != 2 or X.shape[1] == 0:
            raise IngestError(f"features must be a 2-D (rows, features) array with at least one feature column, got shape "
                              f"{X.shape}", path=self.source)
        for name in ("bag_ids", "labels", "coords", "instance_labels", "original_labels"):
            values = getattr(self, name)
            if values is not None and (np.ndim(values) == 0 or len(values) != X.shape[0]):
                rows = "a scalar" if np.ndim(values) == 0 else f"{len(values)} rows"
                raise IngestError(f"{name} has {rows} but the features have {X.shape[0]}: one entry per instance row",
                                  path=self.source)
        if self.instance_labels is not None:
            check_instance_labels(np.asarray(self.instance_labels), self.source, "instance labels")


def read_mil_csv(path: str | Path, *, label_column: int = 0, bag_column: int = 1,
                 original_label_column: int | None = None, dtype: type = np.float32) -> FeatureTable:
    """The MIL CSV layout (no header): bag label, bag id, then the features (the MUSK files).

    ``original_label_column`` (a 0-based column position, not a feature) holds the label the 0/1
    target came from, kept in the store as each bag's original label. ``dtype``: the features'
    (float32, the store's; ``gpmil cv`` fits on float64 as read)."""
    import pandas as pd

    try:
        table = pd.read_csv(path, header=None, dtype={bag_column: str})  # '00123' and '0123' are two bags
    except Exception as error:
        raise UnreadableFileError(f"cannot read CSV: {type(error).__name__}: {error}", path=str(path)) from error
    n_records = len(table)
    table = table[~table.isna().all(axis=1)]  # a spreadsheet's export ends with rows of empty cells: no instance
    while len(table.columns) > 2 and table[table.columns[-1]].isna().all():  # and with columns of them: no feature
        table = table.drop(columns=[table.columns[-1]])
    lines = _record_lines(path, table.index.to_numpy(), n_records)
    table = table.reset_index(drop=True)

    if bag_column not in table.columns or label_column not in table.columns:
        raise IngestError(f"CSV table has {len(table.columns)} column(s); a MIL CSV is bag label, bag id, features… "
                          "(comma-separated, no header)", path=str(path))
    if not pd.api.types.is_numeric_dtype(table[label_column]) and table[label_column].astype(str).str.contains(";").any():
        raise IngestError("the table looks semicolon-separated (as a spreadsheet in some locales saves it, with decimal "
                          "commas): save it comma-separated with decimal points", path=str(path))
    labels = pd.to_numeric(table[label_column], errors="coerce")
    if len(table) > 1 and np.isnan(labels.iloc[0]) and labels.iloc[1:].notna().all():
        raise IngestError(f"{_where(lines, 0)} ({', '.join(map(str, table.iloc[0, :4]))}, …) looks like a header: a MIL CSV has none "
                          "(bag label, bag id, features…); remove the first line", path=str(path))
    first = pd.to_numeric(table.iloc[0], errors="coerce").to_numpy(dtype=float)
    if len(table) > 1 and first.size >= 5 and np.array_equal(first, np.arange(first.size)):  # DataFrame(array).to_csv()
        raise IngestError(f"{_where(lines, 0)} ({', '.join(str(i) for i in range(4))}, …, {first.size - 1}) looks like the header pandas "
                          "writes for an array's columns: a MIL CSV has none (bag label, bag id, features…); remove the "
                          "first line, or save with to_csv(header=False, index=False)", path=str(path))
    if original_label_column is not None and original_label_column not in table.columns:
        raise IngestError(f"CSV table has no column {original_label_column} (original_label_column; columns 0 to "
                          f"{len(table.columns) - 1})", path=str(path))
    feature_columns = [c for c in table.columns if c not in (label_column, bag_column, original_label_column)]
    features, problems = table[feature_columns], {}
    if not all(pd.api.types.is_numeric_dtype(dtype) for dtype in features.dtypes):  # a cell that is not a number
        numeric = features.apply(pd.to_numeric, errors="coerce")
        for r, c in zip(*np.nonzero(numeric.isna().to_numpy() & features.notna().to_numpy())):
            problems.setdefault(int(r), f"{_where(lines, r)}, column {feature_columns[c] + 1}: {features.iat[r, c]!r} is not a number")
        features = numeric
    with np.errstate(over="ignore"):  # float32 overflow becomes inf, reported per bag at ingest
        X = features.to_numpy(dtype=dtype)
    return FeatureTable(X=X, bag_ids=_bag_id_text(table[bag_column].to_numpy(dtype=object), path, lines),
                        labels=_label_cells(table[label_column]), source=str(path), row_problems=problems, lines=lines,
                        original_labels=None if original_label_column is None else table[original_label_column].to_numpy(dtype=object))


def read_parquet_table(path: str | Path, *, bag_column: str = "bag_id", label_column: str = "label",
                       instance_label_column: str | None = None, original_label_column: str | None = None,
                       feature_columns: Sequence[str] | str | None = None,
                       coords_columns: Sequence[str] | None = None) -> FeatureTable:
    """A Parquet table with a bag-id column, a bag-label column and feature columns.

    ``original_label_column`` (e.g. ``isup_grade``) holds the label the 0/1 target came from, kept
    in the store as each bag's original label. ``coords_columns`` (e.g. ``["x", "y"]``, integers)
    are kept as the instances' coordinates, not used as features. ``feature_columns``: a list of
    names, a pattern (``"feat_*"``, :func:`fnmatch.fnmatchcase`) or, by default, every other
    numeric column (integer, float or decimal). The file is read a row group and 8 columns at a
    time into one preallocated float32 array, so peak memory is the features plus 8 columns of one
    row group.
    """
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:
        raise UnreadableFileError(f"cannot read Parquet: {type(error).__name__}: {error}", path=str(path)) from error
    schema = parquet.schema_arrow
    coords_columns = list(coords_columns or [])
    roles = {"bag": [bag_column], "label": [label_column], "instance_label": [instance_label_column],
             "original_label": [original_label_column], "coords": coords_columns}
    roles = {role: [c for c in names if c is not None] for role, names in roles.items()}
    others = [c for role in ("bag", "label", "instance_label", "original_label") for c in roles[role]]
    feature_columns = _parquet_feature_columns(schema, feature_columns, roles, str(path))
    for name in coords_columns:
        if not _numeric(schema.field(name).type):
            raise IngestError(f"coordinate column {name!r} is {schema.field(name).type}, not numeric", path=str(path))
    X = np.empty((parquet.metadata.num_rows, len(feature_columns)), dtype=np.float32)
    columns: dict[str, list[np.ndarray]] = {c: [] for c in others + coords_columns}
    start = 0
    try:  # a row group and 8 columns at a time: Arrow decodes a whole row group per read
        for group in range(parquet.num_row_groups):
            stop = start + parquet.metadata.row_group(group).num_rows
            for first in range(0, len(feature_columns), 8):
                names = feature_columns[first:first + 8]
                part = parquet.read_row_group(group, columns=names)
                for j, name in enumerate(names, start=first):
                    X[start:stop, j] = _column_values(part.column(name))
            part = parquet.read_row_group(group, columns=list(columns))
            for name in columns:
                columns[name].append(part.column(name).to_numpy())
            start = stop
    except Exception as error:
        raise UnreadableFileError(f"cannot read Parquet: {type(error).__name__}: {error}", path=str(path)) from error
    merged = {name: np.concatenate(parts) if parts else np.zeros(0) for name, parts in columns.items()}
    return FeatureTable(
        X=X, bag_ids=_bag_id_text(merged[bag_column], path), labels=_label_cells(merged[label_column]), source=str(path),
        coords=_integer_coords(merged, coords_columns, str(path)) if coords_columns else None,
        instance_labels=None if instance_label_column is None else _instance_labels(merged[instance_label_column],
                                                                                      instance_label_column, str(path)),
        original_labels=None if original_label_column is None else merged[original_label_column],
        feature_names=tuple(feature_columns), coords_names=tuple(coords_columns) or None)


def _label_cells(column: Any) -> np.ndarray:
    """A bag-label column's cells for the ingest's per-bag check: a NumPy numeric or boolean column
    as it is (a float column's blanks NaN); a nullable one (``Int64``, ``boolean``) with blanks as
    objects, ``None`` for each blank; text cells that spell numbers (``"0"``, ``"1"``) as numbers, the
    others (True/False, a typo ``?``, ``tumor``) as they are. One bad cell fails its own bag, not the column's."""
    import pandas as pd

    series = pd.Series(column)
    if isinstance(series.dtype, np.dtype) and series.dtype.kind in "biuf":
        return series.to_numpy()
    missing = series.isna().to_numpy()
    if pd.api.types.is_bool_dtype(series.dtype) or pd.api.types.is_numeric_dtype(series.dtype):  # nullable dtypes
        return series.to_numpy() if not missing.any() else series.astype(object).where(~missing, None).to_numpy()
    numbers = pd.to_numeric(series, errors="coerce")
    if numbers.notna().all():
        return numbers.to_numpy()
    cells = series.to_numpy(dtype=object).copy()
    spelled = np.array([isinstance(v, str) for v in cells]) & numbers.notna().to_numpy()  # True/False cells stay as
    cells[spelled] = numbers.to_numpy()[spelled]  # they are: a store's original labels 'true' must read so again
    cells[missing] = None
    return cells


def _distinct_labels(cells: np.ndarray) -> list[Any]:
    """A bag's distinct label values (sorted where they compare), a blank (a float column's NaN, the
    ``None`` of :func:`_label_cells`' other columns) as ``None``."""
    if cells.dtype.kind in "biuf":
        return [None if isinstance(v, float) and v != v else v for v in np.unique(cells).tolist()]
    distinct = list(dict.fromkeys(cells.tolist()))
    try:
        return sorted(distinct)
    except TypeError:  # text beside numbers, or a blank
        return distinct


def _numbers_if_all(values: np.ndarray) -> np.ndarray:
    """A text instance-label column whose every value is a number (``"0"``, ``"1"``) as numbers;
    otherwise as it is (refused naming the first value that is not 0/1/-1)."""
    import pandas as pd

    if values.dtype.kind in "biuf":
        return values
    numbers = pd.to_numeric(pd.Series(values), errors="coerce")
    return numbers.to_numpy() if numbers.notna().all() else values


def _instance_labels(values: np.ndarray, column: str, path: str) -> np.ndarray:
    """A Parquet instance-label column: missing cells (nulls) are -1, unknown; text digits are
    numbers; then 0, 1 or -1, else refused naming the column and row."""
    import pandas as pd

    missing = pd.isna(values)
    values = _numbers_if_all(np.where(missing, -1, values) if missing.any() else values)
    check_instance_labels(values, path, f"instance labels (column {column!r})")
    return values


def _numeric(kind) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind)


def _column_values(column) -> np.ndarray:
    """A numeric Arrow column as NumPy (decimals as float64; nulls as NaN, reported by the ingest)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_decimal(column.type):
        column = pc.cast(column, pa.float64())
    return column.to_numpy(zero_copy_only=False)


def _parquet_feature_columns(schema, wanted: Sequence[str] | str | None, roles: dict[str, list[str]], path: str) -> list[str]:
    """The feature columns of a Parquet schema: ``wanted`` (names or one pattern) or every numeric
    column not given a ``roles`` entry (bag, label, coordinates, …) and not the row index pandas
    wrote; each named column must exist once, be numeric and have one role."""
    import pyarrow as pa

    shown = ", ".join(schema.names[:20]) + (", …" if len(schema.names) > 20 else "")
    if twice := sorted({name for name in schema.names if schema.names.count(name) > 1}):
        raise IngestError(f"Parquet table has columns named twice: {twice}; give every column its own name", path=path)
    reserved = {name: role for role, names in roles.items() for name in names}
    if missing := [f"{role} column {name!r}" for role, names in roles.items() for name in names if name not in schema.names]:
        raise IngestError(f"Parquet table lacks the {', '.join(missing)} (columns: {shown})", path=path)
    named = [(role, name) for role, names in roles.items() for name in names]
    if clash := [(role, name) for role, name in named if reserved[name] != role or [n for _, n in named].count(name) > 1]:
        roles_of = sorted({role for role, name in named if name == clash[0][1]})
        what = f"twice as a {roles_of[0]} column" if len(roles_of) == 1 else f"as the {' and the '.join(roles_of)} column"
        raise IngestError(f"column {clash[0][1]!r} is named {what}: each column has one role", path=path)
    candidates = [f.name for f in schema if f.name not in reserved]
    if wanted is None:
        lists = [name for name in candidates if (pa.types.is_list(schema.field(name).type) or pa.types.is_large_list(
            schema.field(name).type) or pa.types.is_fixed_size_list(schema.field(name).type))
            and _numeric(schema.field(name).type.value_type)]
        if lists:
            raise IngestError(f"column {lists[0]!r} holds lists of numbers ({schema.field(lists[0]).type}): an embedding in "
                              "one column is not read; write one numeric column per feature, or name the feature columns "
                              "(feature_columns / ingest.columns.features) to leave it out", path=path)
        index = {c for c in (schema.pandas_metadata or {}).get("index_columns", []) if isinstance(c, str)}
        columns = [name for name in candidates if _numeric(schema.field(name).type) and name not in index]  # not a row index
        if not columns:
            others = ", ".join(f"{name} ({schema.field(name).type})" for name in candidates) or "none"
            raise IngestError(f"Parquet table has no numeric feature column (one integer, float or decimal column per "
                              f"feature; the other columns: {others})", path=path)
        return columns
    if isinstance(wanted, str):
        columns = [name for name in candidates if fnmatchcase(name, wanted)]
        if not columns:
            raise IngestError(f"no column matches feature_columns {wanted!r} (columns: {shown})", path=path)
    else:
        columns = list(wanted)
        if absent := [name for name in columns if name not in schema.names]:
            raise IngestError(f"Parquet table lacks the feature columns {absent[:5]} (columns: {shown})", path=path)
        if repeated := sorted({name for name in columns if columns.count(name) > 1}):
            raise IngestError(f"feature columns named twice: {repeated}", path=path)
        if taken := [f"{name!r} (named as the {reserved[name]} column)" for name in columns if name in reserved]:
            raise IngestError(f"feature columns {', '.join(taken)} cannot be features too", path=path)
    if text := [f"{name} ({schema.field(name).type})" for name in columns if not _numeric(schema.field(name).type)]:
        raise IngestError(f"feature columns must be numeric; {', '.join(text[:5])} are not", path=path)
    return columns


def _integer_coords(columns: dict[str, np.ndarray], names: list[str], path: str) -> np.ndarray:
    """The coordinate columns as an (N, k) int64 array; a missing or fractional value is refused
    naming its column and row (the store keeps integer coordinates, e.g. level-0 pixels)."""
    coords = np.column_stack([np.asarray(columns[name], dtype=np.float64) for name in names])
    bad = non_integer_coords(coords)
    if bad.any():
        row, j = np.argwhere(bad)[0]
        raise IngestError(f"coordinate column {names[j]!r} holds {coords[row, j]} at row {row}: coordinates must be "
                          f"integers (e.g. level-0 pixels) within int32 ({int(bad.any(axis=1).sum())} such row(s))", path=path)
    return coords.astype(np.int64)


def read_npz_table(path: str | Path) -> FeatureTable:
    """A NumPy ``.npz`` with arrays ``X``, ``bag_ids``, ``labels`` and optionally ``coords``,
    ``instance_labels``, ``original_labels`` (numbers or fixed-width strings; nothing pickled is loaded)."""
    try:
        with np.load(path, allow_pickle=False) as data:
            arrays = {key: data[key] for key in data.files}
    except Exception as error:
        reason = ("not a NumPy .npz archive, or one holding pickled objects (never loaded: they can run code)"
                  if "pickled" in str(error) else f"{type(error).__name__}: {error}")
        raise UnreadableFileError(f"cannot read .npz: {reason}", path=str(path)) from error
    missing = {"X", "bag_ids", "labels"} - set(arrays)
    if missing:
        raise IngestError(f".npz lacks arrays {sorted(missing)}", path=str(path))
    return FeatureTable(X=arrays["X"], bag_ids=_bag_id_text(arrays["bag_ids"], path),
                        labels=arrays["labels"], source=str(path), coords=arrays.get("coords"),
                        instance_labels=arrays.get("instance_labels"), original_labels=arrays.get("original_labels"))


def _where(lines: np.ndarray | None, row: int) -> str:
    return f"row {row}" if lines is None else f"line {lines[row]}"


def _record_lines(path: str | Path, records: np.ndarray, n_records: int) -> np.ndarray | None:
    """The 1-based file line of each of the ``records`` (indices among the ``n_records`` records
    pandas read from a header-less CSV, which skips empty and blank lines), for messages; None where
    lines and records do not pair up (a quoted cell holding a line break)."""
    with open(path, "rb") as handle:
        lines = np.array([n for n, line in enumerate(handle, 1) if line.strip(b" \t\r\n\xef\xbb\xbf")], dtype=np.int64)
    return lines[records] if lines.size == n_records else None


def _bag_id_text(values: np.ndarray, path: str | Path, lines: np.ndarray | None = None) -> np.ndarray:
    """Bag ids as text (object array); a missing one (an empty cell, a null) is an error naming its
    row (a CSV's ``lines``: its line), not a bag called 'nan' or 'None'."""
    import pandas as pd

    values = np.asarray(values)
    missing = np.flatnonzero(pd.isna(values))  # None or NaN: a null or an empty cell
    if missing.size:
        raise IngestError(f"no bag id at {'row(s)' if lines is None else 'line(s)'} "
                          f"{(missing if lines is None else lines[missing])[:5].tolist()}"
                          + (f" (and {missing.size - 5} more)" if missing.size > 5 else ""), path=str(path))
    return values.astype(str).astype(object)


def _coords_meaning(coords: np.ndarray | None, names: tuple[str, ...] | None) -> str:
    """What a table's coordinates are: two named columns are x, y (in that order; level-0 pixels as
    CLAM/TRIDENT write them, or a grid), which the report reads for heatmaps and QuPath GeoJSON."""
    if coords is None:
        return "instance_index"
    if names is None:
        return "given"
    if len(names) == 2:
        return f"x,y (table columns {names[0]}, {names[1]})"
    return f"given: table columns {', '.join(names)}"


def ingest_table(store: str | Path, table, *, name: str | None = None, chunk_rows: int | None = None,
                 report_path: str | Path | None = None, nonfinite: NonFinitePolicy = "reject") -> IngestReport:
    """Append a :class:`tasks.ingest.tables.FeatureTable` to a store, bag by bag.

    Bags keep the order of their first row. A bag whose rows disagree on the bag label, or whose
    label is not 0/1/-1, is skipped (:class:`MissingLabelError`); bags already in the store from the
    same file are skipped as done (reported instead when their rows or labels changed since:
    :class:`SourceChangedError`, :class:`LabelChangedError`), from another file as duplicates
    unless their rows are the ones stored (the table moved or copied since: done). A
    feature dimension that differs from an existing store's raises (it concerns the whole file). A
    bag with NaN/inf features is skipped naming the file rows (``nonfinite="reject"``) or loses
    those rows, counted in the report (``"drop"``). Holds the store's writer lease (:mod:`tasks.lease`).
    """
    import pandas as pd

    with writer_lease(store, f"ingest of the feature table {table.source}"):
        started = time.perf_counter()
        X, n = table.X, table.X.shape[0]
        coords = None if table.coords is None else np.asarray(table.coords).reshape(n, -1)
        spec = CohortSpec(name=name or Path(str(store)).stem, n_features=int(X.shape[1]),
                          coords_dim=1 if coords is None else coords.shape[1],
                          coords_meaning=_coords_meaning(coords, table.coords_names), chunk_rows=chunk_rows,
                          feature_columns=table.feature_names)
        try:
            root, _ = open_or_start_afresh(store, spec)
        except IngestError as error:
            raise type(error)(f"{error.reason}; store {store}", path=table.source) from error
        repair(root)
        n_committed = committed_bag_count(root)
        stored_ids = root["bags/id"][:n_committed].tolist()
        committed = dict(zip(stored_ids, root["bags/source"][:n_committed].tolist()))
        stored_labels = dict(zip(stored_ids, zip(root["bags/label"][:n_committed].tolist(),
                                                 root["bags/original_label"][:n_committed].tolist())))
        stored_stamps = dict(zip(stored_ids, root["bags/input_stamp"][:n_committed].tolist()))
        codes, ids = pd.factorize(np.asarray(table.bag_ids), sort=False)
        order = np.argsort(codes, kind="stable")
        offsets = np.concatenate([[0], np.cumsum(np.bincount(codes, minlength=len(ids)))])
        skipped, done, added, rows_added = [], [], [], 0
        labelled: dict[str, tuple[int, str]] = {}
        dropped: dict[str, int] = {}

        def bags() -> Iterator[BagData]:
            nonlocal rows_added
            for b, bag_id in enumerate(map(str, ids)):
                file_rows = order[offsets[b]:offsets[b + 1]]  # the bag's rows in the file
                rows = slice(file_rows[0], file_rows[-1] + 1) if file_rows[-1] - file_rows[0] == len(file_rows) - 1 else file_rows
                labels = _distinct_labels(np.asarray(table.labels[rows]))
                shown = [int(v) if isinstance(v, float) and v.is_integer() else v for v in labels if v is not None]
                if None in labels:
                    skipped.append(Skipped.from_error(MissingLabelError(
                        "empty bag label (a blank cell)" + (f" beside {shown}" if shown else ""), path=table.source, bag_id=bag_id)))
                    continue
                if len(labels) != 1 or labels[0] not in (UNKNOWN_LABEL, 0, 1):
                    skipped.append(Skipped.from_error(MissingLabelError(
                        f"bag label must be one of 0, 1, -1 and equal on all rows; got {shown}",
                        path=table.source, bag_id=bag_id)))
                    continue
                if table.original_labels is None:
                    original = "" if labels[0] == UNKNOWN_LABEL else encode_original_label(labels[0])
                else:
                    originals = {encode_original_label(v) for v in np.asarray(table.original_labels[rows], dtype=object)}
                    if len(originals) != 1:
                        skipped.append(Skipped.from_error(MissingLabelError(
                            f"original label must be equal on all rows of a bag; got {sorted(originals)}",
                            path=table.source, bag_id=bag_id)))
                        continue
                    original = originals.pop()
                features = np.asarray(X[rows])
                instance_coords = np.arange(len(features))[:, None] if coords is None else coords[rows]
                instance_labels = (np.full(len(features), UNKNOWN_LABEL) if table.instance_labels is None
                                   else np.asarray(table.instance_labels[rows]))
                stamp = rows_stamp(features, instance_coords, instance_labels)
                if bag_id in committed:  # done, unless the file now gives it other rows or labels
                    if not same_source(committed[bag_id], table.source) and stored_stamps[bag_id] != stamp:  # not it, moved
                        skipped.append(Skipped.from_error(DuplicateIdError(
                            f"bag id already in the store from {committed[bag_id]}{'' if stored_stamps[bag_id] else UNSTAMPED}",
                            path=table.source, bag_id=bag_id)))
                    elif change := rows_change(stored_stamps[bag_id], stamp):
                        skipped.append(Skipped.from_error(SourceChangedError(
                            f"bag already in the store, and its {change} differ from those ingested (the file changed, "
                            "or the columns it is read from). The store keeps what it has: ingest into a new store to use "
                            "the new rows", path=table.source, bag_id=bag_id)))
                    elif labels[0] != UNKNOWN_LABEL and stored_labels[bag_id][0] == UNKNOWN_LABEL:  # labelled since
                        labelled[bag_id] = (int(labels[0]), original)
                        done.append(bag_id)
                    elif labels[0] != UNKNOWN_LABEL and stored_labels[bag_id] != (int(labels[0]), original):
                        skipped.append(Skipped.from_error(LabelChangedError(
                            f"bag already in the store with label {stored_labels[bag_id][0]} (original "
                            f"{stored_labels[bag_id][1] or 'none'}); the file now gives {int(labels[0])} (original "
                            f"{original or 'none'}). The store keeps its label: ingest into a new store to relabel",
                            path=table.source, bag_id=bag_id)))
                    else:
                        done.append(bag_id)
                    continue
                with np.errstate(over="ignore"):  # float32 overflow is reported as infinite
                    stored = features.astype(FEATURE_DTYPE)
                bad_cells = [table.row_problems[r] for r in file_rows.tolist() if r in table.row_problems] if table.row_problems else []
                if bad_cells and nonfinite == "reject":
                    skipped.append(Skipped.from_error(BadValueError(
                        bad_cells[0] + (f" (and {len(bad_cells) - 1} more rows)" if len(bad_cells) > 1 else ""),
                        path=table.source, bag_id=bag_id)))
                    continue
                try:
                    keep = finite_rows(stored, nonfinite, path=table.source, bag_id=bag_id,
                                       file_rows=file_rows if table.lines is None else table.lines[file_rows],
                                       file_unit="row" if table.lines is None else "line", column_names=table.feature_names)
                except NonFiniteFeaturesError as error:
                    skipped.append(Skipped.from_error(error))
                    continue
                if keep is not None:
                    if not keep.any():
                        skipped.append(Skipped.from_error(NonFiniteFeaturesError(
                            f"all {len(keep)} instances have NaN or infinite features", path=table.source, bag_id=bag_id)))
                        continue
                    dropped[bag_id] = int((~keep).sum())
                    features, instance_coords, instance_labels = features[keep], instance_coords[keep], instance_labels[keep]
                added.append(bag_id)
                rows_added += len(features)
                ensure_still_held(store)  # each bag's rows: never written beside a writer that took the lease over
                yield BagData(bag_id=bag_id, label=int(labels[0]), source=table.source, features=features,
                              coords=instance_coords, instance_labels=instance_labels, original_label=original,
                              input_stamp=stamp)
            ensure_still_held(store)  # append_bags commits next

        append_bags(root, bags())
        ensure_still_held(store)
        label_unlabelled_bags(root, labelled)
        report = IngestReport(store=str(store), added=tuple(added), already_done=tuple(done), labelled=tuple(labelled),
                              skipped=tuple(skipped),
                              n_instances_added=rows_added, seconds=time.perf_counter() - started,
                              report_path=str(report_path or default_report_path(store)), dropped_nonfinite=dropped)
        from mil_core.persist import write_whole  # here: ingest processes do not import mil_core

        write_whole(report.report_path, json.dumps(report.to_json(), indent=1).encode())  # beside a shared store
        return report
