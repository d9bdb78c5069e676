"""Head CT: DICOM series → slices in spatial order → Hounsfield units → three windows;
:func:`ingest_ct` ingests every series under a folder.

- Files are grouped by ``SeriesInstanceUID`` (headers only, ``stop_before_pixels``) and ordered by
  the position of ``ImagePositionPatient`` along the slice normal (the cross product of the two
  ``ImageOrientationPatient`` direction cosines), falling back to ``InstanceNumber``.
- Stored values become HU with ``RescaleSlope``/``RescaleIntercept`` *before* windowing.
- Windows (centre/width, HU): brain 40/80, blood 80/200, soft tissue 40/380; each maps
  ``[c - w/2, c + w/2]`` linearly to [0, 1] (clipped) and they are stacked as channels.
- One instance per slice; coords = slice index in spatial order; each slice's SOPInstanceUID is
  stored with it (``instances/instance_id``), so findings name slices without the DICOM folder.
  RSNA-style labels (``ID_<SOPInstanceUID>_any, Label``) give instance labels; the bag label is 1 if
  any slice is positive; the bag's original label is every subtype the file gives, positive if any
  slice is (``{"any": 1, "epidural": 0, "subdural": 1, ...}``).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import warnings
from collections import defaultdict
from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.ingest.driver import IngestItem, IngestPlan, IngestReport, Skipped, run_ingest
from tasks.ingest.errors import IngestError, InvalidSeriesError, MissingLabelError, UnreadableFileError
from tasks.store import UNKNOWN_LABEL, CohortSpec, encode_original_label

WINDOWS: tuple[tuple[str, float, float], ...] = (("brain", 40.0, 80.0), ("blood", 80.0, 200.0),
                                                  ("soft_tissue", 40.0, 380.0))
_HEADER_TAGS = ["SeriesInstanceUID", "SOPInstanceUID", "StudyInstanceUID", "ImagePositionPatient", "ImageOrientationPatient",
                "InstanceNumber", "Modality", "RescaleSlope", "RescaleIntercept", "Rows", "Columns", "NumberOfFrames", "ImageType",
                "AcquisitionNumber", "SeriesDescription", "SliceThickness", "PatientID"]
log = logging.getLogger("gpmil.ingest")
GAP_FACTOR = 1.5  # a spacing this many times the series' median spacing means a missing slice
POSITION_TOL_MM = 1e-3
ORIENTATION_TOL = 1e-3  # direction cosines further apart than this: another plane (a scout, a second stack)


@dataclass(frozen=True)
class CTSeries:
    """One series: its UID, its files/SOP UIDs in spatial order, its study's UID, PatientID and
    SeriesDescription ('' where the header has none)."""

    series_uid: str
    files: tuple[str, ...]
    sop_uids: tuple[str, ...]
    study_uid: str = ""
    patient_id: str = ""
    description: str = ""


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


def _orientation(header) -> np.ndarray | None:
    """A slice's ImageOrientationPatient (row and column direction cosines), or None."""
    try:
        orientation = np.asarray(header.ImageOrientationPatient, dtype=np.float64)
    except (AttributeError, TypeError, ValueError):
        return None
    return orientation if orientation.shape == (6,) else None


def _image_type(header) -> list[str]:
    """A slice's ImageType values, upper case (``["ORIGINAL", "PRIMARY", "AXIAL"]``); [] without one."""
    image_type = header.get("ImageType") or []
    return [str(v).strip().upper() for v in ([image_type] if isinstance(image_type, str) else image_type)]


def _is_localizer(header) -> bool:
    """A slice whose ImageType says LOCALIZER (a scout or topogram: a projection, not a slice)."""
    return "LOCALIZER" in _image_type(header)


