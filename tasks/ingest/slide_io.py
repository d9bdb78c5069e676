"""Whole-slide image readers: OpenSlide for what it opens, tifffile for the TIFFs it cannot.

:func:`open_slide` picks the reader. OpenSlide (``openslide-python`` + ``openslide-bin``) reads
Aperio SVS, Hamamatsu NDPI, MIRAX MRXS, Leica SCN, Philips, Ventana, DICOM-WSI and generic tiled
TIFFs. ``tifffile`` reads the TIFFs OpenSlide rejects (strip-organised) and generic TIFFs (faster, and
whole where OpenSlide sees only the base of a SubIFD pyramid, as tifffile writes them). Both
readers give the same small interface (:class:`SlideReader`): level shapes and downsamples, the
level-0 µm/px (across and down) and base magnification from the metadata, ``read(level, rows, cols)``
of a region (RGB uint8) and a thumbnail of a level read a block of at most ``STRIP_ROWS`` ×
``STRIP_COLS`` pixels at a time, so memory is bounded by one block of that level plus the
thumbnail, never a whole level.

:func:`find_slides` lists the slides of a folder (recursively through folder links, by glob
patterns) and names every other file it leaves out, broken links included.

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
import os
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
MICRONS_PER_UNIT = {"pm": 1e-6, "Å": 1e-4, "nm": 1e-3, "µm": 1.0, "μm": 1.0, "um": 1.0, "micron": 1.0, "microns": 1.0,
                    "\\u00B5m": 1.0, "mm": 1e3, "cm": 1e4, "m": 1e6, "in": 25400.0, "inch": 25400.0}
"""Length units of OME-XML ``PhysicalSize?Unit`` and ImageJ's ``unit`` (which writes µm as ``\\u00B5m``), in µm."""


class SlideReader:
    """Shared part of the readers: ``level_shapes`` [(H, W)], ``downsamples``, ``mpp`` and ``mpp_y``
    (µm per level-0 pixel across and down, None if unknown; they differ for non-square pixels),
    ``mpp_problem`` (why a µm/px the metadata states is not used: a unit gpmil does not convert),
    ``magnification`` (None if unknown), ``reader`` (its name)."""

    path: str
    reader: str
    level_shapes: list[tuple[int, int]]
    downsamples: list[float]
    mpp: float | None
    mpp_y: float | None
    mpp_problem: str | None = None
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

    def thumbnail(self, max_side: int, level: int | None = None) -> tuple[np.ndarray, float]:
        """``level`` (default the lowest-resolution one) subsampled to at most ``max_side`` px, and
        its downsample from level 0; read a ``STRIP_ROWS`` × ``STRIP_COLS`` block at a time."""
        level = len(self.level_shapes) - 1 if level is None else level
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
        except Exception as error:  # tifffile raises many types for a bad file
            raise UnreadableFileError(f"tifffile cannot open it: {type(error).__name__}: {error}", path=self.path) from error
        try:
            refusal = _overview_first(self._tiff, self.path) or _unread_layout(series, self.path)
        except Exception as error:  # a tag tifffile gives in a form not foreseen: the file, not the ingest, fails
            refusal = UnreadableFileError(f"tifffile cannot read its layout: {type(error).__name__}: {error}", path=self.path)
        if refusal is not None:
            self.close()
            raise refusal
        extra = series.keyframe.extrasamples
        self._alpha = bool(extra) and extra[0] in (tifffile.EXTRASAMPLE.ASSOCALPHA, tifffile.EXTRASAMPLE.UNASSALPHA)
        self._series = series
        self._levels: dict[int, Any] = {}
        base = self.level_shapes[0]
        self.downsamples = [float(np.mean([base[0] / shape[0], base[1] / shape[1]])) for shape in self.level_shapes]
        page = self._tiff.pages[0]
        description = page.description or ""
        self.magnification = _description_value(description, "magnification", r"AppMag\s*=\s*([0-9.]+)")
        described = _description_value(description, "mpp", r"\bMPP\s*=\s*([0-9.]+)")
        try:
            self.mpp, self.mpp_y = (described, described) if described else _tiff_mpp(self._tiff, page)
        except _UnknownUnit as error:  # said when µm/px is needed (target_mpp): tiling by level needs none
            self.mpp, self.mpp_y, self.mpp_problem = None, None, str(error)

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
        if self._alpha:  # transparent pixels (outside the scanned area) are white, as OpenSlide gives them
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
        self.mpp, self.mpp_y = _float(props.get("openslide.mpp-x")), _float(props.get("openslide.mpp-y"))
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


