"""Whole-slide images: open a tiled pyramidal TIFF, find tissue, lay a tile grid, read tile batches;
:func:`ingest_slides` tiles a folder of slides into a store.

Slides are read with ``tifffile`` through its Zarr view of each pyramid level, so a tile read decodes
only the TIFF tiles it overlaps; memory holds one batch of tiles and the low-resolution mask, never
a whole level. (OpenSlide is not required; any tiled pyramidal TIFF/SVS that ``tifffile`` reads works.)

Tissue segmentation follows CLAM's ``segment_tissue`` (Lu et al., 2021): saturation channel of the
low-resolution image, median blur (``median_kernel=7``), Otsu threshold (never below
``min_saturation``, so an empty slide gives no tissue), morphological closing (``close_size=4``),
removal of small specks and filling of small holes. A tile is kept if at least ``min_tissue`` of
its area is tissue; its coordinates are the (row, col) of the tile grid at the tiling level.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tasks.ingest.driver import IngestItem, IngestPlan, IngestReport, Skipped, run_ingest
from tasks.ingest.errors import IngestError, NoTissueError, UnreadableFileError
from tasks.ingest.labels import labelled_items, read_panda_labels, split_undecodable
from tasks.paths import bag_file
from tasks.store import CohortSpec, _open_root

SLIDE_SUFFIXES = (".tif", ".tiff", ".svs", ".btf")


@dataclass(frozen=True)
class TilingParams:
    """How slides are tiled; recorded in the store's ``tiling`` attribute.

    ``magnification`` (if given) picks the pyramid level whose magnification is closest to it
    (it needs the base magnification in the slide metadata); otherwise ``level`` is used.
    """

    tile_size: int = 256
    level: int = 0
    magnification: float | None = None
    min_tissue: float = 0.5
    median_kernel: int = 7
    close_size: int = 4
    min_saturation: float = 20.0
    min_object_fraction: float = 0.001
    mask_max_side: int = 2048

    def as_attrs(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TileGrid:
    """Kept tiles of one slide: ``coords`` (K, 2) grid (row, col) at ``level``; ``tissue`` (K,) fractions."""

    level: int
    downsample: float
    tile_size: int
    shape: tuple[int, int]
    coords: np.ndarray
    tissue: np.ndarray
    mask: np.ndarray
    mask_downsample: float


class Slide:
    """A tiled pyramidal TIFF opened with ``tifffile`` (use as a context manager)."""

    def __init__(self, path: str | Path):
        import tifffile

        self.path = str(path)
        try:
            self._tiff = tifffile.TiffFile(self.path)
            series = self._tiff.series[0]
            self.level_shapes = [tuple(int(s) for s in level.shape[:2]) for level in series.levels]
            samples = series.levels[0].shape[2] if len(series.levels[0].shape) == 3 else 1
        except Exception as error:  # tifffile raises many types for a bad file
            raise UnreadableFileError(f"cannot open slide: {type(error).__name__}: {error}", path=self.path) from error
        if samples not in (3, 4) or series.dtype != np.uint8:
            self.close()
            raise UnreadableFileError(f"slide is not 8-bit RGB(A) (shape {series.shape}, dtype {series.dtype})",
                                      path=self.path)
        self._series = series
        self._levels: dict[int, Any] = {}
        base = self.level_shapes[0]
        self.downsamples = [float(np.mean([base[0] / shape[0], base[1] / shape[1]])) for shape in self.level_shapes]
        self.magnification = _base_magnification(self._tiff.pages[0].description or "")

    def __enter__(self) -> Slide:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._tiff.close()

    def level_array(self, level: int):
        """A lazy (H, W, C) Zarr view of ``level``."""
        import zarr

        if level not in self._levels:
            self._levels[level] = zarr.open(self._series.aszarr(level=level), mode="r")
        return self._levels[level]

    def read(self, level: int, rows: slice, cols: slice) -> np.ndarray:
        """RGB pixels of a region of ``level``."""
        try:
            return np.asarray(self.level_array(level)[rows, cols, :3])
        except Exception as error:
            raise UnreadableFileError(f"cannot decode slide data: {type(error).__name__}: {error}",
                                      path=self.path) from error

    def thumbnail(self, max_side: int) -> tuple[np.ndarray, float]:
        """The lowest-resolution level (subsampled to at most ``max_side`` px) and its downsample."""
        level = len(self.level_shapes) - 1
        height, width = self.level_shapes[level]
        step = max(1, int(np.ceil(max(height, width) / max_side)))
        stripe = max(step, (4096 // step) * step)
        parts = [self.read(level, slice(y, min(y + stripe, height)), slice(None))[::step, ::step]
                 for y in range(0, height, stripe)]
        return np.concatenate(parts, axis=0), self.downsamples[level] * step

    def choose_level(self, params: TilingParams) -> int:
        """The tiling level: ``params.level``, or the level closest in magnification to ``params.magnification``."""
        if params.magnification is None:
            if not 0 <= params.level < len(self.level_shapes):
                raise IngestError(f"slide has {len(self.level_shapes)} levels, level {params.level} requested",
                                  path=self.path)
            return params.level
        if self.magnification is None:
            raise IngestError("slide metadata gives no base magnification; tile by level instead", path=self.path)
        magnifications = self.magnification / np.asarray(self.downsamples)
        return int(np.argmin(np.abs(np.log(magnifications / params.magnification))))


def _base_magnification(description: str) -> float | None:
    """Base magnification from a JSON description (``"magnification"``) or Aperio's ``AppMag = 20``."""
    try:
        value = json.loads(description).get("magnification")
        return None if value is None else float(value)
    except (ValueError, AttributeError):
        pass
    match = re.search(r"AppMag\s*=\s*([0-9.]+)", description)
    return float(match.group(1)) if match else None


