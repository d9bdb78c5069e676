"""Bag labels from label files: lookup tables by bag id, attached to ingest items.

A labels table maps a bag id to a label or to the error that row gives (a duplicate id, an unusable
value); :func:`labelled_items` turns candidate inputs into :class:`IngestItem` s with their label and
reports the inputs without a usable label as :class:`Skipped`.

:class:`LabelSpec` says how a CSV/Parquet file gives the binary bag target: the id column, the label
column and either the positive values or a target expression such as ``isup_grade > 0`` or
``diagnosis in ['tumor', 'metastasis'] and not qc_fail`` (parsed, never evaluated as Python: only
column names, constants, comparisons, ``in``, ``and``/``or``/``not`` are accepted). Presets:
``panda`` (``image_id``, ``isup_grade > 0``). RSNA slice labels are read by :mod:`tasks.ingest.ct`.

The value of the label column itself (an ISUP grade, a class name) goes with each item as its
*original label* and is kept in the store beside the binary target (``bags/original_label``).
"""

from __future__ import annotations

import ast
import difflib
import operator
import os
import re
import sys
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.ingest.driver import IngestItem, Skipped
from tasks.ingest.errors import BlankLabelError, DuplicateIdError, IngestError, MissingLabelError
from tasks.store import UNKNOWN_LABEL, encode_original_label


def label_lookup(table, id_column: str, label_of: Callable[[Any], int], path: str,
                 label_columns: Sequence[str] = ()) -> dict[str, int | Exception]:
    """bag id → ``label_of(row)`` for each row of a labels table, or the error that row gives (a
    :class:`BlankLabelError` where every one of ``label_columns``, the cells the label is read from, is
    empty: a bag listed before its label is known)."""
    if id_column not in table.columns:
        raise IngestError(f"labels file has no column {id_column!r} (columns: {list(table.columns)})", path=path)
    labels: dict[str, int | Exception] = {}
    first: dict[str, tuple[int, dict]] = {}  # bag id → (its first row after the header, counted from 1; that row's values)
    for row, bag_id, value in zip(np.asarray(table.index) + 1, table[id_column].astype(str),
                                  table.drop(columns=[id_column]).to_dict("records")):
        if bag_id in first:
            if _same_row(first[bag_id][1], value):  # the same row twice (a copy-paste): one label
                continue
            labels[bag_id] = DuplicateIdError(f"bag id appears twice in the labels file with other values (rows {first[bag_id][0]} "
                                              f"and {row} after the header: {first[bag_id][1]} and {value})", path=path, bag_id=bag_id)
            continue
        first[bag_id] = (row, value)
        if label_columns and all(_is_missing(value.get(c)) or isinstance(value.get(c), str) and not value[c].strip()
                                 for c in label_columns):
            labels[bag_id] = BlankLabelError(f"no label yet: empty {', '.join(label_columns)} (row {row} after the header)",
                                             path=path, bag_id=bag_id)
            continue
        try:
            labels[bag_id] = label_of(value)
        except (KeyError, ValueError, TypeError) as error:
            labels[bag_id] = MissingLabelError(f"unusable label {value}: {error}", path=path, bag_id=bag_id)
    return labels


