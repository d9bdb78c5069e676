"""Whole-slide image readers: OpenSlide for what it opens, tifffile for the TIFFs it cannot.

:func:`open_slide` picks the reader. OpenSlide (``openslide-python`` + ``openslide-bin``) reads
Aperio SVS, Hamamatsu NDPI, MIRAX MRXS, Leica SCN, Philips, Ventana, DICOM-WSI and generic tiled
TIFFs. ``tifffile`` reads the TIFFs OpenSlide rejects (strip-organised) and generic TIFFs (faster, and
whole where OpenSlide sees only the base of a SubIFD pyramid, as tifffile writes them). Both
readers give the same small interface (:class:`SlideReader`): level shapes and downsamples, the
level-0 µm/px and base magnification from the metadata, ``read(level, rows, cols)`` of a region
(RGB uint8) and a thumbnail read a block of at most ``STRIP_ROWS`` × ``STRIP_COLS`` pixels at a time, so
memory is bounded by one block of the lowest level plus the thumbnail, never a whole level.

:func:`find_slides` lists the slides of a folder (recursively, by glob patterns) and names every
other file it leaves out.

DICOM-WSI (VL Whole Slide Microscopy Image Storage) is a *folder*: one file per pyramid level (and
label/overview images), all of one SeriesInstanceUID. Discovery reads the headers of the ``.dcm``
files (no pixels) and takes each folder holding one such series as one slide (bag id = the folder's
name); OpenSlide opens it from any of its files and finds the others. ``.dcm`` files of other SOP
classes (a CT series: ``ingest.kind ct``), unreadable ones and folders mixing several WSI series are
listed with the reason. OpenSlide 4 reads TILED_FULL/TILED_SPARSE levels encoded as JPEG baseline,
JPEG 2000 or uncompressed RGB (Explicit VR Little Endian); for any other file its own error is the
reason given.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from tasks.ingest.errors import IngestError, UnreadableFileError

Reader = Literal["auto", "openslide", "tifffile"]
STRIP_ROWS = 512
STRIP_COLS = 4096
SLIDE_PATTERNS = ("*.svs", "*.tif", "*.tiff", "*.ndpi", "*.mrxs", "*.scn", "*.bif", "*.vms", "*.btf", "*.svslide", "*.dcm")
VL_WHOLE_SLIDE_MICROSCOPY = "1.2.840.10008.5.1.4.1.1.77.1.6"
_NOT_SLIDES = {".csv", ".tsv", ".json", ".txt", ".md", ".yaml", ".yml", ".xml", ".geojson", ".png", ".jpg"}


class SlideReader:
    """Shared part of the readers: ``level_shapes`` [(H, W)], ``downsamples``, ``mpp`` (µm per
    level-0 pixel, None if unknown), ``magnification`` (None if unknown), ``reader`` (its name)."""

    path: str
    reader: str
    level_shapes: list[tuple[int, int]]
    downsamples: list[float]
    mpp: float | None
    magnification: float | None

    def __enter__(self) -> SlideReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        raise NotImplementedError

    def read(self, level: int, rows: slice, cols: slice) -> np.ndarray:
        """RGB uint8 pixels of a region of ``level``; parts outside the level are white."""
        raise NotImplementedError

    def thumbnail(self, max_side: int) -> tuple[np.ndarray, float]:
        """The lowest-resolution level subsampled to at most ``max_side`` px, and its downsample
        from level 0; read a ``STRIP_ROWS`` × ``STRIP_COLS`` block at a time."""
        level = len(self.level_shapes) - 1
        height, width = self.level_shapes[level]
        step = max(1, int(np.ceil(max(height, width) / max_side)))
        stripe = max(step, (STRIP_ROWS // step) * step)
        block = max(step, (STRIP_COLS // step) * step)
        out = np.empty((-(-height // step), -(-width // step), 3), dtype=np.uint8)
        for y in range(0, height, stripe):
            for x in range(0, width, block):
                part = self.read(level, slice(y, min(y + stripe, height)), slice(x, min(x + block, width)))
                out[y // step:y // step + -(-part.shape[0] // step), x // step:x // step + -(-part.shape[1] // step)] = \
                    part[::step, ::step]  # copied into the thumbnail: no view keeps a block (or the level) alive
        return out, self.downsamples[level] * step


def _white_pad(pixels: np.ndarray, height: int, width: int) -> np.ndarray:
    if pixels.shape[:2] == (height, width):
        return pixels
    out = np.full((height, width, 3), 255, dtype=np.uint8)
    out[: pixels.shape[0], : pixels.shape[1]] = pixels[:height, :width]
    return out


class TiffSlide(SlideReader):
    """A TIFF read with ``tifffile`` through its Zarr view of each level (a read decodes only the
    TIFF tiles or strips it overlaps)."""

    reader = "tifffile"

    def __init__(self, path: str | Path):
        import tifffile

        self.path = str(path)
        try:
            self._tiff = tifffile.TiffFile(self.path)
            series = self._tiff.series[0]
            self.level_shapes = [tuple(int(s) for s in level.shape[:2]) for level in series.levels]
            samples = series.levels[0].shape[2] if len(series.levels[0].shape) == 3 else 1
        except Exception as error:  # tifffile raises many types for a bad file
            raise UnreadableFileError(f"tifffile cannot open it: {type(error).__name__}: {error}", path=self.path) from error
        if samples not in (3, 4) or series.dtype != np.uint8:
            self.close()
            raise UnreadableFileError(f"slide is not 8-bit RGB(A) (shape {series.shape}, dtype {series.dtype})",
                                      path=self.path)
        self._series = series
        self._levels: dict[int, Any] = {}
        base = self.level_shapes[0]
        self.downsamples = [float(np.mean([base[0] / shape[0], base[1] / shape[1]])) for shape in self.level_shapes]
        page = self._tiff.pages[0]
        description = page.description or ""
        self.magnification = _description_value(description, "magnification", r"AppMag\s*=\s*([0-9.]+)")
        self.mpp = _description_value(description, "mpp", r"\bMPP\s*=\s*([0-9.]+)") or _resolution_mpp(page)

    def close(self) -> None:
        self._tiff.close()

    def _level(self, level: int):
        import zarr

        if level not in self._levels:
            self._levels[level] = zarr.open(self._series.aszarr(level=level), mode="r")
        return self._levels[level]

    def read(self, level: int, rows: slice, cols: slice) -> np.ndarray:
        try:
            pixels = np.asarray(self._level(level)[max(rows.start, 0):rows.stop, max(cols.start, 0):cols.stop, :])
        except Exception as error:
            raise UnreadableFileError(f"cannot decode slide data: {type(error).__name__}: {error}",
                                      path=self.path) from error
        rgb = pixels[..., :3].copy()
        if pixels.shape[-1] == 4:  # transparent pixels (outside the scanned area) are white, as OpenSlide gives them
            rgb[pixels[..., 3] == 0] = 255
        return _white_pad(rgb, rows.stop - rows.start, cols.stop - cols.start)


class OpenSlideSlide(SlideReader):
    """A slide read with OpenSlide; transparent pixels (outside scanned areas) come back white (as
    from :class:`TiffSlide`)."""

    reader = "openslide"

    def __init__(self, path: str | Path):
        import openslide

        self.path = str(path)
        try:
            self._slide = openslide.OpenSlide(self.path)
        except Exception as error:
            raise UnreadableFileError(f"OpenSlide cannot open it: {type(error).__name__}: {error}", path=self.path) from error
        self.vendor = self._slide.properties.get("openslide.vendor")
        self.level_shapes = [(int(h), int(w)) for w, h in self._slide.level_dimensions]
        self.downsamples = [float(d) for d in self._slide.level_downsamples]
        props = self._slide.properties
        self.mpp = _float(props.get("openslide.mpp-x"))
        self.magnification = _float(props.get("openslide.objective-power"))

    def close(self) -> None:
        self._slide.close()

    def read(self, level: int, rows: slice, cols: slice) -> np.ndarray:
        downsample = self.downsamples[level]
        size = (cols.stop - cols.start, rows.stop - rows.start)
        try:
            rgba = np.asarray(self._slide.read_region((int(round(cols.start * downsample)),
                                                       int(round(rows.start * downsample))), level, size))
        except Exception as error:
            raise UnreadableFileError(f"cannot decode slide data: {type(error).__name__}: {error}",
                                      path=self.path) from error
        rgb = rgba[..., :3].copy()
        rgb[rgba[..., 3] == 0] = 255
        return rgb


def _float(value: Any) -> float | None:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None
    return number if np.isfinite(number) and number > 0 else None


def _description_value(description: str, key: str, pattern: str) -> float | None:
    """``key`` from a JSON ImageDescription, or the number ``pattern`` finds (Aperio ``AppMag = 20``)."""
    try:
        value = json.loads(description).get(key)
        return _float(value)
    except (ValueError, AttributeError):
        pass
    match = re.search(pattern, description)
    return _float(match.group(1)) if match else None


def _resolution_mpp(page) -> float | None:
    """µm/px from the TIFF XResolution tag (pixels per centimetre or inch)."""
    tags = page.tags
    if "XResolution" not in tags or "ResolutionUnit" not in tags:
        return None
    numerator, denominator = tags["XResolution"].value
    per_unit = numerator / denominator if denominator else 0.0
    unit = int(tags["ResolutionUnit"].value)
    microns = {2: 25400.0, 3: 10000.0}.get(unit)
    return None if microns is None or per_unit <= 1.0 else _float(microns / per_unit)


def slide_id(path: str | Path) -> str:
    """The bag id of a slide: the file's stem, or the folder's name for a DICOM-WSI folder."""
    path = Path(path)
    return path.name if path.is_dir() else path.stem


def slide_files(path: str | Path) -> tuple[str, ...]:
    """The files a slide is read from, for its input stamp (:mod:`tasks.ingest.stamps`): a DICOM-WSI
    folder's ``.dcm`` files, a MIRAX slide's ``.mrxs`` and the files of its same-named folder, else
    the file itself; in a fixed order."""
    path = Path(path)
    if path.is_dir():
        return tuple(str(p) for p in _dicom_files(path))
    companions = path.with_suffix("")
    if path.suffix.lower() == ".mrxs" and companions.is_dir():
        return (str(path), *(str(p) for p in sorted(companions.iterdir()) if p.is_file()))
    return (str(path),)


def _dicom_files(folder: Path) -> list[Path]:
    """A DICOM-WSI folder's ``.dcm`` files (any case of the suffix, as discovery finds them), sorted."""
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() == ".dcm")