def _slice_position(header) -> float | None:
    orientation = _orientation(header)
    try:
        position = np.asarray(header.ImagePositionPatient, dtype=np.float64)
    except (AttributeError, TypeError, ValueError):
        return None
    if orientation is None or position.shape != (3,):
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
    image with a SeriesInstanceUID, for every series :func:`check_series` refuses and for every
    derived series of a study with an original scan (:func:`_drop_derived_beside_original`).
    """
    with quiet_pydicom():  # values are converted, and warned about, when first read
        return _scan_dicom_files(paths)


def _scan_dicom_files(paths: Iterable[str | Path]) -> tuple[list[CTSeries], list[IngestError]]:
    groups: dict[str, list] = defaultdict(list)
    errors: list[IngestError] = []
    for path in sorted(str(p) for p in paths):
        try:
            header = read_header(path)
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
        members = [members[i] for i in order]
        problem = check_series(series_uid, [path for path, _, _ in members], [header for _, _, header in members])
        if problem is not None:
            errors.append(problem)
            continue
        header = members[0][2]
        series.append(CTSeries(series_uid, tuple(m[0] for m in members), tuple(m[1] for m in members),
                               _tag(header, "StudyInstanceUID"), _tag(header, "PatientID"), _tag(header, "SeriesDescription")))
    return _drop_derived_beside_original(series, errors, groups)


def read_header(path: str):
    """The header tags the scan needs; a file without DICOM's 128-byte preamble (some exports) is read
    as pydicom reads it with ``force`` when it still has a SOPInstanceUID. Called under
    :func:`quiet_pydicom` (values are converted, and warned about, when first read)."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    try:
        return pydicom.dcmread(path, stop_before_pixels=True, specific_tags=_HEADER_TAGS)
    except InvalidDicomError:
        header = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=_HEADER_TAGS, force=True)
        if "SOPInstanceUID" not in header:
            raise
        return header