def _overview_first(tiff, path: str) -> IngestError | None:
    """The refusal of a TIFF whose first image is smaller than a later one (an overview stored
    before the scan), else None: tifffile and OpenSlide both take the first image for the slide,
    so ``auto`` must not fall back to OpenSlide. Vendor files (SVS: thumbnail, label and macro
    after the pyramid) put the scan first."""
    sizes = [(series.keyframe.imagewidth, series.keyframe.imagelength) for series in tiff.series]
    largest = max(sizes, key=lambda size: size[0] * size[1])
    if largest[0] * largest[1] <= sizes[0][0] * sizes[0][1]:
        return None
    return IngestError(f"the TIFF's first image ({sizes[0][0]} × {sizes[0][1]} px) is smaller than a later one "
                       f"({largest[0]} × {largest[1]} px): an overview stored before the scan, or scenes of several "
                       "sizes? Both readers would tile the first image; write the scan first, one scene per file",
                       path=path)


def _unread_layout(series, path: str) -> UnreadableFileError | None:
    """Why the tifffile reader does not read ``series`` (``auto`` then falls back to OpenSlide), or
    None: it reads interleaved 8-bit RGB or YCbCr, a 4th sample being alpha or ignored. Three
    samples marked MINISBLACK, or without a photometric tag, are read as RGB, as they always were
    (RGB written without its photometric); another colour model (CMYK: C, M, Y were read as R, G, B)
    is not."""
    import tifffile

    page = series.keyframe
    if page.planarconfig == tifffile.PLANARCONFIG.SEPARATE:
        return UnreadableFileError("planar configuration (one plane per colour) is not read by the tifffile reader; "
                                   "use reader auto or openslide", path=path)
    photometric = page.photometric  # a plain number where the tag is missing
    if isinstance(photometric, tifffile.PHOTOMETRIC) and photometric not in (
            tifffile.PHOTOMETRIC.RGB, tifffile.PHOTOMETRIC.YCBCR, tifffile.PHOTOMETRIC.MINISBLACK):
        return UnreadableFileError(f"photometric {photometric.name} is not read by the tifffile reader (RGB or "
                                   "YCbCr only); use reader auto or openslide", path=path)
    samples = series.shape[2] if len(series.shape) == 3 else 1
    if samples not in (3, 4) or series.dtype != np.uint8:
        return UnreadableFileError(f"slide is not 8-bit RGB(A) (shape {series.shape}, dtype {series.dtype})", path=path)
    return None


class _UnknownUnit(ValueError):
    """A length unit of the metadata that :data:`MICRONS_PER_UNIT` lacks."""


def _microns_per(unit: str, where: str) -> float:
    """µm in one ``unit`` (named by ``where`` in the metadata)."""
    if unit not in MICRONS_PER_UNIT:
        raise _UnknownUnit(f"slide metadata gives µm/px in {where} {unit!r}, which is no length unit gpmil converts "
                           f"({', '.join(MICRONS_PER_UNIT)})")
    return MICRONS_PER_UNIT[unit]


def _tiff_mpp(tiff, page) -> tuple[float | None, float | None]:
    """µm/px (across, down) of level 0: OME-XML ``PhysicalSizeX/Y``, else the resolution tags
    (:func:`_resolution_mpp`) in ImageJ's ``unit`` if it names one (ImageJ writes ResolutionUnit
    NONE); raises :class:`_UnknownUnit`."""
    ome = _ome_mpp(tiff.ome_metadata) if tiff.is_ome else (None, None)
    unit = (tiff.imagej_metadata or {}).get("unit") if tiff.is_imagej else None
    tags = _resolution_mpp(page, None if unit is None else _microns_per(str(unit), "the ImageJ unit"))
    return ome[0] or tags[0], ome[1] or tags[1]


