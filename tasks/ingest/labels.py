"""Bag labels from label files: lookup tables by bag id, attached to ingest items.

A labels table maps a bag id to a label or to the error that row gives (a duplicate id, an unusable
value); :func:`labelled_items` turns candidate inputs into :class:`IngestItem` s with their label and
reports the inputs without a usable label as :class:`Skipped`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from tasks.ingest.driver import IngestItem, Skipped
from tasks.ingest.errors import DuplicateIdError, IngestError, MissingLabelError
from tasks.store import UNKNOWN_LABEL


def label_lookup(table, id_column: str, label_of: Callable[[Any], int], path: str) -> dict[str, int | Exception]:
    """bag id → ``label_of(row)`` for each row of a labels table, or the error that row gives."""
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


def labelled_items(candidates: Iterable[tuple[str, str, Any]], labels: dict[str, int | Exception] | None,
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


def read_labels_csv(path: str | Path, **read_csv: Any):
    """A labels CSV as a DataFrame; an empty, header-only or unreadable file is an
    :class:`IngestError` naming the file and what is wrong (the whole run's labels are missing)."""
    import pandas as pd

    path = Path(path)
    try:
        if not path.read_bytes().strip():
            raise IngestError("the labels file is empty", path=str(path))
        table = pd.read_csv(path, **read_csv)
    except IngestError:
        raise
    except (OSError, UnicodeDecodeError, pd.errors.ParserError, pd.errors.EmptyDataError, ValueError) as error:
        raise IngestError(f"cannot read the labels CSV: {type(error).__name__}: {error}", path=str(path)) from None
    if table.empty:
        raise IngestError(f"the labels file has a header ({', '.join(map(str, table.columns))}) but no rows", path=str(path))
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


def read_panda_labels(path: str | Path) -> dict[str, int | Exception]:
    """image_id → 1 if ``isup_grade > 0`` else 0, from a PANDA-style CSV."""
    table = read_labels_csv(path, dtype={"image_id": str})
    if "isup_grade" not in table.columns:
        raise IngestError(f"labels CSV has no isup_grade column (columns: {list(table.columns)})", path=str(path))

    def label_of(row: dict) -> int:
        grade = float(row["isup_grade"])
        if not (grade == int(grade) and 0 <= grade <= 5):
            raise ValueError("isup_grade must be an integer 0..5")
        return int(grade > 0)

    return label_lookup(table, "image_id", label_of, str(path))