def _same_row(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two rows' values equal, empty cells equal to empty cells."""
    return a.keys() == b.keys() and all(x == y or _is_missing(x) and _is_missing(y) for x, y in zip(a.values(), b.values()))


def _empty(cells: Any) -> Any:
    """Which cells of a column are empty: missing, or text of spaces only."""
    return cells.isna() | cells.map(lambda v: isinstance(v, str) and not v.strip())


def without_blank_rows(table: Any, id_column: str, path: str) -> Any:
    """``table`` without its blank rows (a spreadsheet's export ends with some); a row that has
    values but no ``id_column`` belongs to no bag: an :class:`IngestError` naming its line."""
    empty = table.apply(_empty)
    no_id = empty[id_column] & ~empty.all(axis=1)
    if no_id.any():
        rows = [int(i) + 1 for i in table.index[no_id.to_numpy()]]  # counted from 1 after the header
        first = {k: v.item() if isinstance(v, np.generic) else v for k, v in table[no_id].iloc[0].items() if not _is_missing(v)}
        raise IngestError(f"row(s) {rows[:5]}{' …' if len(rows) > 5 else ''} after the header of the labels file have no "
                          f"{id_column} (row {rows[0]}: {first}): give each row its bag id, or delete the row", path=path)
    return table[~empty.all(axis=1)]


def labelled_items(candidates: Iterable[tuple[str, str, Any]], labels: dict[str, int | Exception] | None,
                    labels_path: str | None, originals: dict[str, Any] | None = None,
                    keep_unlabelled: bool = False) -> tuple[list[IngestItem], list[Skipped]]:
    """Attach bag labels (-1 without a labels table) and original labels (``originals``: bag id →
    the labels file's value); badly labelled bags are skipped, and so are bags the labels do not
    list unless ``keep_unlabelled`` (a cohort to predict: they are predicted, unlabelled, as are bags
    whose row leaves the label empty). A bag
    whose id the labels give but for spaces, a suffix or letter case (``s1.svs`` or ``S1`` for
    ``s1``) is skipped naming it either way: kept unlabelled, its label was lost without a word."""
    originals = originals or {}
    items, skipped = [], []
    candidates = list(candidates)
    near_ids: dict[str, Any] | None = None  # near_rows of the labels, built at the first miss
    composed: dict[str, Any] | None = None  # labels' ids in Unicode NFC, built at the first miss
    for bag_id, source, payload in candidates:
        if labels is None:
            items.append(IngestItem(bag_id, source, UNKNOWN_LABEL, payload))
            continue
        key = bag_id
        if key not in labels:  # 'é' as one code point in the CSV, as e + accent in a macOS file name: the same id
            composed = {unicodedata.normalize("NFC", str(k)): k for k in labels} if composed is None else composed
            key = composed.get(unicodedata.normalize("NFC", bag_id), bag_id)
        label = labels.get(key)
        if label is None:
            if near_ids is None:
                near_ids = near_rows(labels, {_nfc(bag) for bag, _, _ in candidates})
            near = near_ids.get(_nfc(bag_id).casefold())
            if near is None and Path(bag_id).suffix and Path(bag_id).stem in labels:  # 'x.ome' (x.ome.tif), labels 'x'
                near = Path(bag_id).stem
            if near is None and keep_unlabelled:  # a bag the labels do not list: predicted, unlabelled
                items.append(IngestItem(bag_id, source, UNKNOWN_LABEL, payload))
                continue
            hint = (f" (it has {near!r}: ids must equal the file stem, in its case, without spaces or suffixes)"
                    if near is not None else
                    f" (its ids look like {', '.join(repr(k) for k in list(labels)[:2])})" if labels else "")
            label = MissingLabelError(f"no label in {labels_path}{hint}", path=source, bag_id=bag_id)
        if isinstance(label, BlankLabelError) and keep_unlabelled:  # listed before its label is known: predicted, unlabelled
            items.append(IngestItem(bag_id, source, UNKNOWN_LABEL, payload))
        elif isinstance(label, Exception):
            skipped.append(Skipped.from_error(label, IngestItem(bag_id, source, UNKNOWN_LABEL)))
        else:
            items.append(IngestItem(bag_id, source, int(label), payload, encode_original_label(originals.get(key))))
    return items, skipped


def _nfc(text: str) -> str:
    return unicodedata.normalize("NFC", str(text))


def near_rows(labels: dict[str, Any], present: set[str]) -> dict[str, Any]:
    """The labels id a bag is told it has when its own id has no row (:func:`labelled_items`' hint):
    by the bag id case folded (NFC), the first row in file order whose stem without spaces is that
    id but for case, a suffix or spaces, and which names no ``present`` bag (NFC) itself — 'Case7'
    labels Case7.h5, not case7.h5 beside it."""
    near: dict[str, Any] = {}
    for k in labels:
        if _nfc(k) not in present:
            near.setdefault(_nfc(Path(str(k).strip()).stem).casefold(), k)
    return near


def ids_without_input(labels: dict[str, Any], present: Iterable[str]) -> list[str]:
    """The labels' ids that name no input of ``present`` (a folder's slide or file ids), compared in
    Unicode NFC; an id that is a present one but for spaces or a suffix, or the near id
    (:func:`near_rows`) of a present bag without a row of its own, is said by :func:`labelled_items`
    already (its near-id hint), not again, nor is one that a present id is but for a suffix (``x``
    of ``x.ome.tif``'s id ``x.ome``)."""
    present = list(present)
    found = {_nfc(j) for i in present for j in (i, Path(i).stem)}
    labelled = {_nfc(k) for k in labels}
    near = near_rows(labels, {_nfc(i) for i in present})
    hinted = {near[key] for name in found if name not in labelled and (key := name.casefold()) in near}
    return [bag_id for bag_id in labels
            if not {_nfc(bag_id), _nfc(Path(bag_id.strip()).stem)} & found and bag_id not in hinted]


def labelled_bags_without_file(labels: dict[str, Any], present: Iterable[str], labels_from: Any, folder: str | Path,
                               suffix: str) -> list[Skipped]:
    """A skipped entry for each bag the labels give whose feature file ``<id><suffix>`` is not among
    ``present`` (a folder's file ids): a labelled bag whose features are missing is said, not dropped."""
    return [Skipped(path=str(Path(folder) / f"{bag_id}{suffix}"), bag_id=bag_id, error="UnreadableFileError",
                    reason=f"listed in {labels_from} but no feature file {bag_id}{suffix} in {folder}")
            for bag_id in ids_without_input(labels, present)]


def check_instance_labels(values: np.ndarray, source: str, what: str) -> None:
    """Instance labels (``what``: where they come from) are 0, 1 or -1 (unknown); anything else —
    text, 2, a missing value — would be stored as a wrong label (the store keeps int8): refused
    naming the first row."""
    numeric = values.dtype.kind in "biuf"
    bad = (np.flatnonzero(~np.isin(values, (-1, 0, 1))) if numeric
           else np.arange(values.shape[0]))
    if bad.size:
        value = values[bad[0]].item() if isinstance(values[bad[0]], np.generic) else values[bad[0]]
        raise MissingLabelError(f"{what} must be 0, 1 or -1 (unknown); row {bad[0]} holds {value!r} "
                                f"({bad.size} such row(s))", path=source)


def read_labels_csv(path: str | Path, **read_csv: Any):
    """A labels CSV as a DataFrame; an empty, header-only or unreadable file is an
    :class:`IngestError` naming the file and what is wrong (the whole run's labels are missing)."""
    import pandas as pd

    path = Path(path)
    try:
        head = path.read_bytes()
        if not head.strip():
            raise IngestError("the labels file is empty", path=str(path))
        if head.startswith((b"PK\x03\x04", b"\xd0\xcf\x11\xe0")):  # a zip (.xlsx, .ods) or an old .xls
            raise IngestError("the labels file is a spreadsheet workbook, not text: save it as CSV UTF-8 (comma "
                              "separated), or give a Parquet file", path=str(path))
        if head.startswith((b"\xff\xfe", b"\xfe\xff")):
            raise IngestError("the labels file is UTF-16 text (a spreadsheet's 'Unicode text'): save it as CSV UTF-8",
                              path=str(path))
        table = pd.read_csv(path, **read_csv)
    except IngestError:
        raise
    except UnicodeDecodeError as error:
        raise IngestError(f"the labels file is not UTF-8 text (byte {error.object[error.start:error.start + 1]!r} at "
                          f"{error.start}; a spreadsheet saved in a Windows encoding?): save it as CSV UTF-8",
                          path=str(path)) from None
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as error:
        raise IngestError(f"cannot read the labels CSV: {type(error).__name__}: {error}", path=str(path)) from None
    if table.empty:
        raise IngestError(f"the labels file has a header ({', '.join(map(str, table.columns))}) but no rows", path=str(path))
    if len(table.columns) == 1 and read_csv.get("sep", ",") == ",":
        for separator, looks in ((";", "semicolon-separated (as a spreadsheet in some locales saves it)"),
                                 ("\t", "tab-separated")):
            if separator in str(table.columns[0]):
                raise IngestError(f"the labels file has one column {table.columns[0]!r}: it looks {looks}; save it "
                                  "comma-separated" + (", or name it .tsv" if separator == "\t" else ""), path=str(path))
    return table


_NUMBER = r"^\s*[-+]?\d+(?:\.\d*)?\s*$"


def numbers_as_numbers(table, id_column: str):
    """``table`` with each text cell that spells a number (``"3"``, ``" 1.0"``) as that number,
    outside ``id_column``: one text cell (``pending``) makes pandas read a whole column as text, and
    its ``1`` then differed from the ``1`` stored by the previous run (every bag a 'label changed'),
    and ``grade >= 2`` failed on every row."""
    import pandas as pd

    table = table.copy()
    for column in table.columns:
        cells = table[column]
        if column == id_column or not (pd.api.types.is_object_dtype(cells) or pd.api.types.is_string_dtype(cells)):
            continue
        spelled = cells.map(lambda v: isinstance(v, str)) & cells.astype(str).str.match(_NUMBER)
        if spelled.any():
            table[column] = cells.astype(object).where(~spelled, cells[spelled].map(_spelled_number))
    return table


def split_undecodable(paths: Iterable[Path]) -> tuple[list[Path], list[Skipped]]:
    """Paths whose names are valid UTF-8, and a :class:`Skipped` entry for each other one (its name
    shown with the undecodable bytes escaped): one such file never aborts the run."""
    good, skipped = [], []
    for path in paths:
        try:
            str(path).encode("utf-8")
            good.append(path)
        except UnicodeEncodeError:
            shown = os.fsencode(path).decode("utf-8", "backslashreplace")  # the undecodable bytes as \xNN
            skipped.append(Skipped(path=shown, bag_id=None, error="UnreadableFileError",
                                   reason="the file name is not valid UTF-8; rename the file"))
    return good, skipped


def binary(value: Any) -> int:
    """``value`` as a 0/1 label (a ValueError for anything else)."""
    number = float(value)
    if number not in (0.0, 1.0):
        raise ValueError("label must be 0 or 1")
    return int(number)


def read_panda_labels(path: str | Path) -> tuple[dict[str, int | Exception], dict[str, Any]]:
    """image_id → 1 if ``isup_grade > 0`` else 0 (or the row's error), and image_id → its ISUP
    grade (the original label), from a PANDA-style CSV."""
    table = numbers_as_numbers(read_labels_csv(path, dtype={"image_id": str}), "image_id")
    if "image_id" in table.columns:
        table = without_blank_rows(table, "image_id", str(path))
    if "isup_grade" not in table.columns:
        raise IngestError(f"labels CSV has no isup_grade column (columns: {list(table.columns)}): a slides labels file "
                          "is read as PANDA's (image_id, isup_grade) unless ingest.labels is a section naming its columns, "
                          "e.g. {file: …, id_column: slide_id, label_column: label}", path=str(path))

    def label_of(row: dict) -> int:
        grade = float(row["isup_grade"])
        if not (grade == int(grade) and 0 <= grade <= 5):
            raise ValueError("isup_grade must be an integer 0..5")
        return int(grade > 0)

    return (label_lookup(table, "image_id", label_of, str(path), ["isup_grade"]),
            dict(zip(table["image_id"].astype(str), table["isup_grade"])))


# ------------------------------------------------------------------------------ label specs
_COMPARE = {ast.Gt: operator.gt, ast.GtE: operator.ge, ast.Lt: operator.lt, ast.LtE: operator.le,
            ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.In: lambda a, b: a in b,
            ast.NotIn: lambda a, b: a not in b}


class TargetExpression:
    """A binary target computed from a labels row: ``isup_grade > 0``, ``label in ['tumor']``,
    ``a >= 2 and b == 'x'``, ``not normal``. Parsed with :mod:`ast` and interpreted node by node
    (no ``eval``); anything else (calls, attributes, arithmetic, subscripts) is refused."""

    def __init__(self, text: str):
        self.text = text
        try:
            self._tree = ast.parse(text, mode="eval").body
        except SyntaxError as error:
            raise ValueError(f"target {text!r}: not an expression ({error.msg})") from None
        self.columns = sorted(self._check(self._tree))
        self.truth_columns = sorted(self._read_as_truth(self._tree))

    def _read_as_truth(self, node: ast.AST) -> set[str]:
        """The columns the expression takes as true/false themselves (``not qc_fail``, ``a and b``,
        a bare ``tumor``), where a text is true whenever it is not empty: ``'no'`` too."""
        if isinstance(node, ast.Name):
            return {node.id}
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            return self._read_as_truth(node.operand)
        if isinstance(node, ast.BoolOp):
            return set().union(*(self._read_as_truth(v) for v in node.values))
        return set()

    def _check(self, node: ast.AST) -> set[str]:
        if isinstance(node, ast.Name):
            return {node.id}
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool)) or \
                isinstance(node, ast.Constant) and node.value is None:
            return set()
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return set().union(*(self._check(e) for e in node.elts)) if node.elts else set()
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub)):
            return self._check(node.operand)
        if isinstance(node, ast.BoolOp):
            return set().union(*(self._check(v) for v in node.values))
        if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
            return set().union(self._check(node.left), *(self._check(c) for c in node.comparators))
        raise ValueError(f"target {self.text!r}: {type(node).__name__} is not allowed (use column names, constants, "
                         "comparisons, in, and/or/not)")

    def _value(self, node: ast.AST, row: dict[str, Any]) -> Any:
        if isinstance(node, ast.Name):
            if node.id not in row:
                raise KeyError(f"no column {node.id!r}")
            return row[node.id]
        if isinstance(node, ast.Constant):  # '01' as the file's '01', which numbers_as_numbers read as 1
            return _spelled_number(node.value)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return [self._value(e, row) for e in node.elts]
        if isinstance(node, ast.UnaryOp):
            return (not self._truth(node.operand, row)) if isinstance(node.op, ast.Not) else -self._value(node.operand, row)
        if isinstance(node, ast.BoolOp):
            values = (self._truth(v, row) for v in node.values)
            return all(values) if isinstance(node.op, ast.And) else any(values)
        left = self._value(node.left, row)
        for op, comparator in zip(node.ops, node.comparators):
            right = self._value(comparator, row)
            if isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)) and (near := _near_miss(left, right)):
                raise ValueError(f"{near[0]!r} differs from {near[1]!r} in the target only in case or spaces: correct the "
                                 "labels file, or write the target with the value it holds")
            if not _COMPARE[type(op)](*_booleans_beside_text(left, right)):
                return False
            left = right
        return True

    def _truth(self, node: ast.AST, row: dict[str, Any]) -> bool:
        """A value taken as true/false: a text (``'no'``, ``'pending'``, ``' '``) is refused for the
        row, where Python would read any non-empty text as true."""
        value = self._value(node, row)
        if isinstance(value, str):
            name = node.id if isinstance(node, ast.Name) else ast.unparse(node)
            raise ValueError(f"{name} is {value!r}, text where the target takes a true/false value: compare it "
                             f"(e.g. {name} == {value!r})")
        return bool(value)

    def __call__(self, row: dict[str, Any]) -> int:
        missing = [c for c in self.columns if _is_missing(row.get(c))]
        if missing:
            raise ValueError(f"empty {', '.join(missing)}")
        return int(self._truth(self._tree, row))


