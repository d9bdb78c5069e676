"""CLAM/TRIDENT per-slide feature files: ``<slide_id>.h5`` with datasets ``features`` (N, D) or
(1, N, D) and ``coords`` (N, 2), the level-0 pixel (x, y) of each patch's top-left corner. Files
without ``coords`` make a cohort without positions (``coords_meaning`` ``instance_index``: no
heatmaps, no GeoJSON); one cohort does not mix the two.

Each file is one bag (bag id = file stem), labelled from a labels CSV; the workers copy a file into
the store ``batch_rows`` rows at a time through the parallel, resumable ingest driver.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from tasks.ingest.driver import IngestReport, Skipped, existing_attrs, ingested_from_elsewhere, run_ingest, summarise_left_out
from tasks.ingest.errors import FeatureDimensionError, IngestError, UnreadableFileError
from tasks.ingest.labels import LabelSpec, labelled_bags_without_file, labelled_items
from tasks.store import CohortSpec, NonFinitePolicy, non_integer_coords

H5_SUFFIXES = (".h5", ".hdf5")
"""Feature files of a folder, in any case (``slide.H5``)."""

H5_COORDS_MEANING = "x,y (level-0 pixels, as in the .h5)"
"""``coords_meaning`` of a cohort of ``.h5`` files with ``coords``."""


def _own_data(handle, name: str, path: str):
    """``handle[name]``, refused when its values live outside this file: an external link, a
    dataset with external raw storage or a virtual dataset read another file on this machine
    (whose bytes would land in the shared store as features or coordinates)."""
    item = handle[name]
    if item.file.filename != handle.filename:
        raise UnreadableFileError(f"{name!r} links to {item.file.filename}: a feature file holds its own data", path=path)
    if hasattr(item, "shape") and (item.external or item.is_virtual):
        where = "is a virtual dataset" if item.is_virtual else f"keeps its values in {[e[0] for e in item.external]}"
        raise UnreadableFileError(f"{name!r} {where}: a feature file holds its own data", path=path)
    return item


def _h5_features(handle, path: str):
    if "features" not in handle:
        raise UnreadableFileError("h5 file has no 'features' dataset", path=path)
    features = _own_data(handle, "features", path)
    if not hasattr(features, "shape"):
        raise UnreadableFileError(f"'features' is an h5 group (holding {sorted(features)[:5]}), not a dataset of "
                                  "(N, D) features", path=path)
    if features.ndim == 3 and features.shape[0] == 1:  # TRIDENT/CLAM batch dimension
        return features, True
    if features.ndim != 2:
        raise FeatureDimensionError(f"'features' has shape {features.shape}; expected (N, D)", path=path)
    return features, False


def _pixel_coords(xy: np.ndarray, first_row: int, path: str) -> np.ndarray:
    """Patch corners as whole pixels within int32: a NaN was stored as -2147483648, 255.9 as 255 and
    2**31 + 5 as -2147483643."""
    bad = np.flatnonzero(non_integer_coords(xy).any(axis=1))
    if bad.size:
        raise FeatureDimensionError(f"'coords' row {first_row + int(bad[0])} is {xy[bad[0]].tolist()}: patch corners "
                                    f"are whole level-0 pixels within int32 ({bad.size} such row(s))", path=path)
    return xy


def h5_feature_dim(path: str | Path) -> int:
    """Feature dimension D of a CLAM/TRIDENT ``.h5`` file."""
    return h5_layout(path)[0]


def h5_layout(path: str | Path) -> tuple[int, bool]:
    """Feature dimension D of a CLAM/TRIDENT ``.h5`` file and whether it has patch ``coords``."""
    import h5py

    try:
        with h5py.File(path, "r") as handle:
            return int(_h5_features(handle, str(path))[0].shape[-1]), "coords" in handle
    except IngestError:
        raise
    except Exception as error:
        raise UnreadableFileError(f"cannot read h5: {type(error).__name__}: {error}", path=str(path)) from error


def h5_patch_side(path: str | Path) -> float | None:
    """A file's patch side in level-0 pixels from its ``coords`` attributes, where they say it:
    TRIDENT's ``patch_size_level0``, or CLAM's ``patch_size`` times its level's ``downsample`` (or
    at ``patch_level`` 0); None for a file without them, with one that is no number (TRIDENT
    writes a missing value as the text ``'None'``), or no longer readable."""
    import h5py

    try:
        with h5py.File(path, "r") as handle:
            attrs = dict(handle["coords"].attrs) if "coords" in handle else {}
    except Exception:  # moved or gone since the ingest: the report infers the side from the coordinates
        return None

    def number(name: str, default: float | None = None) -> float | None:
        try:
            return float(np.ravel(attrs[name])[0]) if name in attrs else default
        except (TypeError, ValueError, IndexError):  # 'None', b'', an empty array: said by no number
            return None

    size, downsample, level = number("patch_size"), number("downsample"), number("patch_level", -1.0)
    if "patch_size_level0" in attrs:
        side = number("patch_size_level0")
    elif size is not None and downsample is not None:
        side = size * downsample
    elif size is not None and level == 0:
        side = size
    else:
        return None
    return side if side is not None and np.isfinite(side) and side > 0 else None


def h5_bag_writer(item, writer, *, batch_rows: int = 65536, with_coords: bool = True) -> None:
    """Ingest worker: copy ``features`` and ``coords`` of one ``.h5`` file (``with_coords=False``:
    a cohort without positions, whose instances keep their index in the bag)."""
    import h5py

    try:
        with h5py.File(item.source, "r") as handle:
            features, batched = _h5_features(handle, item.source)
            n = features.shape[-2]
            if n == 0:
                raise FeatureDimensionError(f"'features' has shape {features.shape}: no patch", path=item.source)
            if ("coords" in handle) != with_coords:
                raise FeatureDimensionError(
                    "no 'coords' dataset, but this cohort's files have patch positions" if with_coords else
                    "a 'coords' dataset, but this cohort was made from files without patch positions (no heatmaps "
                    "or GeoJSON); ingest files of one kind into one store", path=item.source)
            coords = _own_data(handle, "coords", item.source) if with_coords else None
            coords_batched = coords is not None and coords.ndim == 3 and coords.shape[0] == 1  # (1, N, 2), like features
            if coords is not None and coords.shape[int(coords_batched)] != n:
                raise FeatureDimensionError(f"'coords' of shape {coords.shape} for {n} feature rows", path=item.source)
            for start in range(0, n, batch_rows):
                rows = slice(start, min(n, start + batch_rows))
                block = features[0, rows] if batched else features[rows]
                xy = (np.arange(rows.start, rows.stop)[:, None] if coords is None else
                      _pixel_coords(np.asarray(coords[0, rows] if coords_batched else coords[rows]).reshape(len(block), -1),
                                    start, item.source))
                writer.write(np.asarray(block, dtype=np.float32), xy, np.full(len(block), -1, dtype=np.int8))
    except IngestError:
        raise
    except Exception as error:
        raise UnreadableFileError(f"cannot read h5: {type(error).__name__}: {error}", path=item.source) from error


def _feature_folders_below(folder: Path) -> str:
    """Where the ``.h5`` files are when ``folder`` holds none (a CLAM or TRIDENT job folder given in
    place of its ``h5_files`` or ``features_<encoder>`` folder), and that ``.pt`` files are not read."""
    holding = Counter(p.parent for pattern in ("*/*", "*/*/*") for p in folder.glob(pattern)
                      if p.suffix.lower() in H5_SUFFIXES and p.is_file())
    hint = ""
    if holding:
        named = ", ".join(f"{p.relative_to(folder)} ({holding[p]} files)" for p in sorted(holding)[:4])
        hint += f"; .h5 files are in its sub-folder(s) {named}: give that folder (CLAM's h5_files, TRIDENT's features_<encoder>)"
    if any(folder.glob("*.pt")) or any(folder.glob("*/*.pt")):
        hint += "; .pt feature files (CLAM's pt_files) are not read: give the .h5 files written beside them"
    return hint


def ingest_h5_features(store: str | Path, files: str | Path | Sequence[str | Path], labels_csv: str | Path | None,
                       *, id_column: str = "slide_id", label_column: str = "label",
                       positive: Sequence[Any] | None = None, target: str | None = None, name: str | None = None,
                       slides: str | Path | None = None, client: Any = None, max_workers: int = 1,
                       report_path: str | Path | None = None, nonfinite: NonFinitePolicy = "reject",
                       keep_unlabelled: bool = False) -> IngestReport:
    """Ingest CLAM/TRIDENT per-slide ``.h5`` feature files (a folder or a list); bag id = file stem.

    Labels: ``labels_csv`` with ``id_column`` and ``label_column``; the label is 1 for values in
    ``positive`` (e.g. ``["tumor"]``), or where the ``target`` expression holds (``grade > 2``),
    else the column must hold 0/1 (:class:`tasks.ingest.labels.LabelSpec`). Without a CSV the bags
    are unlabelled (-1); files the CSV does not list are skipped, or unlabelled with ``keep_unlabelled``. ``slides``: the folder of the slides the features came from (optional;
    found by file stem, used for heatmap backgrounds).
    """
    listed = isinstance(files, (str, Path))
    paths = (sorted(p for p in Path(files).iterdir() if p.suffix.lower() in H5_SUFFIXES and p.is_file()
                    and not p.name.startswith(".")) if listed else [Path(f) for f in files])
    labels, originals, described = None, None, None
    if labels_csv is not None:
        label_spec = LabelSpec(str(labels_csv), id_column, label_column, positive, target)
        (labels, originals), described = label_spec.read(), label_spec.describe()
    items, skipped = labelled_items(((p.stem, str(p), None) for p in paths), labels,
                                     None if labels_csv is None else str(labels_csv), originals, keep_unlabelled)
    if listed and labels is not None:
        skipped += labelled_bags_without_file(labels, [p.stem for p in paths] + ingested_from_elsewhere(store, files),
                                              labels_csv, files, ".h5")
    existing = existing_attrs(store)
    n_features, with_coords = (None, None) if existing is None else (int(existing["n_features"]),
                                                                     existing["coords_meaning"] != "instance_index")
    for item in list(items):  # the first readable file sets a new store's features and whether it has positions
        if n_features is not None:
            break
        try:
            n_features, with_coords = h5_layout(item.source)
        except IngestError as error:
            skipped.append(Skipped.from_error(error, item))
            items.remove(item)
    if n_features is None:
        found = f"{len(paths)} .h5 file(s) found"
        hint = _feature_folders_below(Path(files)) if listed and not paths else ""
        raise IngestError(f"no .h5 feature file to ingest: {summarise_left_out(found, skipped)}{hint}", path=str(files))
    spec = CohortSpec(name=name or Path(str(store)).stem, n_features=n_features, coords_dim=2 if with_coords else 1,
                      coords_meaning=H5_COORDS_MEANING if with_coords else "instance_index",
                      tiling=None if slides is None else {"slides_dir": str(Path(slides).resolve())}, labels=described)
    return run_ingest(store, spec, items, partial(h5_bag_writer, with_coords=bool(with_coords)), skipped=skipped, client=client,
                      max_workers=max_workers, report_path=report_path, nonfinite=nonfinite)