def _open_dicom_folder(folder: Path, reader: Reader) -> SlideReader:
    """A DICOM-WSI folder, opened by OpenSlide from its first file OpenSlide recognises as DICOM-WSI."""
    import openslide

    if reader == "tifffile":
        raise UnreadableFileError("a DICOM-WSI folder is read by OpenSlide (reader auto or openslide), not tifffile",
                                  path=str(folder))
    for path in _dicom_files(folder):
        try:
            if openslide.OpenSlide.detect_format(str(path)) == "dicom":
                return OpenSlideSlide(path)
        except UnreadableFileError:
            raise
        except Exception:  # an unreadable file among the series': OpenSlide's open of another one says more
            continue
    raise UnreadableFileError("no file of the folder is a DICOM whole-slide image OpenSlide recognises", path=str(folder))


def open_slide(path: str | Path, reader: Reader = "auto") -> SlideReader:
    """Open a slide with OpenSlide if it recognises a vendor format, else with tifffile; a
    folder is a DICOM-WSI (OpenSlide).

    ``auto`` takes tifffile for what OpenSlide calls a generic TIFF when tifffile opens it: the
    pixels are the same, tifffile decodes them about 5x faster (bench_wsi_memory --compare-readers)
    and sees SubIFD pyramids whole where OpenSlide sees the base level only. A file neither
    opens raises :class:`UnreadableFileError` giving both readers' reasons.
    """
    if Path(path).is_dir():
        return _open_dicom_folder(Path(path), reader)
    path = str(path)
    reasons = []
    if reader in ("auto", "openslide"):
        import openslide

        try:
            vendor = openslide.OpenSlide.detect_format(path)
        except Exception as error:  # a missing or unreadable file
            vendor, reasons = None, [f"OpenSlide: {type(error).__name__}: {error}"]
        if vendor is not None:
            if reader == "openslide" or vendor != "generic-tiff":
                return OpenSlideSlide(path)
            try:  # a generic TIFF: tifffile reads the same pixels several times faster, and SubIFD pyramids whole
                return TiffSlide(path)
            except UnreadableFileError:
                return OpenSlideSlide(path)
        reasons = reasons or ["OpenSlide: not a format it recognises"]
        if reader == "openslide":
            raise UnreadableFileError("; ".join(reasons), path=path)
    try:
        return TiffSlide(path)
    except UnreadableFileError as error:
        raise UnreadableFileError("; ".join([*reasons, f"tifffile: {error.reason}"]), path=path) from error


