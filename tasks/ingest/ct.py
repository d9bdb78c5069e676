"""Head CT: DICOM series → slices in spatial order → Hounsfield units → three windows;
:func:`ingest_ct` ingests every series under a folder.

- Files are grouped by ``SeriesInstanceUID`` (headers only, ``stop_before_pixels``) and ordered by
  the position of ``ImagePositionPatient`` along the slice normal (the cross product of the two
  ``ImageOrientationPatient`` direction cosines), falling back to ``InstanceNumber``.
- Stored values become HU with ``RescaleSlope``/``RescaleIntercept`` *before* windowing.
- Windows (centre/width, HU): brain 40/80, blood 80/200, soft tissue 40/380; each maps
  ``[c - w/2, c + w/2]`` linearly to [0, 1] (clipped) and they are stacked as channels.
- One instance per slice; coords = slice index in spatial order. RSNA-style labels
  (``ID_<SOPInstanceUID>_any, Label``) give instance labels; the bag label is 1 if any slice is
  positive.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.ingest.driver import IngestItem, IngestPlan, IngestReport, Skipped, run_ingest
from tasks.ingest.errors import IngestError, MissingLabelError, UnreadableFileError
from tasks.store import UNKNOWN_LABEL, CohortSpec

WINDOWS: tuple[tuple[str, float, float], ...] = (("brain", 40.0, 80.0), ("blood", 80.0, 200.0),
                                                  ("soft_tissue", 40.0, 380.0))
_HEADER_TAGS = ["SeriesInstanceUID", "SOPInstanceUID", "ImagePositionPatient", "ImageOrientationPatient",
                "InstanceNumber", "Modality"]


@dataclass(frozen=True)
class CTSeries:
    """One series: its UID and its files/SOP UIDs in spatial order."""

    series_uid: str
    files: tuple[str, ...]
    sop_uids: tuple[str, ...]


def to_hu(ds) -> np.ndarray:
    """Pixel data of a dataset in Hounsfield units (float32): ``stored * slope + intercept``."""
    pixels = ds.pixel_array.astype(np.float32)
    return pixels * np.float32(ds.get("RescaleSlope", 1.0)) + np.float32(ds.get("RescaleIntercept", 0.0))


def window(hu: np.ndarray, centre: float, width: float) -> np.ndarray:
    """Map HU in ``[centre - width/2, centre + width/2]`` linearly to [0, 1], clipping outside."""
    return np.clip((hu - (centre - width / 2.0)) / width, 0.0, 1.0).astype(np.float32)


def windowed_channels(hu: np.ndarray) -> np.ndarray:
    """(..., H, W) HU → (..., H, W, 3) brain, blood and soft-tissue windows."""
    return np.stack([window(hu, centre, width) for _, centre, width in WINDOWS], axis=-1)


def _slice_position(header) -> float | None:
    try:
        orientation = np.asarray(header.ImageOrientationPatient, dtype=np.float64)
        position = np.asarray(header.ImagePositionPatient, dtype=np.float64)
    except (AttributeError, TypeError, ValueError):
        return None
    if orientation.shape != (6,) or position.shape != (3,):
        return None
    return float(np.dot(np.cross(orientation[:3], orientation[3:]), position))


def order_slices(headers: list) -> list[int]:
    """Indices of ``headers`` in spatial order (along the slice normal; else by InstanceNumber)."""
    positions = [_slice_position(h) for h in headers]
    if all(p is not None for p in positions):
        return sorted(range(len(headers)), key=lambda i: positions[i])
    return sorted(range(len(headers)), key=lambda i: int(headers[i].get("InstanceNumber", 0) or 0))


def scan_dicom_files(paths: Iterable[str | Path]) -> tuple[list[CTSeries], list[IngestError]]:
    """Read the headers of ``paths``, group them into series and order each series.

    Returns the series (sorted by UID) and an error for every file that is not a readable DICOM
    image with a SeriesInstanceUID.
    """
    import pydicom

    groups: dict[str, list] = defaultdict(list)
    errors: list[IngestError] = []
    for path in sorted(str(p) for p in paths):
        try:
            header = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=_HEADER_TAGS)
            series_uid, sop_uid = str(header.SeriesInstanceUID), str(header.SOPInstanceUID)
        except Exception as error:  # pydicom raises InvalidDicomError, EOFError, AttributeError, ...
            errors.append(UnreadableFileError(f"not a readable DICOM image: {type(error).__name__}: {error}",
                                              path=path))
            continue
        groups[series_uid].append((path, sop_uid, header))
    series = []
    for series_uid in sorted(groups):
        members = groups[series_uid]
        order = order_slices([header for _, _, header in members])
        series.append(CTSeries(series_uid, tuple(members[i][0] for i in order), tuple(members[i][1] for i in order)))
    return series, errors


def scan_dicom_dir(root: str | Path) -> tuple[list[CTSeries], list[IngestError]]:
    """:func:`scan_dicom_files` over every file under ``root`` (any extension; CSVs and hidden files skipped)."""
    files = [p for p in Path(root).rglob("*")
             if p.is_file() and not p.name.startswith(".") and p.suffix.lower() not in (".csv", ".json", ".png")]
    return scan_dicom_files(files)


def read_rsna_labels(path: str | Path) -> dict[str, int]:
    """SOPInstanceUID → 0/1 from an RSNA-style CSV (``ID_<SOPInstanceUID>_any, Label``; other subtypes ignored)."""
    import pandas as pd

    table = pd.read_csv(path, dtype={"ID": str})
    if not {"ID", "Label"} <= set(table.columns):
        raise IngestError(f"labels CSV needs columns ID, Label; has {list(table.columns)}", path=str(path))
    rows = table[table["ID"].str.endswith("_any")]
    sop_uids = rows["ID"].str.slice(3, -4)  # strip "ID_" and "_any"
    return dict(zip(sop_uids, rows["Label"].astype(int)))


def load_windowed_slices(files: Iterable[str]) -> np.ndarray:
    """Read slices and return their windowed channels (B, H, W, 3) float32 in [0, 1]."""
    import pydicom

    images = []
    for path in files:
        try:
            hu = to_hu(pydicom.dcmread(path))
        except Exception as error:
            raise UnreadableFileError(f"cannot decode DICOM pixel data: {type(error).__name__}: {error}",
                                      path=path) from error
        if images and hu.shape != images[0].shape:
            raise IngestError(f"slice of shape {hu.shape} in a series of {images[0].shape} slices", path=path)
        images.append(hu)
    return windowed_channels(np.stack(images))


def ct_bag_writer(item, writer, *, extractor, batch_size: int = 32) -> None:
    """Ingest worker for one series (``item.payload``: ``files`` and ``instance_labels`` in slice order)."""
    files = item.payload["files"]
    labels = np.asarray(item.payload["instance_labels"], dtype=np.int8)
    for start in range(0, len(files), batch_size):
        stop = min(start + batch_size, len(files))
        windows = load_windowed_slices(files[start:stop])
        writer.write(extractor(windows), np.arange(start, stop)[:, None], labels[start:stop])


# ----------------------------------------------------------------------------- the entry point
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
