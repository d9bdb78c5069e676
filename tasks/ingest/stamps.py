"""What a bag's input was when it was ingested, so that a rerun can tell it changed.

A rerun finds a bag already committed from the same source and skips it as done. If the file was
re-extracted, replaced or edited since (another feature extractor with the same dimension, a
corrected slide, a series that gained slices), that skip would silently keep the old features. Each
bag therefore carries an *input stamp* (``bags/input_stamp`` in the store, JSON text):

- files (a slide, an ``.h5``, a bag's ``.npy`` files, a CT series' slices): the number of files,
  their total size, a digest of each file's name, size and modification time (``stat``) and a digest
  of each file's name, size and first and last :data:`SAMPLE_BYTES` (``content``). A rerun compares
  ``stat`` without reading; only when that differs (a copy, a ``touch``) does it read the samples
  and compare ``content``, so a copied, unchanged cohort is still done;
- a bag of a feature table (CSV, Parquet, ``.npz``): a digest of its rows (``rows``).

``""`` means no stamp (stores written before stamps, inputs that are not files): nothing to compare.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Sequence
from pathlib import Path

import numpy as np

SAMPLE_BYTES = 1 << 16


def _digest(parts: Sequence[bytes]) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _sample(path: str, size: int) -> bytes:
    """The first and last :data:`SAMPLE_BYTES` of a file (all of it when it is small)."""
    with open(path, "rb") as handle:
        if size <= 2 * SAMPLE_BYTES:
            return handle.read()
        head = handle.read(SAMPLE_BYTES)
        handle.seek(size - SAMPLE_BYTES)
        return head + handle.read(SAMPLE_BYTES)


def _stat_digest(paths: Sequence[str], stats: Sequence[os.stat_result]) -> str:
    return _digest([f"{Path(p).name}\0{s.st_size}\0{s.st_mtime_ns}".encode("utf-8", "surrogateescape")
                    for p, s in zip(paths, stats)])


def _content_digest(paths: Sequence[str], stats: Sequence[os.stat_result]) -> str:
    return _digest([f"{Path(p).name}\0{s.st_size}\0".encode("utf-8", "surrogateescape") + _sample(p, s.st_size)
                    for p, s in zip(paths, stats)])


def file_stamp(paths: Sequence[str]) -> str:
    """The stamp of a bag read from ``paths`` (in a fixed order); ``""`` if one is not a regular file."""
    try:
        stats = [os.stat(p) for p in paths]
    except OSError:
        return ""
    if not paths or not all(stat.S_ISREG(s.st_mode) for s in stats):
        return ""
    return json.dumps({"files": len(paths), "bytes": sum(s.st_size for s in stats),
                       "stat": _stat_digest(paths, stats), "content": _content_digest(paths, stats)})


def file_change(paths: Sequence[str], stamp: str) -> str | None:
    """How the files ``paths`` differ from what ``stamp`` recorded (a sentence), or None when they
    do not (or there is no stamp to compare)."""
    if not stamp:
        return None
    then = json.loads(stamp)
    if "stat" not in then:
        return "it was ingested from a table, not from files"
    try:
        stats = [os.stat(p) for p in paths]
        if len(paths) != then["files"]:
            return f"{then['files']} file(s) when ingested, {len(paths)} now"
        size = sum(s.st_size for s in stats)
        if size != then["bytes"]:
            return f"{then['bytes']} bytes when ingested, {size} now"
        if _stat_digest(paths, stats) == then["stat"] or _content_digest(paths, stats) == then["content"]:
            return None
    except OSError as error:
        return f"it cannot be read now ({error})"
    return "same size, other content"


def stamp_content(stamp: str) -> str:
    """The part of a stamp that depends on the input's content only (not on where it lies or when
    it was written): files' names, sizes and samples, or a table bag's rows; ``""`` for no stamp."""
    if not stamp:
        return ""
    then = json.loads(stamp)
    return then.get("content") or then.get("rows", "")


_ROW_PARTS = ("features", "coordinates", "instance labels")


def rows_stamp(features: np.ndarray, coords: np.ndarray, instance_labels: np.ndarray) -> str:
    """The stamp of a table bag from its rows: a digest of each array's dtype, shape and bytes, and
    of all three (``rows``)."""
    parts = {}
    for name, array in zip(_ROW_PARTS, (features, coords, instance_labels)):
        array = np.ascontiguousarray(array)
        parts[name] = _digest([f"{array.dtype.str}{array.shape}".encode(), array.tobytes()])
    return json.dumps({"rows": _digest([digest.encode() for digest in parts.values()]), **parts})


def rows_change(stamp: str, now: str) -> str | None:
    """Which of a table bag's row arrays differ between its stored ``stamp`` and ``now`` (both from
    :func:`rows_stamp`), or None when they do not (or there is no stored stamp)."""
    if not stamp or stamp == now:
        return None
    then, now_parts = json.loads(stamp), json.loads(now)
    if then.get("rows") == now_parts.get("rows"):
        return None
    if _ROW_PARTS[0] not in then:  # a stamp of the rows as a whole
        return "rows"
    return ", ".join(name for name in _ROW_PARTS if then[name] != now_parts[name])