def find_slides(source: str | Path | Sequence[str | Path], patterns: Sequence[str] = SLIDE_PATTERNS,
                recursive: bool = True) -> tuple[list[Path], list[IngestError]]:
    """Slides under a folder (matching any of ``patterns``, case-insensitively; in sub-folders if
    ``recursive``), or the given list; and one error per other file left out, with the reason.

    Tables, images and notes (``.csv``, ``.json``, ``.png``, …) and the companion files inside a
    MIRAX slide's folder are not reported. ``.dcm`` files become DICOM-WSI folders
    (:func:`dicom_slide_folders`).
    """
    if not isinstance(source, (str, Path)):
        return [Path(s) for s in source], []
    root = Path(source)
    if not root.is_dir():
        raise IngestError("slide source is not a folder", path=str(root))
    files = sorted(p for p in (root.rglob("*") if recursive else root.iterdir()) if p.is_file())
    lowered = [pattern.lower() for pattern in patterns]
    slides = [p for p in files if any(Path(p.name.lower()).match(pattern) for pattern in lowered)
              and not p.name.startswith(".")]  # hidden files: macOS's '._<slide>' resource forks are no slides
    mirax_dirs = {p.with_suffix("") for p in slides if p.suffix.lower() == ".mrxs"}
    chosen = set(slides)
    left_out = [UnreadableFileError(f"not a slide: the name matches none of the patterns {list(patterns)}", path=str(p))
                for p in files if p not in chosen and p.suffix.lower() not in _NOT_SLIDES
                and not p.name.startswith(".") and p.parent not in mirax_dirs]
    dicom = [p for p in slides if p.suffix.lower() == ".dcm"]
    folders, reasons = dicom_slide_folders(dicom)
    return sorted([p for p in slides if p.suffix.lower() != ".dcm"] + folders), left_out + reasons