def _near_miss(left: Any, right: Any) -> tuple[str, str] | None:
    """Two texts (or a text and one of a list's) that are not equal but are once case and
    surrounding spaces are ignored: 'Tumor' or 'tumor ' against 'tumor', a typo that would
    otherwise count as another class."""
    rights = right if isinstance(right, list) else [right]
    for a in left if isinstance(left, list) else [left]:
        if isinstance(a, str) and a not in rights:  # an exact match anywhere ('Tumor' listed too) is no typo
            for b in rights:
                if isinstance(b, str) and a.strip().casefold() == b.strip().casefold():
                    return a, b
    return None


def _booleans_beside_text(left: Any, right: Any) -> tuple[Any, Any]:
    """The text ``'true'``/``'false'`` (any case) compared with a True/False cell, or a True/False
    constant with such a text cell, as that boolean: ``tumor == 'true'`` over a True/False column
    was False for every row (a bag never positive, unsaid). Other pairs as they are."""
    def as_bool(value: Any, other: Any) -> Any:
        others = other if isinstance(other, list) else [other]
        if isinstance(value, str) and (truth := _true_false(value)) is not None \
                and any(isinstance(o, (bool, np.bool_)) for o in others):
            return truth
        return value

    if isinstance(right, list):
        return as_bool(left, right), [as_bool(v, left) for v in right]
    return as_bool(left, right), as_bool(right, left)