class _QuietThreads(logging.Filter):
    """Drops the ``pydicom`` logger's records below ERROR logged by a thread inside
    :func:`quiet_pydicom` (a logger level would quiet every thread, and threads restoring it out
    of order would leave it changed)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR or not getattr(self.inside, "depth", 0)


_QUIET_THREADS = _QuietThreads()


@contextmanager
def quiet_pydicom():
    """pydicom's per-file warnings (e.g. 'Invalid value for VR UI' for the RSNA data's ``ID_…`` UIDs)
    off the console: one line per file, millions at RSNA scale, about values gpmil reads as text.
    pydicom both warns and logs each (its ``pydicom`` logger, which Prefect's logging prints): its
    log records below ERROR are dropped in this thread, its warnings ignored (``warnings`` filters
    are process-wide: in every thread while one is inside)."""
    logger = logging.getLogger("pydicom")
    if _QUIET_THREADS not in logger.filters:
        logger.addFilter(_QUIET_THREADS)
    inside = _QUIET_THREADS.inside
    inside.depth = getattr(inside, "depth", 0) + 1
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", module="pydicom")
            yield
    finally:
        inside.depth -= 1


def check_series(series_uid: str, files: list[str], headers: list) -> InvalidSeriesError | None:
    """Why a series (files and headers in spatial order) cannot be one CT bag, or None.

    Refused: a Modality other than CT; a slice without RescaleSlope/RescaleIntercept (HU would be
    off by the intercept, typically 1024); a screen capture (ImageType SCREEN SAVE: a dose page); a
    localizer (ImageType LOCALIZER: a scout series is no scan, a scout in a series no slice); a
    slice in another plane than the first (a localizer or
    scout kept in the series: its position along the others' normal means nothing), or without a
    position where the others have one (ordered by InstanceNumber with them, it became slice 0);
    two slices at the same position; a step along the slice normal of more than :data:`GAP_FACTOR`
    × the median spacing (a missing or unreadable slice), unless the steps are two runs of even
    spacing one after the other (:func:`_two_even_spacings`); slices of two AcquisitionNumbers whose
    ranges along the normal overlap (a repeat acquisition interleaved: step-and-shoot scans number
    each rotation's adjacent slices apart, which is fine); without positions, InstanceNumbers that
    repeat or skip.
    """
    folder = str(Path(files[0]).parent)

    def refuse(reason: str) -> InvalidSeriesError:
        return InvalidSeriesError(f"series of {_slices(len(files))}: {reason}", path=folder, bag_id=series_uid)

    seen: dict[str, str] = {}
    for path, header in zip(files, headers):
        if (first := seen.setdefault(str(header.SOPInstanceUID), path)) != path:
            return refuse(f"slice {header.SOPInstanceUID} is in two files, {first} and {path}: the series was copied "
                          "into two folders; keep one copy")
    sizes = [(h.get("Rows"), h.get("Columns")) for h in headers]
    if odd := next((k for k, size in enumerate(sizes) if size != sizes[0]), None):
        return refuse(f"slice {Path(files[odd]).name} is {sizes[odd][0]}×{sizes[odd][1]} pixels, {Path(files[0]).name} "
                      f"{sizes[0][0]}×{sizes[0][1]}: one size per series")
    for path, header in zip(files, headers):
        modality = header.get("Modality")
        if modality is not None and str(modality).upper() != "CT":
            hint = "; a DICOM whole-slide image is ingested with ingest.kind wsi" if str(modality).upper() == "SM" else ""
            return refuse(f"Modality {str(modality)!r}, not CT ({Path(path).name}){hint}")
        if int(header.get("NumberOfFrames", 1) or 1) > 1:
            return refuse(f"{Path(path).name} holds {header.NumberOfFrames} frames (an enhanced, multi-frame CT): "
                          "one file per slice is read; export the series as single-frame CT images")
        for tag in ("RescaleSlope", "RescaleIntercept"):
            try:
                float(header[tag].value)
            except (KeyError, TypeError, ValueError):
                return refuse(f"no usable {tag} in {Path(path).name}: Hounsfield units cannot be computed")
    if captures := [Path(path).name for path, h in zip(files, headers) if "SCREEN SAVE" in _image_type(h)]:
        return refuse(f"{captures[0]} is a screen capture (ImageType SCREEN SAVE: a dose page, a saved view), not a slice")
    if localizers := [Path(path).name for path, h in zip(files, headers) if _is_localizer(h)]:
        if len(localizers) == len(files):
            return refuse("a localizer/scout (ImageType LOCALIZER), not a scan")
        return refuse(f"slice {localizers[0]} is a localizer (ImageType LOCALIZER) in the series: remove it")
    planes = [(path, o) for path, h in zip(files, headers) if (o := _orientation(h)) is not None]
    if other := next(((path, o) for path, o in planes[1:] if np.abs(o - planes[0][1]).max() > ORIENTATION_TOL), None):
        return refuse(f"slice {Path(other[0]).name} lies in another plane (ImageOrientationPatient "
                      f"{np.round(other[1], 3).tolist()}) than {Path(planes[0][0]).name} ({np.round(planes[0][1], 3).tolist()}): "
                      "a localizer/scout or a second stack in the series; remove it")
    positions = [_slice_position(h) for h in headers]
    if None in positions and any(p is not None for p in positions):
        k = positions.index(None)
        return refuse(f"slice {Path(files[k]).name} has no ImagePositionPatient/ImageOrientationPatient where "
                      f"{sum(p is not None for p in positions)} others have them: a localizer or another object in the "
                      "series; remove it")
    if all(p is not None for p in positions) and len(positions) > 1:
        z = np.asarray(positions)
        steps = np.diff(z)
        if (same := np.flatnonzero(steps <= POSITION_TOL_MM)).size:
            k = int(same[0])
            return refuse(f"slices {Path(files[k]).name} and {Path(files[k + 1]).name} are at the same position "
                          f"({z[k]:.2f} mm along the slice normal)")
        median = float(np.median(steps))
        if (gaps := np.flatnonzero(steps > GAP_FACTOR * median)).size and not _two_even_spacings(
                steps, np.array([_slice_thickness(h) for h in headers])):
            k = int(gaps[0])
            where = f"between slices {Path(files[k]).name} and {Path(files[k + 1]).name}"
            if gaps.size > 1 and np.ptp(steps[gaps]) <= 0.05 * median:  # one other spacing, several times
                return refuse(f"slices {median:.2f} mm apart ({steps.size - gaps.size} steps) and {steps[k]:.2f} mm apart "
                              f"({gaps.size} steps, the first {where}): slices missing at regular intervals, or spacings "
                              "that alternate; evenly spaced slices are expected (or two evenly spaced runs one after the "
                              "other, each of its own SliceThickness)")
            return refuse(f"gap of {steps[k]:.2f} mm {where} (median spacing {median:.2f} mm): a slice is missing or unreadable")
        if interleaved := _interleaved_acquisitions(headers, z):
            return refuse(f"the slices of acquisitions {interleaved[0]} and {interleaved[1]} lie between one another along "
                          "the slice normal: a repeat acquisition in the series; remove one")
    elif len(headers) > 1:
        numbers = sorted(int(h.get("InstanceNumber", 0) or 0) for h in headers)
        if len(set(numbers)) != len(numbers) or numbers[-1] - numbers[0] != len(numbers) - 1:
            return refuse(f"no slice positions and InstanceNumbers {numbers[:8]}{'…' if len(numbers) > 8 else ''} "
                          "repeat or skip: the slice order or completeness cannot be checked")
    return None


def _tag(header, name: str) -> str:
    """A header tag as stripped text ('' where absent or empty)."""
    return str(header.get(name, "") or "").strip()


def _two_even_spacings(steps: np.ndarray, thickness: np.ndarray, *, tol: float = 0.05, min_steps: int = 3) -> bool:
    """Steps along the slice normal that are two runs of even spacing, one after the other, each of
    ``min_steps`` or more, whose slices' SliceThickness changes with the step (a head protocol:
    thin slices through the posterior fossa, thicker ones through the cerebrum). Without that
    change the longer steps are slices missing at regular intervals (a transfer that lost every
    other file of a stretch); a missing slice inside either run breaks it into more than two."""
    changes = np.flatnonzero(np.abs(np.diff(steps)) > tol * np.minimum(steps[:-1], steps[1:]))
    if changes.size != 1:
        return False
    first, second = steps[:changes[0] + 1], steps[changes[0] + 1:]
    if min(first.size, second.size) < min_steps or any(np.ptp(run) > tol * run.mean() for run in (first, second)):
        return False

    def typical(values: np.ndarray) -> float:  # a slice without a readable SliceThickness does not decide
        given = values[np.isfinite(values)]
        return float(np.median(given)) if 2 * given.size > values.size else float("nan")

    thin, thick = typical(thickness[:first.size]), typical(thickness[first.size + 1:])  # the slice between: either
    return bool(np.isfinite(thin) and np.isfinite(thick) and abs(thick - thin) > tol * min(thin, thick))


def _slice_thickness(header) -> float:
    try:
        return float(header.SliceThickness)
    except (AttributeError, TypeError, ValueError):
        return float("nan")


def _is_derived(members: list) -> bool:
    return "DERIVED" in _image_type(members[0][2])[:1]


def _is_original_scan(members: list) -> bool:
    """A series (its ``(path, sop_uid, header)`` members), whether refused or not, that is a
    patient's CT acquisition itself: Modality CT, not derived (a reformat, a MIP), not a localizer,
    not a secondary capture (a dose or screen-save page), in HU (rescale tags), of two slices or more."""
    header = members[0][2]
    kind = _image_type(header)
    return (_tag(header, "Modality").upper() in ("", "CT") and not _is_derived(members) and not _is_localizer(header)
            and "SECONDARY" not in kind[1:2] and len(members) >= 2
            and all(tag in header for tag in ("RescaleSlope", "RescaleIntercept")))


def _study_of(header) -> tuple[str, str] | None:
    """A series' study and patient (StudyInstanceUID, PatientID); None without a study UID."""
    return (study, _tag(header, "PatientID")) if (study := _tag(header, "StudyInstanceUID")) else None


def _slices(n: int) -> str:
    return f"{n} slice{'' if n == 1 else 's'}"


def _drop_derived_beside_original(series: list[CTSeries], errors: list[IngestError], groups: dict[str, list]
                                  ) -> tuple[list[CTSeries], list[IngestError]]:
    """A derived series (ImageType ``DERIVED``: a coronal reformat, a MIP) of a study (and patient)
    that has an original CT series is refused naming it: it is the same patient's scan again (as
    its own bag, in training and test both), wherever it sits — also where the original was refused
    (a missing slice): a reformat is no stand-in for the axial scan. A derived series alone is kept."""
    originals: dict[tuple[str, str], list[str]] = defaultdict(list)
    for uid, members in sorted(groups.items()):
        if (study := _study_of(members[0][2])) and _is_original_scan(members):
            originals[study].append(uid)
    passed = {s.series_uid for s in series}
    kept = []
    for s in series:
        header = groups[s.series_uid][0][2]
        if not (_is_derived(groups[s.series_uid]) and (names := originals.get(_study_of(header)))):
            kept.append(s)
            continue
        named = ", ".join(f"{uid}{'' if uid in passed else ' (refused: see its entry)'}" for uid in names[:3])
        errors.append(InvalidSeriesError(
            f"a derived series (ImageType {chr(92).join(_image_type(header))}: a reformat or reconstruction) of the study "
            f"of the original series {named}{f' and {len(names) - 3} more' if len(names) > 3 else ''}: one series per "
            "scan, the original", path=str(Path(s.files[0]).parent), bag_id=s.series_uid))
    return kept, errors


def studies_of_several_bags(series: Iterable[CTSeries]) -> dict[tuple[str, str], list[CTSeries]]:
    """The studies (StudyInstanceUID and PatientID) that give more than one series a bag: thin and
    thick or soft and bone reconstructions, a repeat or a copy of one scan count the patient as
    often in training and evaluation; a head and a chest scan of one study are fine. Which series
    is a patient's scan is the user's choice (none is dropped for it)."""
    by_study: dict[tuple[str, str], list[CTSeries]] = defaultdict(list)
    for s in series:
        if s.study_uid:
            by_study[(s.study_uid, s.patient_id)].append(s)
    return {study: members for study, members in by_study.items() if len(members) > 1}


def several_bags_warning(several: dict[tuple[str, str], list[CTSeries]], shown: int = 3) -> str:
    """One line on :func:`studies_of_several_bags`: the first ``shown`` studies with their first
    ``shown`` series each (an anonymiser that gave every patient one study UID and PatientID makes
    one study of thousands)."""
    def described(s: CTSeries) -> str:
        return f"{s.series_uid}{f' {s.description!r}' if s.description else ''} ({_slices(len(s.files))} in {Path(s.files[0]).parent})"

    def listed(members: list[CTSeries]) -> str:
        more = f" and {len(members) - shown} more series" if len(members) > shown else ""
        return ", ".join(map(described, members[:shown])) + more

    first = "; ".join(f"study {study} of patient {patient or '(no PatientID)'}: {listed(members)}"
                      for (study, patient), members in list(several.items())[:shown])
    more = f"; and {len(several) - shown} more" if len(several) > shown else ""
    return (f"{len(several)} CT stud{'y gives' if len(several) == 1 else 'ies give'} more than one bag ({first}{more}): "
            "where these are reconstructions, a repeat or a copy of one scan, the patient counts once per series in "
            "training and evaluation; keep the one series to use per scan under the ingest source")


def _interleaved_acquisitions(headers: list, z: np.ndarray) -> tuple[str, str] | None:
    """Two AcquisitionNumbers of a series whose slices' ranges along the slice normal overlap, or
    None (a series without them, or whose acquisitions follow one another)."""
    ranges: dict[str, list[float]] = {}
    for header, position in zip(headers, z.tolist()):
        number = header.get("AcquisitionNumber")
        if number is not None and str(number).strip():
            low_high = ranges.setdefault(str(number).strip(), [position, position])
            low_high[0], low_high[1] = min(low_high[0], position), max(low_high[1], position)
    spans = sorted(ranges.items(), key=lambda item: item[1][0])
    return next(((a, b) for (a, (_, a_high)), (b, (b_low, _)) in zip(spans, spans[1:]) if b_low < a_high - POSITION_TOL_MM),
                None)


_NOT_IMAGES = frozenset({".csv", ".json", ".png", ".jpg", ".jpeg", ".txt", ".md", ".pdf", ".xml", ".html", ".yaml",
                         ".yml", ".xlsx", ".xls", ".log", ".zip", ".gz", ".db", ".ini"})
"""Suffixes of the files found beside DICOM series (labels, notes, previews, archives) that are not slices."""


def _not_an_image(path: Path) -> bool:
    """A labels/notes/preview file, a README or a DICOMDIR index (a DICOM file without slices): not read."""
    return path.suffix.lower() in _NOT_IMAGES or path.name.upper() in ("DICOMDIR", "README", "LICENSE")


def scan_dicom_dir(root: str | Path) -> tuple[list[CTSeries], list[IngestError]]:
    """:func:`scan_dicom_files` over every file under ``root`` (any extension; hidden files, DICOMDIR
    indexes, READMEs and files whose suffix says they are no slice — CSV, text, PDF, JPEG … — skipped)."""
    from tasks.ingest.labels import split_undecodable

    files, undecodable = split_undecodable(
        p for p in Path(root).rglob("*")
        if p.is_file() and not p.name.startswith(".") and not _not_an_image(p))
    series, errors = scan_dicom_files(files)
    return series, errors + [UnreadableFileError(s.reason, path=s.path) for s in undecodable]


def read_rsna_subtypes(path: str | Path) -> dict[str, dict[str, int]]:
    """SOPInstanceUID → {subtype: 0/1} from an RSNA-style CSV (``ID_<SOPInstanceUID>_<subtype>, Label``)."""
    from tasks.ingest.labels import read_labels_csv, without_blank_rows

    table = read_labels_csv(path, dtype={"ID": str})
    if not {"ID", "Label"} <= set(table.columns):
        raise IngestError(f"labels CSV needs columns ID, Label; has {list(table.columns)}", path=str(path))
    table = without_blank_rows(table, "ID", str(path))
    parts = table["ID"].str.extract(r"^ID_(?P<uid>.+)_(?P<subtype>[A-Za-z]+)$")
    parts["subtype"] = parts["subtype"].str.lower()  # ID_…_ANY is ID_…_any
    if parts["uid"].isna().any():
        row = int(np.flatnonzero(parts["uid"].isna().to_numpy())[0])
        raise IngestError(f"row {row + 2}: ID {table['ID'].iat[row]!r} is not ID_<SOPInstanceUID>_<subtype>", path=str(path))
    values = pd_numeric(table["Label"])
    if (bad := np.flatnonzero(~np.isfinite(values) | (values != np.round(values)))).size:
        row = int(bad[0])
        raise IngestError(f"row {row + 2}: Label {table['Label'].iat[row]!r} of {table['ID'].iat[row]} is not an integer "
                          "(0 or 1)", path=str(path))
    subtypes: dict[str, dict[str, int]] = defaultdict(dict)  # values other than 0/1 are refused per scan
    for row, (uid, subtype, value) in enumerate(zip(parts["uid"], parts["subtype"], values.astype(int).tolist())):
        if subtypes[uid].setdefault(subtype, value) != value:
            raise IngestError(f"row {row + 2}: {table['ID'].iat[row]} = {value}, but an earlier row gives it "
                              f"{subtypes[uid][subtype]}: which label holds?", path=str(path))
    return dict(subtypes)


def label_key(sop_uid: str) -> str:
    """A slice's key in the labels: its SOPInstanceUID, without the ``ID_`` the RSNA data's own UIDs
    carry (header ``ID_00e680819``, row ``ID_00e680819_any``)."""
    return sop_uid[3:] if sop_uid.startswith("ID_") else sop_uid


def pd_numeric(column) -> np.ndarray:
    """A column as float64 (NaN where a cell is not a number)."""
    import pandas as pd

    return pd.to_numeric(column, errors="coerce").to_numpy(dtype=np.float64)


def read_rsna_labels(path: str | Path) -> dict[str, int]:
    """SOPInstanceUID → 0/1 of its ``_any`` row, from an RSNA-style CSV."""
    return {uid: sub["any"] for uid, sub in read_rsna_subtypes(path).items() if "any" in sub}


def scan_subtypes(sop_uids: Iterable[str], subtypes: dict[str, dict[str, int]]) -> dict[str, int]:
    """A scan's original label: each subtype the labels give its slices, 1 if any slice has it."""
    out: dict[str, int] = {}
    for uid in sop_uids:
        for subtype, value in subtypes.get(label_key(uid), {}).items():
            out[subtype] = max(out.get(subtype, 0), value)
    return out


def _with_transfer_syntax(ds):
    """A dataset written without file meta (older exports: no preamble, no group 0002) given the
    transfer syntax it was read in, which its pixel data need; uncompressed, as such files are."""
    from pydicom.dataset import FileMetaDataset
    from pydicom.uid import ExplicitVRBigEndian, ExplicitVRLittleEndian, ImplicitVRLittleEndian

    if "TransferSyntaxUID" not in (getattr(ds, "file_meta", None) or {}):
        implicit, little = ds.original_encoding
        ds.file_meta = getattr(ds, "file_meta", None) or FileMetaDataset()
        ds.file_meta.TransferSyntaxUID = (ImplicitVRLittleEndian if implicit else
                                          ExplicitVRLittleEndian if little else ExplicitVRBigEndian)
    return ds


def load_windowed_slices(files: Iterable[str]) -> np.ndarray:
    """Read slices and return their windowed channels (B, H, W, 3) float32 in [0, 1]."""
    import pydicom

    images = []
    for path in files:
        try:
            with quiet_pydicom():
                hu = to_hu(_with_transfer_syntax(pydicom.dcmread(path, force=True)))  # read by read_header: preamble or not
        except Exception as error:
            raise UnreadableFileError(f"cannot decode DICOM pixel data: {type(error).__name__}: {error}",
                                      path=path) from error
        if images and hu.shape != images[0].shape:
            raise IngestError(f"slice of shape {hu.shape} in a series of {images[0].shape} slices", path=path)
        images.append(hu)
    return windowed_channels(np.stack(images))


def ct_bag_writer(item, writer, *, extractor, batch_size: int = 32) -> None:
    """Ingest worker for one series (``item.payload``: ``files`` and ``instance_labels`` in slice order)."""
    files, sop_uids = item.payload["files"], item.payload["sop_uids"]
    labels = np.asarray(item.payload["instance_labels"], dtype=np.int8)
    for start in range(0, len(files), batch_size):
        stop = min(start + batch_size, len(files))
        windows = load_windowed_slices(files[start:stop])
        writer.write(extractor(windows), np.arange(start, stop)[:, None], labels[start:stop], sop_uids[start:stop])


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
            extractor=None, batch_size: int = 32, name: str | None = None, keep_unlabelled: bool = False) -> IngestPlan:
    """The plan of :func:`ingest_ct` (finds the series, reads the slice labels); with
    ``keep_unlabelled`` a series whose label the slices do not give is an unlabelled bag, not skipped."""
    from tasks.ingest.features import HandcraftedCT, extractor_spec

    extractor = extractor or HandcraftedCT()
    series, errors = scan_dicom_dir(dicom_root)
    skipped = [Skipped.from_error(error) for error in errors]
    subtypes = None if labels_csv is None else read_rsna_subtypes(labels_csv)
    items = []
    for s in series:
        source = os.path.commonpath([str(Path(path).parent) for path in s.files]) or "."  # a series in parts: their folder
        payload = {"files": list(s.files), "sop_uids": list(s.sop_uids)}
        if subtypes is None:
            items.append(IngestItem(s.series_uid, source, UNKNOWN_LABEL,
                                    payload | {"instance_labels": [UNKNOWN_LABEL] * len(s.files)}, inputs=tuple(s.files)))
            continue
        instance = np.array([subtypes.get(label_key(uid), {}).get("any", UNKNOWN_LABEL) for uid in s.sop_uids])
        if not np.isin(instance, (UNKNOWN_LABEL, 0, 1)).all():
            bad = int(np.flatnonzero(~np.isin(instance, (UNKNOWN_LABEL, 0, 1)))[0])
            skipped.append(Skipped.from_error(MissingLabelError(
                f"slice labels must be 0 or 1; {labels_csv} gives ID_{s.sop_uids[bad]}_any = {instance[bad]} "
                f"(slice file {Path(s.files[bad]).name})", path=source, bag_id=s.series_uid)))
            continue
        if not (instance == 1).any() and (instance == UNKNOWN_LABEL).any():
            if keep_unlabelled:
                items.append(IngestItem(s.series_uid, source, UNKNOWN_LABEL, payload | {"instance_labels": instance.tolist()},
                                        inputs=tuple(s.files)))
                continue
            given = sorted({k for uid in s.sop_uids for k in subtypes.get(label_key(uid), {})})
            hint = f" (it gives them {', '.join(given)} only: a scan's label comes from its _any rows)" if given else ""
            if named := [f"{kind} {uid}" for kind, uid in (("SeriesInstanceUID", s.series_uid), ("StudyInstanceUID", s.study_uid))
                         if uid and label_key(uid) in subtypes]:
                hint = (f" (its rows name the scan's {named[0]}: ingest.kind ct reads slice labels, rows "
                        "ID_<SOPInstanceUID>_<subtype>; a label per scan is not read)")
            skipped.append(Skipped.from_error(MissingLabelError(
                f"{int((instance == UNKNOWN_LABEL).sum())} of {len(instance)} slices have no label in "
                f"{labels_csv}{hint} and none is positive", path=source, bag_id=s.series_uid)))
            continue
        items.append(IngestItem(s.series_uid, source, int((instance == 1).any()),
                                payload | {"instance_labels": instance.tolist()},
                                encode_original_label(scan_subtypes(s.sop_uids, subtypes)), tuple(s.files)))
    spec = CohortSpec(name=name or Path(str(store)).stem, n_features=int(extractor.n_features), coords_dim=1,
                      coords_meaning="slice_index", feature_extractor=extractor_spec(extractor),
                      tiling={"instance": "slice", "windows": [list(w) for w in WINDOWS]}, instance_ids="SOPInstanceUID",
                      labels=None if labels_csv is None else {"file": str(labels_csv), "column": "RSNA subtypes of the slices",
                                                              "target": "any", "positive": None})
    planned = {item.bag_id for item in items}  # a series the labels leave out is no second bag
    if several := studies_of_several_bags(s for s in series if s.series_uid in planned):
        log.warning("%s", several_bags_warning(several))
    return IngestPlan(spec, items, skipped, functools.partial(ct_bag_writer, extractor=extractor, batch_size=batch_size))