def dicom_slide_folders(files: Sequence[Path]) -> tuple[list[Path], list[IngestError]]:
    """The DICOM-WSI slides among ``.dcm`` files: each folder holding one VL Whole Slide Microscopy
    series; and a reason for every other file (one per folder and SOP class: a CT series is one
    entry), for unreadable headers and for folders holding several WSI series."""
    import pydicom
    from pydicom.uid import UID

    by_folder: dict[Path, dict[str, set[str]]] = {}
    others: dict[tuple[Path, str, str], int] = {}
    reasons: list[IngestError] = []
    for path in files:
        try:
            header = pydicom.dcmread(path, stop_before_pixels=True, specific_tags=["SOPClassUID", "SeriesInstanceUID", "Modality"])
            sop_class, series = str(header.SOPClassUID), str(header.SeriesInstanceUID)
        except Exception as error:  # pydicom raises InvalidDicomError, EOFError, AttributeError, ...
            reasons.append(UnreadableFileError(f"not a readable DICOM file: {type(error).__name__}: {error}", path=str(path)))
            continue
        if sop_class == VL_WHOLE_SLIDE_MICROSCOPY:
            by_folder.setdefault(path.parent, {}).setdefault(series, set()).add(path.name)
        else:
            key = (path.parent, sop_class, str(header.get("Modality", "?")))
            others[key] = others.get(key, 0) + 1
    for (folder, sop_class, modality), count in sorted(others.items()):
        hint = "; CT series are ingested with ingest.kind ct" if modality == "CT" else ""
        reasons.append(UnreadableFileError(
            f"not a whole-slide image: {count} DICOM file(s) of SOP class {UID(sop_class).name} (Modality {modality}){hint}",
            path=str(folder)))
    folders = []
    for folder, series in sorted(by_folder.items()):
        if len(series) == 1:
            folders.append(folder)
        else:
            reasons.append(UnreadableFileError(
                f"folder holds {len(series)} DICOM-WSI series ({', '.join(sorted(series))}); one slide per folder expected",
                path=str(folder)))
    return folders, reasons