def _ome_mpp(xml: str | None) -> tuple[float | None, float | None]:
    """µm/px (across, down) from the first OME ``Pixels`` element's ``PhysicalSizeX/Y`` (unit
    ``PhysicalSizeX/YUnit``, by default µm)."""
    from xml.etree import ElementTree

    try:
        root = ElementTree.fromstring(xml or "")
    except ElementTree.ParseError:
        return None, None
    pixels = next((element for element in root.iter() if element.tag.rsplit("}", 1)[-1] == "Pixels"), None)
    if pixels is None:
        return None, None
    sizes = []
    for axis in "XY":
        size = _float(pixels.get(f"PhysicalSize{axis}"))
        unit = pixels.get(f"PhysicalSize{axis}Unit", "µm")
        sizes.append(None if size is None else _float(size * _microns_per(unit, f"OME PhysicalSize{axis}Unit")))
    return sizes[0], sizes[1]


def _resolution_mpp(page, unit_microns: float | None = None) -> tuple[float | None, float | None]:
    """µm/px (across, down) from the TIFF XResolution and YResolution tags: pixels per
    ``unit_microns`` µm if given, else per ResolutionUnit (inch or centimetre). A 1-dpi tag gives
    25400 µm/px, as from OpenSlide, which tiling refuses naming the value."""
    tags = page.tags
    if "XResolution" not in tags or (unit_microns is None and "ResolutionUnit" not in tags):
        return None, None
    microns = unit_microns or {2: 25400.0, 3: 10000.0}.get(int(tags["ResolutionUnit"].value))
    if microns is None:
        return None, None

    def per_pixel(tag: str) -> float | None:
        numerator, denominator = tags[tag].value
        return _float(microns * denominator / numerator) if numerator else None

    across = per_pixel("XResolution")
    return across, per_pixel("YResolution") if "YResolution" in tags else across


def slide_id(path: str | Path) -> str:
    """The bag id of a slide: the file's stem (``x.ome.tif`` is ``x.ome``: stores and labels files
    hold it so), or the folder's name for a DICOM-WSI folder."""
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
    files, broken = _files_under(root, recursive)
    lowered = [pattern.lower() for pattern in patterns]
    slides = [p for p in files if any(Path(p.name.lower()).match(pattern) for pattern in lowered)
              and not p.name.startswith(".")]  # hidden files: macOS's '._<slide>' resource forks are no slides
    mirax_dirs = {p.with_suffix("") for p in slides if p.suffix.lower() == ".mrxs"}
    chosen = set(slides)
    left_out = [UnreadableFileError(f"not a slide: the name matches none of the patterns {list(patterns)}", path=str(p))
                for p in files if p not in chosen and p.suffix.lower() not in _NOT_SLIDES
                and not p.name.startswith(".") and p.parent not in mirax_dirs]
    left_out += [UnreadableFileError(f"a broken symbolic link: its target {os.readlink(p)} does not exist", path=str(p))
                 for p in broken if not p.name.startswith(".")]
    dicom = [p for p in slides if p.suffix.lower() == ".dcm"]
    folders, reasons = dicom_slide_folders(dicom)
    return sorted([p for p in slides if p.suffix.lower() != ".dcm"] + folders), left_out + reasons


def _files_under(root: Path, recursive: bool) -> tuple[list[Path], list[Path]]:
    """The files in ``root`` (and its sub-folders if ``recursive``, through folder links: a slide
    folder is often a link to a share), sorted, and the links whose target is missing. Each real
    folder is walked once: a link back up would loop, a second link to one folder would list its
    slides twice."""
    files, broken, walked = [], [], set()
    for folder, sub_folders, names in os.walk(root, followlinks=True):
        real = os.path.realpath(folder)
        sub_folders.sort()  # the first path to a folder linked twice is always the same
        if real in walked or not recursive:
            sub_folders.clear()
        if real in walked:
            continue
        walked.add(real)
        for name in names:
            path = Path(folder) / name
            if path.is_file():
                files.append(path)
            elif path.is_symlink() and not path.exists():
                broken.append(path)
    return sorted(files), sorted(broken)


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