def tissue_mask(rgb: np.ndarray, params: TilingParams = TilingParams()) -> np.ndarray:
    """Boolean tissue mask of a low-resolution RGB image (CLAM-style saturation + Otsu + morphology)."""
    from scipy import ndimage
    from skimage.filters import rank, threshold_otsu
    from skimage.morphology import footprint_rectangle, remove_small_holes, remove_small_objects

    brightest, darkest = rgb[..., :3].max(axis=-1), rgb[..., :3].min(axis=-1)
    # HSV saturation (max - min) / max on the 0..255 scale, as OpenCV's cvtColor for uint8 images
    saturation = ((brightest.astype(np.uint16) - darkest) * 255 // np.maximum(brightest, 1)).astype(np.uint8)
    saturation = rank.median(saturation, footprint_rectangle((params.median_kernel, params.median_kernel)))
    threshold = max(float(threshold_otsu(saturation)) if saturation.min() < saturation.max() else np.inf,
                    params.min_saturation)
    mask = saturation > threshold
    mask = ndimage.binary_closing(mask, structure=np.ones((params.close_size, params.close_size)),
                                  border_value=0)
    min_size = max(1, int(params.min_object_fraction * mask.size))
    mask = remove_small_objects(mask, max_size=min_size)
    return remove_small_holes(mask, max_size=min_size)


def tile_grid(slide: Slide, params: TilingParams) -> TileGrid:
    """Tissue mask on the thumbnail and the kept tiles of the tiling level (row-major order)."""
    level = slide.choose_level(params)
    thumb, mask_downsample = slide.thumbnail(params.mask_max_side)
    mask = tissue_mask(thumb, params)
    downsample = slide.downsamples[level]
    height, width = slide.level_shapes[level]
    n_rows, n_cols = height // params.tile_size, width // params.tile_size
    # Tissue fraction of each tile: box sums of the mask over the tile's footprint (summed-area table).
    table = np.pad(mask.astype(np.float64).cumsum(0).cumsum(1), ((1, 0), (1, 0)))
    scale = params.tile_size * downsample / mask_downsample

    def edges(n: int, limit: int) -> np.ndarray:
        return np.clip(np.round(np.arange(n + 1) * scale).astype(np.int64), 0, limit)

    ys, xs = edges(n_rows, mask.shape[0]), edges(n_cols, mask.shape[1])
    area = np.maximum(np.diff(ys)[:, None] * np.diff(xs)[None, :], 1)
    box = table[ys[1:]][:, xs[1:]] - table[ys[:-1]][:, xs[1:]] - table[ys[1:]][:, xs[:-1]] + table[ys[:-1]][:, xs[:-1]]
    fraction = box / area
    keep = np.argwhere(fraction >= params.min_tissue)
    return TileGrid(level=level, downsample=downsample, tile_size=params.tile_size, shape=(n_rows, n_cols),
                    coords=keep.astype(np.int32), tissue=fraction[keep[:, 0], keep[:, 1]], mask=mask,
                    mask_downsample=mask_downsample)


def iter_tile_batches(slide: Slide, grid: TileGrid, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(tiles (B, t, t, 3) uint8, coords (B, 2))`` for the kept tiles, ``batch_size`` at a time."""
    t = grid.tile_size
    for start in range(0, len(grid.coords), batch_size):
        coords = grid.coords[start:start + batch_size]
        tiles = np.stack([slide.read(grid.level, slice(r * t, (r + 1) * t), slice(c * t, (c + 1) * t))
                          for r, c in coords])
        yield tiles, coords


def write_qc_thumbnail(path: str | Path, slide: Slide, grid: TileGrid, max_side: int = 1024) -> Path:
    """PNG of the slide's thumbnail with the kept tiles outlined in green and the mask edge in blue."""
    import matplotlib.image
    from scipy import ndimage

    thumb, thumb_downsample = slide.thumbnail(max_side)
    image = thumb[..., :3].copy()
    mask = ndimage.zoom(grid.mask.astype(np.uint8), np.array(image.shape[:2]) / grid.mask.shape, order=0).astype(bool)
    mask = mask[: image.shape[0], : image.shape[1]]
    edge = mask & ~ndimage.binary_erosion(mask)
    image[: edge.shape[0], : edge.shape[1]][edge] = (0, 90, 255)
    scale = grid.tile_size * grid.downsample / thumb_downsample
    height, width = image.shape[:2]
    for r, c in grid.coords:
        y0, x0 = int(r * scale), int(c * scale)
        y1, x1 = min(int((r + 1) * scale), height) - 1, min(int((c + 1) * scale), width) - 1
        image[y0:y1 + 1, [x0, x1]] = (0, 200, 0)
        image[[y0, y1], x0:x1 + 1] = (0, 200, 0)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    matplotlib.image.imsave(path, image)
    return path


def heatmap_background(path: str | Path, tiling: dict[str, Any], max_side: int = 1024) -> tuple[np.ndarray, float]:
    """The slide's thumbnail (RGB) and one tile's side in thumbnail pixels, for painting tile
    scores over the tissue (``tiling`` = the store's ``tiling`` attribute)."""
    params = TilingParams(**tiling)
    with Slide(path) as slide:
        thumb, thumb_downsample = slide.thumbnail(max_side)
        level = slide.choose_level(params)
        return thumb[..., :3], params.tile_size * slide.downsamples[level] / thumb_downsample


def sample_tiles(path: str | Path, params: TilingParams, n: int, rng: np.random.Generator) -> np.ndarray:
    """Up to ``n`` random kept tiles of one slide (for fitting an extractor); empty if no tissue."""
    with Slide(path) as slide:
        grid = tile_grid(slide, params)
        if not len(grid.coords):
            return np.zeros((0, params.tile_size, params.tile_size, 3), dtype=np.uint8)
        chosen = np.sort(rng.choice(len(grid.coords), size=min(n, len(grid.coords)), replace=False))
        picked = TileGrid(grid.level, grid.downsample, grid.tile_size, grid.shape, grid.coords[chosen],
                          grid.tissue[chosen], grid.mask, grid.mask_downsample)
        return next(iter_tile_batches(slide, picked, len(chosen)))[0]


def slide_bag_writer(item, writer, *, params: TilingParams, extractor, batch_size: int = 64,
                     qc_dir: str | None = None) -> None:
    """Ingest worker for one slide: tile grid → tile batches → features → the bag's staging writer.

    Raises :class:`NoTissueError` when no tile is kept. Writes ``<qc_dir>/<safe_filename(bag_id)>.png`` if asked.
    """
    with Slide(item.source) as slide:
        grid = tile_grid(slide, params)
        if not len(grid.coords):
            raise NoTissueError(f"no tile has >= {params.min_tissue:.0%} tissue", path=item.source, bag_id=item.bag_id)
        if qc_dir is not None:
            write_qc_thumbnail(bag_file(qc_dir, item.bag_id, ".png"), slide, grid)
        for tiles, coords in iter_tile_batches(slide, grid, batch_size):
            writer.write(extractor(tiles), coords, np.full(len(coords), -1, dtype=np.int8))


# ----------------------------------------------------------------------------- the entry point
def ingest_slides(store: str | Path, slides: str | Path | Sequence[str | Path], *,
                  labels_csv: str | Path | None = None, params=None, extractor=None, batch_size: int = 64,
                  qc_dir: str | Path | None = None, name: str | None = None, client: Any = None,
                  max_workers: int = 1, fit_tiles: int = 512, seed: int = 0, extractor_from: str | Path | None = None,
                  report_path: str | Path | None = None, on_progress=None) -> IngestReport:
    """Tile slides (a folder or a list; bag id = file stem = PANDA ``image_id``) into the store.

    ``params`` is a :class:`TilingParams`; ``extractor`` defaults to
    :class:`tasks.ingest.features.HandcraftedHE`. An extractor that needs fitting is fitted once on
    up to ``fit_tiles`` tiles sampled from the first slides, or, when the store exists, taken from
    the store's recorded parameters (so a resumed or extended ingest uses the same features). A new
    store takes them from the store ``extractor_from`` if given: a new cohort gets the features of
    the cohort a model was trained on.
    """
    plan = plan_slides(store, slides, labels_csv=labels_csv, params=params, extractor=extractor,
                       batch_size=batch_size, qc_dir=qc_dir, name=name, fit_tiles=fit_tiles, seed=seed,
                       extractor_from=extractor_from)
    return run_ingest(store, plan.spec, plan.items, plan.bag_writer, skipped=plan.skipped, client=client,
                      max_workers=max_workers, report_path=report_path, on_progress=on_progress)


def plan_slides(store: str | Path, slides: str | Path | Sequence[str | Path], *,
                labels_csv: str | Path | None = None, params=None, extractor=None, batch_size: int = 64,
                qc_dir: str | Path | None = None, name: str | None = None, fit_tiles: int = 512,
                seed: int = 0, extractor_from: str | Path | None = None) -> IngestPlan:
    """The plan of :func:`ingest_slides` (lists slides, reads labels, fits the extractor)."""
    from tasks.ingest.features import HandcraftedHE, extractor_from_spec, extractor_spec, needs_fit

    params = params or TilingParams()
    extractor = extractor or HandcraftedHE()
    listed = isinstance(slides, (str, Path))
    paths = (sorted(p for p in Path(slides).iterdir() if p.suffix.lower() in SLIDE_SUFFIXES)
             if listed else [Path(s) for s in slides])
    paths, skipped = split_undecodable(paths)
    paths, ambiguous = _unique_stems(paths)
    labels = None if labels_csv is None else read_panda_labels(labels_csv)
    items, unlabelled = labelled_items(((p.stem, str(p), None) for p in paths), labels,
                                       None if labels_csv is None else str(labels_csv))
    skipped += ambiguous + unlabelled
    if listed and labels is not None:  # listed in the labels file, absent from the folder: say so
        present = {p.stem for p in paths} | {s.bag_id for s in ambiguous}
        skipped += [Skipped(path=str(Path(slides) / bag_id), bag_id=bag_id, error="UnreadableFileError",
                            reason=f"listed in {labels_csv} but no slide file {bag_id}.* in {slides}")
                    for bag_id in labels if bag_id not in present]
    if needs_fit(extractor):
        recorded = _recorded_extractor(store, extractor_from)
        if recorded is not None and recorded.get("name") == extractor.name:
            extractor = extractor_from_spec(recorded)
        else:
            extractor = extractor.fit(_fit_sample(items, params, fit_tiles, seed))
    spec = CohortSpec(name=name or Path(str(store)).stem, n_features=int(extractor.n_features), coords_dim=2,
                      coords_meaning="tile_row,tile_col", feature_extractor=extractor_spec(extractor),
                      tiling=params.as_attrs())
    writer = functools.partial(slide_bag_writer, params=params, extractor=extractor, batch_size=batch_size,
                               qc_dir=None if qc_dir is None else str(qc_dir))
    return IngestPlan(spec, items, skipped, writer)


def _unique_stems(paths: Sequence[Path]) -> tuple[list[Path], list[Skipped]]:
    """Slides whose stem (the bag id) names one file only; ``x.tif`` beside ``x.tiff`` is
    ambiguous: both are skipped, never one of them picked silently."""
    by_stem: dict[str, list[Path]] = {}
    for path in paths:
        by_stem.setdefault(path.stem, []).append(path)
    unique = [p for p in paths if len(by_stem[p.stem]) == 1]
    ambiguous = [Skipped(path=str(group[0].parent), bag_id=stem, error="DuplicateIdError",
                         reason=f"{len(group)} files for one slide id: {', '.join(p.name for p in group)}; keep one")
                 for stem, group in by_stem.items() if len(group) > 1]
    return unique, ambiguous


def _recorded_extractor(store: str | Path, extractor_from: str | Path | None) -> dict[str, Any] | None:
    """The extractor spec recorded in ``store`` if it exists, else in ``extractor_from`` if given."""
    if (Path(store) / "zarr.json").exists():
        return _open_root(store, "r").attrs["feature_extractor"]
    if extractor_from is None:
        return None
    if not (Path(extractor_from) / "zarr.json").exists():
        raise IngestError("no cohort store to take the feature extractor from", path=str(extractor_from))
    return _open_root(extractor_from, "r").attrs["feature_extractor"]


def _fit_sample(items: Sequence[IngestItem], params: TilingParams, n_tiles: int, seed: int) -> np.ndarray:
    """Up to ``n_tiles`` tiles from the first (at most 8) readable slides with tissue."""
    rng = np.random.default_rng(seed)
    per_slide = -(-n_tiles // min(8, max(len(items), 1)))
    tiles, used = [], 0
    for item in items:
        try:
            sample = sample_tiles(item.source, params, per_slide, rng)
        except IngestError:
            continue  # the worker reports it
        if len(sample):
            tiles.append(sample)
            used += 1
        if used == 8 or sum(map(len, tiles)) >= n_tiles:
            break
    if not tiles:
        raise IngestError("no readable slide with tissue to fit the feature extractor on")
    return np.concatenate(tiles)[:n_tiles]