def _true_false(value: Any) -> bool | None:
    """A True/False value, or the text ``true``/``false`` in any case, as that boolean; else None."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, str) and value.strip().casefold() in ("true", "false"):
        return value.strip().casefold() == "true"
    return None


def _spelled_number(value: Any) -> Any:
    """A text that spells a number (``"01"``, ``" 1.0"``) as that number, as :func:`numbers_as_numbers`
    reads a labels file's cells; anything else as it is."""
    if isinstance(value, str) and re.match(_NUMBER, value):
        try:
            return int(value)  # exactly: a 17-digit code is no float
        except ValueError:
            number = float(value)
            return int(number) if number.is_integer() else number
    return value


def _label_text(value: Any) -> str:
    """A label value as ``positive`` compares it: numbers by value (``1``, ``1.0`` and ``"01"`` are
    ``"1"``; TCGA's sample type ``01`` is read as the number 1), booleans and ``true``/``false`` as
    ``"1"``/``"0"``, other text as it is."""
    if (truth := _true_false(value)) is not None:
        return str(int(truth))
    value = _spelled_number(value)
    if isinstance(value, (int, np.integer)):
        return str(int(value))
    if isinstance(value, (float, np.floating)):  # str(): the shortest text of its precision (float32 0.1 is '0.1')
        return str(int(value)) if float(value).is_integer() else str(value)
    return str(value)


