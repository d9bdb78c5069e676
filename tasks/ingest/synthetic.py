"""Seeded synthetic cohorts that write real files: slides, CT series and feature stores.

- :func:`make_slide_cohort`: pyramidal tiled TIFF "H&E slides" (tissue blobs on a bright background,
  spatially contiguous "tumour" regions of a darker, denser texture in positive slides) and a
  PANDA-style ``labels.csv`` (``image_id, data_provider, isup_grade, gleason_score``).
- :func:`make_ct_cohort`: head-CT DICOM series (skull, brain, hyperdense "bleed" blobs on a run of
  consecutive slices in positive scans; files named by UID, so order must come from the headers)
  and an RSNA-style ``labels.csv`` (``ID_<SOPInstanceUID>_<subtype>, Label``).
- :func:`make_feature_cohort`: a cohort store of Gaussian instance features with witnesses, written
  straight to Zarr in bag batches (for the 10^4..10^7-row scale tests).

Slides are rendered tile by tile from a coarse label map, so memory never holds a whole level; the
same seed gives the same files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BACKGROUND, TISSUE, TUMOUR = 0, 1, 2
MAP_DOWNSAMPLE = 32  # base-level pixels per label-map cell
_COLOURS = {  # mean RGB and nucleus RGB per class
    BACKGROUND: ((243, 242, 241), None),
    TISSUE: ((232, 170, 205), (130, 80, 170)),
    TUMOUR: ((200, 140, 195), (90, 50, 140)),
}
_NUCLEUS_DENSITY = {TISSUE: 0.004, TUMOUR: 0.03}
_GLEASON = ("0+0", "3+3", "3+4", "4+3", "4+4", "4+5")  # by ISUP grade


@dataclass(frozen=True)
class SyntheticSlide:
    """A generated slide: its file, label, and the label map it was rendered from.

    ``label_map`` holds one class (0 background, 1 tissue, 2 tumour) per ``MAP_DOWNSAMPLE`` ×
    ``MAP_DOWNSAMPLE`` base-level pixels, so ``tissue_fraction`` is exact.
    """

    image_id: str
    path: Path
    label: int
    isup_grade: int
    label_map: np.ndarray

    @property
    def tissue_fraction(self) -> float:
        return float(np.mean(self.label_map != BACKGROUND))


def _blob_map(rng: np.random.Generator, shape: tuple[int, int], n_blobs: int, scale: float,
              inside: np.ndarray | None = None) -> np.ndarray:
    """Union of random ellipses (semi-axes ~``scale`` × the map size), optionally within ``inside``."""
    yy, xx = np.mgrid[: shape[0], : shape[1]]
    mask = np.zeros(shape, dtype=bool)
    for _ in range(n_blobs):
        if inside is not None and inside.any():
            cy, cx = np.argwhere(inside)[rng.integers(inside.sum())]
        else:
            cy, cx = rng.uniform(0.25, 0.75) * shape[0], rng.uniform(0.25, 0.75) * shape[1]
        ay, ax = rng.uniform(0.5, 1.0, size=2) * scale * np.array(shape)
        angle = rng.uniform(0, np.pi)
        dy, dx = yy - cy, xx - cx
        u = (dx * np.cos(angle) + dy * np.sin(angle)) / ax
        v = (-dx * np.sin(angle) + dy * np.cos(angle)) / ay
        mask |= u ** 2 + v ** 2 <= 1.0
    return mask if inside is None else mask & inside


def _render_tile(label_map: np.ndarray, y0: int, x0: int, tile: int, downsample: int,
                 rng: np.random.Generator) -> np.ndarray:
    """RGB tile of a level with ``downsample`` whose top-left base pixel is (y0, x0)·downsample."""
    ys = ((y0 + np.arange(tile)) * downsample) // MAP_DOWNSAMPLE
    xs = ((x0 + np.arange(tile)) * downsample) // MAP_DOWNSAMPLE
    inside = (ys[:, None] < label_map.shape[0]) & (xs[None, :] < label_map.shape[1])
    classes = np.where(inside, label_map[np.minimum(ys, label_map.shape[0] - 1)][:, np.minimum(xs, label_map.shape[1] - 1)],
                       BACKGROUND)
    rgb = np.zeros((tile, tile, 3), dtype=np.float32)
    for cls, (mean, nucleus) in _COLOURS.items():
        where = classes == cls
        if not where.any():
            continue
        rgb[where] = mean
        if nucleus is not None:
            seeds = (rng.random((tile, tile)) < _NUCLEUS_DENSITY[cls] * downsample) & where
            nuclei = seeds.copy()
            for dy, dx in ((0, 1), (1, 0), (1, 1), (0, -1), (-1, 0)):
                nuclei |= np.roll(seeds, (dy, dx), axis=(0, 1))
            rgb[nuclei & where] = nucleus
    rgb += rng.normal(0.0, 4.0, size=rgb.shape)
    return np.clip(rgb, 0, 255).astype(np.uint8)


def write_slide(path: str | Path, label_map: np.ndarray, *, seed: int, tile: int = 256,
                levels: int = 3, level_factor: int = 4, magnification: float = 20.0,
                mpp: float = 0.5, compression: str = "zlib") -> Path:
    """Write a pyramidal tiled TIFF rendered from ``label_map`` (base size = map size × 32).

    Levels have downsamples ``level_factor**l`` (while a level is at least one tile); the base-level
    magnification and microns per pixel are recorded as JSON in the ImageDescription.
    """
    import tifffile

    path = Path(path)
    height, width = (np.asarray(label_map.shape) * MAP_DOWNSAMPLE).tolist()
    downsamples = [level_factor ** lv for lv in range(levels) if min(height, width) // level_factor ** lv >= tile]
    description = json.dumps({"magnification": magnification, "mpp": mpp, "generator": "gpmil-synthetic"})

    def tiles(downsample: int, shape: tuple[int, int]):
        rng = np.random.default_rng([seed, downsample])
        for y0 in range(0, shape[0], tile):
            for x0 in range(0, shape[1], tile):
                yield _render_tile(label_map, y0, x0, tile, downsample, rng)

    with tifffile.TiffWriter(path, bigtiff=height * width * 3 > 2**31) as tif:
        for level, downsample in enumerate(downsamples):
            shape = (-(-height // downsample), -(-width // downsample))
            options = {"subifds": len(downsamples) - 1, "description": description, "metadata": None} if level == 0 \
                else {"subfiletype": 1}
            tif.write(tiles(downsample, shape), shape=(*shape, 3), dtype=np.uint8, tile=(tile, tile),
                      photometric="rgb", compression=compression, **options)
    return path


def write_pyramid(path: str | Path, rgb: np.ndarray, *, mpp: float, levels: int = 3, level_factor: int = 4,
                  tile: int = 256, flavour: str = "generic", magnification: float = 20.0,
                  compression: str | None = "zlib") -> Path:
    """Write ``rgb`` (H, W, 3) uint8 as a tiled pyramid with one page per level, the layout OpenSlide reads.

    ``flavour="generic"``: resolution tags give ``mpp`` (OpenSlide's generic-tiff); ``"aperio"``: an
    Aperio ImageDescription (``AppMag``, ``MPP``) on each level (OpenSlide's aperio vendor, ``.svs``).
    """
    import tifffile

    path = Path(path)
    height, width = rgb.shape[:2]
    with tifffile.TiffWriter(path, bigtiff=rgb.nbytes > 2**31) as tif:
        for level in range(levels):
            d = level_factor ** level
            if min(height, width) // d < tile and level:
                break
            options: dict = {"subfiletype": 0 if level == 0 else 1, "metadata": None}
            if flavour == "aperio":
                options["description"] = (f"Aperio Image Library v12.0.15 \r\n{width}x{height} [0,0 {width}x{height}] "
                                          f"({tile}x{tile}) |AppMag = {magnification:g}|MPP = {mpp:g}")
            else:
                options.update(resolution=(1e4 / (mpp * d), 1e4 / (mpp * d)), resolutionunit="CENTIMETER")
            tif.write(rgb[::d, ::d], tile=(tile, tile), photometric="rgb", compression=compression, **options)
    return path


def make_slide_cohort(out_dir: str | Path, n_slides: int, *, map_shape: tuple[int, int] = (32, 48),
                      positive_fraction: float = 0.5, seed: int = 0, tile: int = 256,
                      n_corrupt: int = 0) -> list[SyntheticSlide]:
    """Write ``n_slides`` slides ``slide_XXXXX.tiff`` and ``labels.csv`` (PANDA layout) to ``out_dir``.

    The default map shape gives 1024 × 1536-pixel slides (24 tiles of 256 px, ~40% tissue);
    ``n_corrupt`` extra files with a valid TIFF header and truncated data are added (and listed in
    the labels CSV) for bad-input tests.
    """
    import pandas as pd

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    slides, rows = [], []
    for i in range(n_slides):
        image_id = f"slide_{i:05d}"
        tissue = _blob_map(rng, map_shape, n_blobs=int(rng.integers(2, 4)), scale=0.25)
        positive = rng.random() < positive_fraction
        label_map = tissue.astype(np.uint8)
        if positive:
            label_map[_blob_map(rng, map_shape, n_blobs=1, scale=0.1, inside=tissue)] = TUMOUR
        grade = int(rng.integers(1, 6)) if positive else 0
        path = write_slide(out_dir / f"{image_id}.tiff", label_map, seed=seed * 100003 + i, tile=tile)
        slides.append(SyntheticSlide(image_id, path, int(grade > 0), grade, label_map))
        rows.append({"image_id": image_id, "data_provider": "synthetic", "isup_grade": grade,
                     "gleason_score": _GLEASON[grade]})
    for j in range(n_corrupt):
        image_id = f"corrupt_{j:05d}"
        source = slides[j % len(slides)].path.read_bytes() if slides else b"II*\x00"
        (out_dir / f"{image_id}.tiff").write_bytes(source[: max(64, len(source) // 50)])
        rows.append({"image_id": image_id, "data_provider": "synthetic", "isup_grade": 0, "gleason_score": "0+0"})
    pd.DataFrame(rows).to_csv(out_dir / "labels.csv", index=False)
    return slides


VL_WHOLE_SLIDE_MICROSCOPY = "1.2.840.10008.5.1.4.1.1.77.1.6"


def _dicom_instance(sop_class: str, sop_uid: str, study_uid: str, series_uid: str, patient_id: str, modality: str):
    """A DICOM dataset with the file meta and identifying attributes every instance written here shares
    (explicit VR little endian); the caller adds the modality's image attributes."""
    from pydicom.dataset import Dataset, FileMetaDataset
    from pydicom.uid import ExplicitVRLittleEndian

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID = sop_class, sop_uid
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = Dataset()
    ds.file_meta = meta
    ds.SOPClassUID, ds.SOPInstanceUID = sop_class, sop_uid
    ds.StudyInstanceUID, ds.SeriesInstanceUID = study_uid, series_uid
    ds.PatientID, ds.Modality = patient_id, modality
    return ds


def write_dicom_wsi(out_dir: str | Path, rgb: np.ndarray, *, mpp: float, series_key: str, tile: int = 256,
                    levels: int = 2, level_factor: int = 4, magnification: float = 20.0,
                    **overrides) -> tuple[str, list[Path]]:
    """Write ``rgb`` (H, W, 3) uint8 as a DICOM whole-slide image: one VL Whole Slide Microscopy
    Image Storage file per pyramid level in ``out_dir``, each a multi-frame TILED_FULL image of
    ``tile`` × ``tile`` RGB frames (row-major, edge frames padded white), uncompressed Explicit VR
    Little Endian, ImageType ORIGINAL\\PRIMARY\\VOLUME\\NONE, pixel spacing (mm) in the shared
    functional groups and the objective power in the optical path. ``overrides``: attributes set on
    every file after the others (to write a slide a reader must refuse). UIDs derive from
    ``series_key``. Returns the SeriesInstanceUID and the files, level 0 first.
    """
    from pydicom.dataset import Dataset
    from pydicom.uid import generate_uid

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    study_uid = generate_uid(entropy_srcs=[series_key, "study"])
    series_uid = generate_uid(entropy_srcs=[series_key, "series"])
    paths = []
    for level in range(levels):
        d = level_factor ** level
        image = rgb[::d, ::d]
        if level and min(image.shape[:2]) < tile:
            break
        height, width = image.shape[:2]
        padded = np.full((-(-height // tile) * tile, -(-width // tile) * tile, 3), 255, dtype=np.uint8)
        padded[:height, :width] = image
        frames = padded.reshape(padded.shape[0] // tile, tile, padded.shape[1] // tile, tile, 3).swapaxes(1, 2)
        sop_uid = generate_uid(entropy_srcs=[series_key, "level", str(level)])
        ds = _dicom_instance(VL_WHOLE_SLIDE_MICROSCOPY, sop_uid, study_uid, series_uid, series_key, "SM")
        ds.ImageType = ["ORIGINAL", "PRIMARY", "VOLUME", "NONE"]
        ds.Rows = ds.Columns = tile
        ds.TotalPixelMatrixRows, ds.TotalPixelMatrixColumns = height, width
        ds.NumberOfFrames = frames.shape[0] * frames.shape[1]
        ds.DimensionOrganizationType = "TILED_FULL"
        ds.TotalPixelMatrixFocalPlanes, ds.NumberOfOpticalPaths = 1, 1
        ds.SamplesPerPixel, ds.PhotometricInterpretation, ds.PlanarConfiguration = 3, "RGB", 0
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 8, 8, 7, 0
        measures = Dataset()
        measures.PixelSpacing = [mpp * d / 1000.0] * 2  # mm
        measures.SliceThickness = 0.001
        shared = Dataset()
        shared.PixelMeasuresSequence = [measures]
        ds.SharedFunctionalGroupsSequence = [shared]
        optical_path = Dataset()
        optical_path.OpticalPathIdentifier, optical_path.ObjectiveLensPower = "1", magnification
        ds.OpticalPathSequence = [optical_path]
        ds.PixelData = np.ascontiguousarray(frames).tobytes()
        for keyword, value in overrides.items():
            setattr(ds, keyword, value)
        path = out_dir / f"level{level}.dcm"
        ds.save_as(path, enforce_file_format=True)
        paths.append(path)
    return series_uid, paths


# ------------------------------------------------------------------------------------------- CT
RSNA_SUBTYPES = ("epidural", "intraparenchymal", "intraventricular", "subarachnoid", "subdural", "any")


@dataclass(frozen=True)
class SyntheticScan:
    """A generated CT series: its UIDs (in slice order), files and per-slice bleed labels."""

    series_uid: str
    sop_uids: tuple[str, ...]
    paths: tuple[Path, ...]
    slice_labels: np.ndarray

    @property
    def label(self) -> int:
        return int(self.slice_labels.any())


def head_phantom_hu(n_slices: int, size: int, rng: np.random.Generator,
                    bleed_slices: range | None = None) -> np.ndarray:
    """(n_slices, size, size) HU volume: air, a skull shell, brain, and a bleed blob if requested."""
    z = np.linspace(-0.9, 0.9, n_slices)[:, None, None]
    yy, xx = np.mgrid[: size, : size] / (size - 1) * 2 - 1
    r = np.sqrt((yy[None] / 0.85) ** 2 + (xx[None] / 0.72) ** 2 + z ** 2)
    hu = np.full((n_slices, size, size), -1000.0)
    hu[r < 1.0] = 1000.0  # skull
    brain = r < 0.9
    hu[brain] = 32.0 + rng.normal(0, 4.0, size=brain.sum())
    if bleed_slices is not None:
        cy, cx = rng.uniform(-0.3, 0.3, size=2)
        radius = rng.uniform(0.12, 0.2)
        blob = (yy - cy) ** 2 + (xx - cx) ** 2 < radius ** 2
        for k in bleed_slices:
            hu[k][blob & brain[k]] = 75.0 + rng.normal(0, 4.0, size=(blob & brain[k]).sum())
    return hu


def write_ct_series(out_dir: str | Path, hu: np.ndarray, *, series_key: str, slice_thickness: float = 5.0,
                    rescale_intercept: float = -1024.0, rescale_slope: float = 1.0) -> tuple[str, list[str], list[Path]]:
    """Write one CT series (one file per slice, named by SOPInstanceUID) from a HU volume.

    Stored values are ``round((HU - intercept) / slope)`` as uint16. UIDs derive from
    ``series_key``, so they are reproducible. Returns the series UID, SOP UIDs and paths in slice
    order.
    """
    from pydicom.uid import CTImageStorage, generate_uid

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    study_uid = generate_uid(entropy_srcs=[series_key, "study"])
    series_uid = generate_uid(entropy_srcs=[series_key, "series"])
    stored = np.clip(np.round((hu - rescale_intercept) / rescale_slope), 0, 65535).astype(np.uint16)
    sop_uids, paths = [], []
    for k, pixels in enumerate(stored):
        sop_uid = generate_uid(entropy_srcs=[series_key, str(k)])
        ds = _dicom_instance(CTImageStorage, sop_uid, study_uid, series_uid, series_key, "CT")
        ds.InstanceNumber = len(stored) - k  # deliberately not the spatial order
        ds.ImagePositionPatient = [-125.0, -125.0, float(k * slice_thickness)]
        ds.ImageOrientationPatient = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0]
        ds.PixelSpacing = [250.0 / pixels.shape[0]] * 2
        ds.SliceThickness = slice_thickness
        ds.RescaleIntercept, ds.RescaleSlope = rescale_intercept, rescale_slope
        ds.Rows, ds.Columns = pixels.shape
        ds.SamplesPerPixel, ds.PhotometricInterpretation = 1, "MONOCHROME2"
        ds.BitsAllocated, ds.BitsStored, ds.HighBit, ds.PixelRepresentation = 16, 16, 15, 0
        ds.PixelData = pixels.tobytes()
        path = out_dir / f"{sop_uid}.dcm"
        ds.save_as(path, enforce_file_format=True)
        sop_uids.append(sop_uid)
        paths.append(path)
    return series_uid, sop_uids, paths


def make_ct_cohort(out_dir: str | Path, n_scans: int, *, n_slices: int = 16, size: int = 64,
                   positive_fraction: float = 0.5, seed: int = 0) -> list[SyntheticScan]:
    """Write ``n_scans`` series under ``out_dir/<patient>/`` and ``out_dir/labels.csv`` (RSNA layout).

    Positive scans have a bleed on 2..n_slices/3 consecutive slices, labelled ``intraparenchymal``
    and ``any``.
    """
    import pandas as pd

    out_dir = Path(out_dir)
    rng = np.random.default_rng(seed)
    scans, rows = [], []
    for i in range(n_scans):
        key = f"synthetic-{seed}-{i:05d}"
        positive = rng.random() < positive_fraction
        bleed = None
        if positive:
            length = int(rng.integers(2, max(3, n_slices // 3 + 1)))
            first = int(rng.integers(1, n_slices - length))
            bleed = range(first, first + length)
        hu = head_phantom_hu(n_slices, size, rng, bleed)
        series_uid, sops, paths = write_ct_series(out_dir / f"patient_{i:05d}", hu, series_key=key)
        labels = np.zeros(n_slices, dtype=np.int8)
        if bleed is not None:
            labels[list(bleed)] = 1
        scans.append(SyntheticScan(series_uid, tuple(sops), tuple(paths), labels))
        for sop, y in zip(sops, labels):
            rows += [{"ID": f"ID_{sop}_{sub}", "Label": int(y) if sub in ("intraparenchymal", "any") else 0}
                     for sub in RSNA_SUBTYPES]
    pd.DataFrame(rows).to_csv(out_dir / "labels.csv", index=False)
    return scans


# ------------------------------------------------------------------------------ feature cohorts
def make_feature_cohort(path: str | Path, n_bags: int, mean_bag_size: float, n_features: int,
                        witness_rate: float, seed: int, *, positive_fraction: float = 0.5,
                        separation: float = 3.0, bags_per_batch: int = 4096,
                        overwrite: bool = False):
    """Write a synthetic feature cohort store and open it.

    Bag sizes are ``1 + Poisson(mean_bag_size - 1)``; a bag is positive with probability
    ``positive_fraction``. Instances are N(0, I) except witnesses (each instance of a positive bag
    with probability ``witness_rate``, at least one per positive bag), which are shifted by
    ``separation`` along a fixed random unit direction. Instance labels (witness or not) are stored.
    Bags are generated and appended ``bags_per_batch`` at a time, so memory holds one batch.
    """
    from tasks.store import BagData, CohortSpec, append_bags, create_cohort, open_cohort

    rng = np.random.default_rng(seed)
    direction = rng.normal(size=n_features)
    direction /= np.linalg.norm(direction)
    create_cohort(path, CohortSpec(name=Path(path).stem, n_features=n_features, coords_dim=1,
                                   coords_meaning="instance_index",
                                   feature_extractor={"name": "synthetic-gaussian", "params": {
                                       "seed": seed, "witness_rate": witness_rate, "separation": separation}}),
                  overwrite=overwrite)

    def bags():
        for first in range(0, n_bags, bags_per_batch):
            count = min(bags_per_batch, n_bags - first)
            sizes = 1 + rng.poisson(max(mean_bag_size - 1.0, 0.0), size=count)
            positive = rng.random(count) < positive_fraction
            X = rng.standard_normal(size=(int(sizes.sum()), n_features), dtype=np.float32)
            witness = np.repeat(positive, sizes) & (rng.random(len(X)) < witness_rate)
            offsets = np.concatenate([[0], np.cumsum(sizes)])
            for b in np.flatnonzero(positive & ~np.add.reduceat(witness, offsets[:-1]).astype(bool)):
                witness[offsets[b] + rng.integers(sizes[b])] = True
            X[witness] += (separation * direction).astype(np.float32)
            for b in range(count):
                rows = slice(offsets[b], offsets[b + 1])
                yield BagData(bag_id=f"bag{first + b:08d}", label=int(positive[b]), source="synthetic",
                              features=X[rows], coords=np.arange(sizes[b])[:, None],
                              instance_labels=witness[rows].astype(np.int8))

    append_bags(path, bags())
    return open_cohort(path)