def _is_missing(value: Any) -> bool:
    """None, NaN, or pandas' NA/NaT: a blank in a nullable column (``Int64``, ``string``), as parquet
    files give them (only there once pandas is imported)."""
    if value is None or isinstance(value, float) and value != value:
        return True
    pandas = sys.modules.get("pandas")
    return pandas is not None and (value is pandas.NA or value is pandas.NaT)


@dataclass(frozen=True)
class LabelSpec:
    """How a labels file gives each bag's binary target; ``preset="panda"`` fills in PANDA's columns."""

    file: str
    id_column: str = "slide_id"
    label_column: str = "label"
    positive: Sequence[Any] | None = None
    target: str | None = None

    @classmethod
    def preset(cls, name: str, file: str | Path) -> LabelSpec:
        if name == "panda":
            return cls(str(file), id_column="image_id", label_column="isup_grade", target="isup_grade > 0")
        raise ValueError(f"unknown labels preset {name!r} (known: panda; RSNA CT labels: ingest.kind ct)")

    def label_of(self) -> Callable[[dict[str, Any]], int]:
        if self.target is not None:
            return TargetExpression(self.target)
        if self.positive is not None:
            positives = {_label_text(v) for v in self.positive}
            folded = {p.strip().casefold(): p for p in positives}  # 'Tumor', 'tumor ' are typos, not negatives
            column = self.label_column

            def in_positives(row: dict[str, Any]) -> int:
                if _is_missing(row[column]):
                    raise ValueError(f"empty {column}")
                text = _label_text(row[column])
                if text not in positives and text.strip().casefold() in folded:
                    raise ValueError(f"{column} {text!r} differs from the positive value {folded[text.strip().casefold()]!r} "
                                     "only in case or spaces: correct it, or list it under positive")
                return int(text in positives)
            return in_positives
        column = self.label_column

        def zero_or_one(row: dict[str, Any]) -> int:
            if _is_missing(row[column]) or isinstance(row[column], str) and not row[column].strip():
                raise ValueError(f"empty {column}")
            return binary(row[column])
        return zero_or_one

    def _check_some_positive(self, column, path: str) -> None:
        """A ``positive`` list that no row matches because it is spelled otherwise (``tumour`` for
        ``tumor``) or because the file holds 0/1 made every bag negative without a word; a file
        whose rows are all of other classes (a cohort without positives) is fine."""
        values = {_label_text(v) for v in column if not _is_missing(v)}
        positives = [_label_text(v) for v in self.positive]
        if values & set(positives) or not values:
            return
        close = {p: difflib.get_close_matches(p.casefold(), {v.casefold(): v for v in values}, n=1, cutoff=0.75)
                 for p in positives}
        if values <= {"0", "1"} and not set(positives) <= {"0", "1"}:
            reason = "holds 0/1 labels: drop positive (0/1 are read as they are) or give the file's values"
        elif any(close.values()):
            p, (v,) = next((p, v) for p, v in close.items() if v)
            reason = f"has {next(x for x in values if x.casefold() == v)!r}, not {p!r}: correct positive (or the file)"
        else:
            return
        raise IngestError(f"no row's {self.label_column} is one of positive {positives}; the column {reason}. Every bag "
                          "would have been negative", path=path)

    def _check_binary(self, column: Any, path: str) -> None:
        """A label column read as 0/1 that holds another labelling as a whole — grades 0–5, −1/+1,
        class names, scores in more than one row — is refused with the ``target``/``positive`` that
        reads it, before any bag is ingested (bag by bag, the bags of every other value were skipped
        and the run trained on the rest); one odd cell among 0/1 (a typo ``2``, ``pending``) and
        ``-1`` (unknown) leave their bags skipped as before."""
        values = [v for v in column if not _is_missing(v)]
        numeric = [float(v) for v in values if isinstance(v, (int, float, np.number)) and not isinstance(v, bool)]
        numbers = set(numeric)
        texts = sorted({str(v) for v in values if isinstance(v, str)})
        odd_rows = sum(v not in (-1.0, 0.0, 1.0) for v in numeric)  # -1 (unknown) and one typo: their bags skipped
        name, hint = self.label_column, None
        if numbers and not texts and (numbers == {-1.0, 1.0} or odd_rows > 1):
            if numbers == {-1.0, 1.0}:
                hint = f"-1/+1 labels: give target: \"{name} == 1\""
            elif all(v.is_integer() and v >= 0 for v in numbers):
                hint = (f"grades {sorted(int(v) for v in numbers)} (ISUP, Gleason, a class index): give target, e.g. "
                        f"\"{name} > 0\" (any grade positive) or \"{name} >= 2\"")
            else:
                hint = f"values {sorted(numbers)[:6]}: give target, e.g. \"{name} > 0.5\""
        elif texts and not numbers:
            hint = f"text {texts[:6]}: give positive, the value(s) that mark a positive bag (positive: [<one of them>]), or a target"
        if hint is not None:
            raise IngestError(f"the label column {name!r} must hold 0/1 when labels gives neither target nor positive; "
                              f"it holds {hint} in the labels section (ingest.labels: {{file: …, target: …}})", path=path)

    def _check_truth_columns(self, table: Any, columns: Sequence[str], path: str) -> None:
        """A column of text that the target takes as true/false (``qc_fail`` of ``yes``/``no``) is
        refused before any bag is read: every non-empty text is true, so ``not qc_fail`` made every
        bag negative without a word. One text cell in a 0/1 column fails its row only."""
        for column in columns:
            values = [v for v in table[column] if not _is_missing(v)]
            if values and all(isinstance(v, str) for v in values):
                texts = sorted(set(values))
                raise IngestError(f"target {self.target!r} takes the column {column!r} as true/false, but it holds text "
                                  f"{texts[:4]} (every non-empty text would be true): compare it, e.g. "
                                  f"\"{column} == {texts[-1]!r}\"", path=path)

    def describe(self) -> dict[str, Any]:
        """Where the labels come from, as the store records it (``labels`` attribute): the original
        labels of two ingests into one store must mean the same (same column, target, positives)."""
        return {"file": str(self.file), "id_column": self.id_column, "column": self.label_column,
                "target": self.target, "positive": None if self.positive is None else list(self.positive)}

    def read(self) -> tuple[dict[str, int | Exception], dict[str, Any]]:
        """bag id → 0/1 (or the row's error), and bag id → the original value of ``label_column``."""
        import pandas as pd

        path, suffix = str(self.file), Path(str(self.file)).suffix.lower()  # LABELS.PARQUET was read as a CSV
        if suffix == ".parquet":
            try:
                table = pd.read_parquet(path)
                if not isinstance(table.index, pd.RangeIndex):  # saved with its index (set_index('slide_id')): a column
                    table = table.reset_index(drop=all(name is None or name in table.columns for name in table.index.names))
            except Exception as error:
                raise IngestError(f"cannot read labels file: {type(error).__name__}: {error}", path=path) from error
        else:
            table = read_labels_csv(path, dtype={self.id_column: str}, sep="\t" if suffix == ".tsv" else ",")
        table = numbers_as_numbers(table, self.id_column)
        if self.id_column in table.columns:
            table = without_blank_rows(table, self.id_column, path)
        label_of = self.label_of()
        needed = [self.label_column] if self.target is None else list(getattr(label_of, "columns", []))
        absent = [c for c in needed if c not in table.columns]
        if absent:
            raise IngestError(f"labels file has no column(s) {absent} (columns: {list(table.columns)})", path=path)
        if self.target is None and self.positive is not None:
            self._check_some_positive(table[self.label_column], path)
        if self.target is None and self.positive is None:
            self._check_binary(table[self.label_column], path)
        if self.target is not None:
            self._check_truth_columns(table, label_of.truth_columns, path)
        labels = label_lookup(table, self.id_column, label_of, path, needed)
        original = (dict(zip(table[self.id_column].astype(str), table[self.label_column]))
                    if self.label_column in table.columns else {})
        return labels, original
