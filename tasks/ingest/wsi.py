"""Whole-slide images: find tissue, lay a tile grid at a physical scale, read tile batches;
:func:`ingest_slides` tiles a folder of slides into a store.

Slides are opened with :func:`tasks.ingest.slide_io.open_slide` (OpenSlide, or tifffile for the
TIFFs OpenSlide cannot open). Memory holds one batch of tiles, the low-resolution mask and one strip
of the mask's level while the thumbnail is read, never a whole level.

Scale: with ``target_mpp`` a tile covers ``tile_size × target_mpp`` µm (e.g. 256 px at 0.5 µm/px =
128 µm), whatever the scanner: the slide's level-0 µm/px (metadata, or ``base_mpp`` to override it)
gives the level-0 footprint ``tile_size × target_mpp / mpp``; the coarsest level at least as fine
is read and resized to ``tile_size``. ``magnification`` does the same at ``base magnification /
magnification`` level-0 pixels per tile pixel; ``level`` reads that pyramid level at ``tile_size``
pixels. The grid is laid on level 0; each kept tile is stored as
``(tile_row, tile_col, x, y)``: its grid index and the level-0 pixel of its top-left corner (the
CLAM/TRIDENT convention).

Tissue segmentation follows CLAM's ``segment_tissue`` (Lu et al., 2021): saturation channel of the
low-resolution image (:func:`mask_level`), median blur (``median_kernel=7``), Otsu threshold (never below
``min_saturation``, so an empty slide gives no tissue), morphological closing (``close_size=4``),
removal of small specks and filling of small holes. A tile is kept if at least ``min_tissue`` of
its area is tissue.
"""

from __future__ import annotations

import functools
import io
from collections.abc import Collection, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from tasks.ingest.driver import (IngestItem, IngestPlan, IngestReport, Skipped, ingested_from_elsewhere, recorded_extractor, run_ingest,
                                 summarise_left_out)
from tasks.ingest.errors import IngestError, NoTissueError
from tasks.ingest.labels import LabelSpec, ids_without_input, labelled_items, read_panda_labels, split_undecodable
from tasks.ingest.slide_io import SLIDE_PATTERNS, STRIP_ROWS, SlideReader, find_slides, open_slide, slide_files, slide_id
from tasks.paths import bag_file
from tasks.store import CohortSpec

COORDS_MEANING = "tile_row,tile_col,x,y (x, y: level-0 pixels of the tile's top-left corner)"


SET_BASE_MPP = "set ingest.base_mpp (a new cohort's in gpmil predict --source: --base-mpp)"
"""How a slide's µm/px is given where its metadata has none, or a wrong one."""


@dataclass(frozen=True)
class TilingParams:
    """How slides are tiled; recorded in the store's ``tiling`` attribute.

    ``target_mpp`` (µm per pixel of the tiles, e.g. 0.5) tiles at a physical scale, from the
    slide's level-0 µm/px (``base_mpp`` overrides the metadata). Otherwise ``magnification`` tiles
    at that objective power from the base magnification in the metadata (read at the coarsest level
    at least as fine, resized), else ``level`` reads that level as it is. ``reader``: ``auto``, ``openslide`` or ``tifffile``.
    """

    tile_size: int = 256
    level: int = 0
    magnification: float | None = None
    target_mpp: float | None = None
    base_mpp: float | None = None
    reader: str = "auto"
    min_tissue: float = 0.5
    median_kernel: int = 7
    close_size: int = 4
    min_saturation: float = 20.0
    min_object_fraction: float = 0.001
    mask_max_side: int = 2048

    def as_attrs(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class TileGeometry:
    """Where tiles of one slide are read: pyramid ``level``, ``read_size`` pixels there (resized to
    the tile size), ``side0`` level-0 pixels per tile (the grid step)."""

    level: int
    read_size: int
    side0: float


@dataclass(frozen=True)
class TileGrid:
    """Kept tiles of one slide: ``coords`` (K, 4) = (row, col, x, y level-0); ``tissue`` (K,) fractions."""

    geometry: TileGeometry
    tile_size: int
    shape: tuple[int, int]
    coords: np.ndarray
    tissue: np.ndarray
    mask: np.ndarray
    mask_downsample: float


def choose_level(slide: SlideReader, params: TilingParams) -> int:
    """The level read without ``target_mpp`` or ``magnification``: ``params.level``, if the slide has it."""
    if not 0 <= params.level < len(slide.level_shapes):
        raise IngestError(f"slide has {len(slide.level_shapes)} levels, level {params.level} requested", path=slide.path)
    return params.level


PLAUSIBLE_MPP = (0.05, 20.0)
"""µm/px a slide scanner's level 0 can have; a value outside (a TIFF's default 72 dpi reads as 352.8)
is metadata that does not describe the scan."""


def tile_geometry(slide: SlideReader, params: TilingParams) -> TileGeometry:
    """The level, read size and level-0 footprint of a tile of ``slide`` under ``params``:
    ``target_mpp`` and ``magnification`` read the coarsest level at least as fine as asked and
    resize (a 20x tile of a 40x slide whose pyramid has downsamples 1, 4, 16 is read at level 0 and
    halved; the nearest level, 40x, was taken before), ``level`` reads that level as it is."""
    if params.target_mpp is None and params.magnification is None:
        level = choose_level(slide, params)
        return TileGeometry(level, params.tile_size, params.tile_size * slide.downsamples[level])
    if params.target_mpp is None:
        if slide.magnification is None:
            raise IngestError("slide metadata gives no base magnification; tile by target_mpp or level instead",
                              path=slide.path)
        scale = slide.magnification / params.magnification  # level-0 pixels per tile pixel
        return _resampled_geometry(slide, params, scale)
    mpp = params.base_mpp or slide.mpp
    if mpp is None:
        raise IngestError(f"{slide.mpp_problem}: {SET_BASE_MPP}, or tile by level" if slide.mpp_problem else
                          f"slide metadata gives no µm/px ({SET_BASE_MPP}, or tile by level)", path=slide.path)
    if params.base_mpp is None and slide.mpp_y is not None and abs(slide.mpp_y / mpp - 1) > 0.01:
        raise IngestError(f"slide metadata gives non-square pixels, {mpp:g} µm/px across and {slide.mpp_y:g} µm/px "
                          f"down: a square tile would not be square on the slide; {SET_BASE_MPP} to override the "
                          "metadata, or tile by level", path=slide.path)
    if params.base_mpp is None and not PLAUSIBLE_MPP[0] <= mpp <= PLAUSIBLE_MPP[1]:
        raise IngestError(f"slide metadata gives {mpp:g} µm/px, which no scanner gives (a default 72-dpi resolution "
                          f"tag?): {SET_BASE_MPP} to the scan's µm/px, or tile by level", path=slide.path)
    return _resampled_geometry(slide, params, params.target_mpp / mpp)


def _resampled_geometry(slide: SlideReader, params: TilingParams, scale: float) -> TileGeometry:
    """Tiles of ``scale`` level-0 pixels per tile pixel: read at the coarsest level at least as
    fine (level 0 if none), resized down to the tile size."""
    finer = [i for i, d in enumerate(slide.downsamples) if d <= scale * 1.01]
    level = max(finer, key=lambda i: slide.downsamples[i]) if finer else 0
    side0 = params.tile_size * scale
    return TileGeometry(level, max(1, int(round(side0 / slide.downsamples[level]))), side0)


def _colourless_hint(slide: SlideReader) -> str:
    """Why a slide without tissue may be no H&E slide: a grayscale image (all channels equal) has no
    saturation, which the tissue mask reads; one of a single grey level (blank glass) has nothing."""
    thumb, _ = slide.thumbnail(256)
    rgb = thumb[..., :3].astype(np.int16)
    if int(np.ptp(rgb, axis=-1).max()) > 2:
        return ""
    if int(np.ptp(rgb)) <= 8:  # within a few levels of one grey: compression noise at most
        return f"; the slide is blank (every pixel grey {int(np.median(rgb))} of 255 or within 8 of it): no tissue was found"
    return ("; the slide has no colour (grayscale, or fluorescence in one channel): the tissue mask finds H&E "
            "tissue by its saturation")


DARKEST_TISSUE = 32
"""A pixel whose brightest channel is below this (of 255) is background or ink, never stained tissue."""


def tissue_mask(rgb: np.ndarray, params: TilingParams = TilingParams()) -> np.ndarray:
    """Boolean tissue mask of a low-resolution RGB image (CLAM-style saturation + Otsu + morphology;
    near-black pixels, :data:`DARKEST_TISSUE`, are not tissue)."""
    from scipy import ndimage
    from skimage.filters import rank, threshold_otsu
    from skimage.morphology import footprint_rectangle, remove_small_holes, remove_small_objects

    brightest, darkest = rgb[..., :3].max(axis=-1), rgb[..., :3].min(axis=-1)
    # HSV saturation (max - min) / max on the 0..255 scale, as OpenCV's cvtColor for uint8 images
    saturation = ((brightest.astype(np.uint16) - darkest) * 255 // np.maximum(brightest, 1)).astype(np.uint8)
    saturation[brightest < DARKEST_TISSUE] = 0  # near-black noise is fully saturated: a dark background became "tissue"
    saturation = rank.median(saturation, footprint_rectangle((params.median_kernel, params.median_kernel)))
    threshold = max(float(threshold_otsu(saturation)) if saturation.min() < saturation.max() else np.inf,
                    params.min_saturation)
    mask = saturation > threshold
    mask = ndimage.binary_closing(mask, structure=np.ones((params.close_size, params.close_size)),
                                  border_value=0)
    min_size = max(1, int(params.min_object_fraction * mask.size))
    mask = remove_small_objects(mask, max_size=min_size)
    return remove_small_holes(mask, max_size=min_size)


MASK_PX_PER_TILE = 8
"""Mask pixels a tile side spans at least, unless ``mask_max_side`` bounds the mask: the 7-px
median filter erased tissue a few mask pixels wide (a pyramid's lowest level, down to one TIFF tile
in a libvips pyramid, gave a 64-px tile of a 6144 × 8192 slide one mask pixel: 246 of 1185 tissue
tiles were lost)."""


def mask_level(slide: SlideReader, params: TilingParams) -> int:
    """The level the tissue mask is read from, subsampled to at most ``mask_max_side`` px (every
    ``step``-th pixel: its mask pixel spans ``downsample × step`` level-0 px): the coarsest on which
    a tile spans :data:`MASK_PX_PER_TILE` mask pixels or whose mask is within 1.5× of the finest any
    level gives. Where ``mask_max_side`` decides (a 100k-px slide), a finer level subsampled to about
    the same mask would cost up to 256× the reads: the lowest level is read there, as before."""
    def mask_px(level: int) -> float:
        return slide.downsamples[level] * max(1, int(np.ceil(max(slide.level_shapes[level]) / params.mask_max_side)))

    levels = range(len(slide.downsamples))
    enough = max(tile_geometry(slide, params).side0 / MASK_PX_PER_TILE, 1.5 * min(map(mask_px, levels)))
    return max((i for i in levels if mask_px(i) <= enough * 1.01), key=lambda i: slide.downsamples[i])


def tile_grid(slide: SlideReader, params: TilingParams) -> TileGrid:
    """Tissue mask on the thumbnail of the mask level and the kept tiles of the level-0 grid (row-major order)."""
    thumb, mask_downsample = slide.thumbnail(params.mask_max_side, mask_level(slide, params))
    return grid_from_mask(slide, params, tissue_mask(thumb, params), mask_downsample)


def _mask_edges(n: int, side0: float, mask_downsample: float, limit: int) -> np.ndarray:
    """Mask rows (or columns) where each of ``n`` tiles of level-0 side ``side0`` starts, and the end."""
    return np.clip(np.round(np.arange(n + 1) * (side0 / mask_downsample)).astype(np.int64), 0, limit)


def grid_from_mask(slide: SlideReader, params: TilingParams, mask: np.ndarray, mask_downsample: float) -> TileGrid:
    """The kept tiles of the level-0 grid (row-major order) under a tissue mask of the thumbnail."""
    geometry = tile_geometry(slide, params)
    height, width = slide.level_shapes[0]
    n_rows, n_cols = int(height // geometry.side0), int(width // geometry.side0)
    # Tissue fraction of each tile: box sums of the mask over the tile's footprint (summed-area table).
    table = np.pad(mask.astype(np.float64).cumsum(0).cumsum(1), ((1, 0), (1, 0)))
    ys = _mask_edges(n_rows, geometry.side0, mask_downsample, mask.shape[0])
    xs = _mask_edges(n_cols, geometry.side0, mask_downsample, mask.shape[1])
    area = np.maximum(np.diff(ys)[:, None] * np.diff(xs)[None, :], 1)
    box = table[ys[1:]][:, xs[1:]] - table[ys[:-1]][:, xs[1:]] - table[ys[1:]][:, xs[:-1]] + table[ys[:-1]][:, xs[:-1]]
    fraction = box / area
    keep = np.argwhere(fraction >= params.min_tissue)
    xy = np.round(keep[:, ::-1] * geometry.side0).astype(np.int64)
    return TileGrid(geometry=geometry, tile_size=params.tile_size, shape=(n_rows, n_cols),
                    coords=np.concatenate([keep, xy], axis=1).astype(np.int64),
                    tissue=fraction[keep[:, 0], keep[:, 1]], mask=mask, mask_downsample=mask_downsample)


def _resize(tiles: np.ndarray, size: int, chunk: int = 8) -> np.ndarray:
    """(B, s, s, 3) uint8 → (B, size, size, 3) uint8 (block mean when ``size`` divides ``s``),
    ``chunk`` tiles at a time: the float32 work copy of a whole batch of large reads was the peak."""
    from tasks.ingest.features import downscale

    if tiles.shape[1] == size:
        return tiles
    out = np.empty((len(tiles), size, size, tiles.shape[3]), dtype=np.uint8)
    for start in range(0, len(tiles), chunk):
        out[start:start + chunk] = np.clip(np.round(downscale(tiles[start:start + chunk], size)), 0, 255)
    return out


def iter_tile_batches(slide: SlideReader, grid: TileGrid, batch_size: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(tiles (B, t, t, 3) uint8, coords (B, 4))`` for the kept tiles, ``batch_size`` at a time."""
    g = grid.geometry
    downsample = slide.downsamples[g.level]
    for start in range(0, len(grid.coords), batch_size):
        coords = grid.coords[start:start + batch_size]
        tiles = []
        for x, y in coords[:, 2:4]:
            y_l, x_l = int(round(y / downsample)), int(round(x / downsample))
            tiles.append(slide.read(g.level, slice(y_l, y_l + g.read_size), slice(x_l, x_l + g.read_size)))
        yield _resize(np.stack(tiles), grid.tile_size), coords


def write_qc_thumbnail(path: str | Path, slide: SlideReader, grid: TileGrid, max_side: int = 1024,
                       thumbnail: tuple[np.ndarray, float] | None = None) -> Path:
    """PNG of the slide's thumbnail with the kept tiles outlined in green and the mask edge in blue
    (``thumbnail``: one already read, ``(pixels, downsample)``, subsampled to ``max_side``)."""
    import matplotlib.image
    from scipy import ndimage

    from mil_core.persist import write_whole  # here: slide ingest processes do not import mil_core

    if thumbnail is None:
        thumb, thumb_downsample = slide.thumbnail(max_side)
    else:
        every = max(1, int(np.ceil(max(thumbnail[0].shape[:2]) / max_side)))
        thumb, thumb_downsample = thumbnail[0][::every, ::every], thumbnail[1] * every
    image = thumb[..., :3].copy()
    mask = ndimage.zoom(grid.mask.astype(np.uint8), np.array(image.shape[:2]) / grid.mask.shape, order=0).astype(bool)
    mask = mask[: image.shape[0], : image.shape[1]]
    edge = mask & ~ndimage.binary_erosion(mask)
    image[: edge.shape[0], : edge.shape[1]][edge] = (0, 90, 255)
    side = grid.geometry.side0 / thumb_downsample
    height, width = image.shape[:2]
    for x, y in grid.coords[:, 2:4] / thumb_downsample:
        y0, x0 = min(int(y), height - 1), min(int(x), width - 1)
        y1, x1 = min(int(y + side), height) - 1, min(int(x + side), width) - 1
        image[y0:y1 + 1, [x0, x1]] = (0, 200, 0)
        image[[y0, y1], x0:x1 + 1] = (0, 200, 0)
    buffer = io.BytesIO()
    matplotlib.image.imsave(buffer, image, format="png")
    return write_whole(path, buffer.getvalue())  # a shared qc/ folder: never through a link there


def heatmap_background(path: str | Path, tiling: dict[str, Any], max_side: int = 1024) -> tuple[np.ndarray, float, float]:
    """The slide's thumbnail (RGB, at most ``max_side`` px), its downsample from level 0 and one
    tile's level-0 side, for painting tile scores over the tissue (``tiling`` = the store's
    ``tiling`` attribute)."""
    params = TilingParams(**tiling)
    with open_slide(path, params.reader) as slide:
        thumb, thumb_downsample = slide.thumbnail(max_side)
        return thumb[..., :3], thumb_downsample, tile_geometry(slide, params).side0


def sample_tiles(path: str | Path, params: TilingParams, n: int, rng: np.random.Generator) -> np.ndarray:
    """Up to ``n`` random kept tiles of one slide (for fitting an extractor); empty if no tissue."""
    with open_slide(path, params.reader) as slide:
        grid = tile_grid(slide, params)
        if not len(grid.coords):
            return np.zeros((0, params.tile_size, params.tile_size, 3), dtype=np.uint8)
        chosen = np.sort(rng.choice(len(grid.coords), size=min(n, len(grid.coords)), replace=False))
        picked = TileGrid(grid.geometry, grid.tile_size, grid.shape, grid.coords[chosen], grid.tissue[chosen],
                          grid.mask, grid.mask_downsample)
        return np.concatenate([tiles for tiles, _ in iter_tile_batches(slide, picked, 64)])  # 64 reads at a time


def reads_once(slide: SlideReader, params: TilingParams) -> bool:
    """Whether tiles are read from the level the mask is read from (:func:`mask_level`; a
    single-level slide, or tiles at the lowest level): then :func:`features_in_one_pass` reads that
    level once."""
    return tile_geometry(slide, params).level == mask_level(slide, params)


def features_in_one_pass(slide: SlideReader, params: TilingParams, extractor, batch_size: int = 64
                         ) -> tuple[TileGrid, np.ndarray, tuple[np.ndarray, float]]:
    """Tissue mask, tile grid and the kept tiles' features from one read of the tile level.

    The level is read a tile row at a time (a band of ``read_size`` rows, full width); each band
    gives its rows of the thumbnail (the same pixels :meth:`SlideReader.thumbnail` takes) and its
    tiles. The tissue mask needs the whole thumbnail, so tiles are featurised when they *could* be
    tissue: pixels within the reach of the median filter and the closing (``median_kernel // 2 +
    close_size`` thumbnail px) of a pixel more saturated than ``min_saturation`` cover at least
    ``min_tissue`` of their footprint (the mask before hole filling lies within that reach); the
    few kept tiles featurised no earlier (tissue only through filled holes) are read once more at
    the end. Memory: the bands of the tile rows not yet decided (two, unless the reach spans more
    rows), one batch of tiles, the thumbnail and the candidate tiles' features. Returns the grid,
    its kept tiles' features (K, D) and the thumbnail with its downsample.
    """
    from collections import deque

    from scipy import ndimage

    g = tile_geometry(slide, params)
    downsample = slide.downsamples[g.level]
    height, width = slide.level_shapes[g.level]
    step = max(1, int(np.ceil(max(height, width) / params.mask_max_side)))
    thumb = np.empty((-(-height // step), -(-width // step), 3), dtype=np.uint8)
    saturated = np.zeros(thumb.shape[:2], dtype=bool)  # raw saturation > min_saturation, per thumbnail pixel
    mask_downsample = downsample * step
    n_rows, n_cols = int(slide.level_shapes[0][0] // g.side0), int(slide.level_shapes[0][1] // g.side0)
    ys = _mask_edges(n_rows, g.side0, mask_downsample, thumb.shape[0])
    xs = _mask_edges(n_cols, g.side0, mask_downsample, thumb.shape[1])
    reach = params.median_kernel // 2 + params.close_size
    square = np.ones((2 * reach + 1, 2 * reach + 1), dtype=bool)
    tile_y = [int(round(round(r * g.side0) / downsample)) for r in range(n_rows)]
    tile_x = [int(round(round(c * g.side0) / downsample)) for c in range(n_cols)]
    band_width = max(width, tile_x[-1] + g.read_size if tile_x else 0)
    covered = 0  # level rows [0, covered) are in the thumbnail

    def take(rows: np.ndarray, first: int) -> None:
        """Thumbnail rows (every ``step``-th level row and column) of level rows ``first…``."""
        nonlocal covered
        wanted = np.arange(-(-max(first, covered) // step) * step, min(first + len(rows), height), step)
        if wanted.size:
            part = rows[wanted - first, :width:step]
            thumb[wanted // step] = part
            brightest, darkest = part.max(axis=-1), part.min(axis=-1)
            saturation = (brightest.astype(np.uint16) - darkest) * 255 // np.maximum(brightest, 1)
            saturated[wanted // step] = saturation > params.min_saturation
        covered = max(covered, min(first + len(rows), height))

    def fill_thumbnail(stop: int) -> None:
        """Read the level rows [covered, stop) that no band covers, for the thumbnail only."""
        for start in range(covered, min(stop, height), STRIP_ROWS):
            take(slide.read(g.level, slice(start, min(start + STRIP_ROWS, stop, height)), slice(0, width)), start)

    features: dict[tuple[int, int], np.ndarray] = {}
    batch: list[np.ndarray] = []
    batch_keys: list[tuple[int, int]] = []

    def flush() -> None:
        if batch:
            for key, row in zip(batch_keys, np.asarray(extractor(_resize(np.stack(batch), params.tile_size)))):
                features[key] = row
            batch.clear()
            batch_keys.clear()

    def featurise_candidates(r: int, band: np.ndarray) -> None:
        # Tissue (before hole filling) lies within ``reach`` of a saturated pixel: a tile can reach
        # min_tissue only if that neighbourhood covers at least min_tissue of its footprint.
        top = max(0, ys[r] - reach)
        grown = ndimage.binary_dilation(saturated[top:ys[r + 1] + reach], structure=square)[ys[r] - top:ys[r + 1] - top]
        columns = np.concatenate([[0], grown.sum(axis=0).cumsum()])
        for c in range(n_cols):
            area = max((ys[r + 1] - ys[r]) * (xs[c + 1] - xs[c]), 1)
            if (columns[xs[c + 1]] - columns[xs[c]]) / area >= params.min_tissue:
                batch.append(band[:, tile_x[c]:tile_x[c] + g.read_size].copy())  # a copy: no view keeps the band alive
                batch_keys.append((r, c))
                if len(batch) >= batch_size:
                    flush()

    pending: deque[tuple[int, np.ndarray]] = deque()
    for r in range(n_rows):
        fill_thumbnail(tile_y[r])
        band = slide.read(g.level, slice(tile_y[r], tile_y[r] + g.read_size), slice(0, band_width))
        take(band, tile_y[r])
        pending.append((r, band))
        while pending and (ys[pending[0][0] + 1] + reach) * step <= covered:
            featurise_candidates(*pending.popleft())
    fill_thumbnail(height)
    while pending:
        featurise_candidates(*pending.popleft())
    flush()

    grid = grid_from_mask(slide, params, tissue_mask(thumb, params), mask_downsample)
    missed = [i for i, (r, c) in enumerate(grid.coords[:, :2].tolist()) if (r, c) not in features]
    if missed:  # kept only through hole filling: read these few tiles again
        picked = TileGrid(grid.geometry, grid.tile_size, grid.shape, grid.coords[missed], grid.tissue[missed],
                          grid.mask, grid.mask_downsample)
        for tiles, coords in iter_tile_batches(slide, picked, batch_size):
            for (r, c), row in zip(coords[:, :2].tolist(), np.asarray(extractor(tiles))):
                features[(r, c)] = row
    kept = [features[(r, c)] for r, c in grid.coords[:, :2].tolist()]
    n_features = int(getattr(extractor, "n_features", 0))
    return grid, (np.stack(kept) if kept else np.zeros((0, n_features), dtype=np.float32)), (thumb, mask_downsample)


def slide_bag_writer(item, writer, *, params: TilingParams, extractor, batch_size: int = 64,
                     qc_dir: str | None = None) -> None:
    """Ingest worker for one slide: tile grid → tile batches → features → the bag's staging writer.

    A slide whose tiles come from the level its mask is read from (a single-level slide) is read
    once (:func:`features_in_one_pass`); a pyramid's mask comes from :func:`mask_level` and its
    tiles from the tile level. Raises :class:`NoTissueError` when no tile is kept. Writes
    ``<qc_dir>/<safe_filename(bag_id)>.png`` if asked.
    """
    with open_slide(item.source, params.reader) as slide:
        if reads_once(slide, params):
            grid, features, thumbnail = features_in_one_pass(slide, params, extractor, batch_size)
            batches = ((features[i:i + batch_size], grid.coords[i:i + batch_size]) for i in range(0, len(features), batch_size))
        else:
            grid, thumbnail = tile_grid(slide, params), None
            batches = ((extractor(tiles), coords) for tiles, coords in iter_tile_batches(slide, grid, batch_size))
        if not len(grid.coords):
            rows, cols = grid.shape
            why = (f"the slide ({slide.level_shapes[0][1]} × {slide.level_shapes[0][0]} px at level 0) is smaller than one "
                   f"tile ({grid.geometry.side0:g} level-0 px); lower ingest.tile_size" if rows * cols == 0 else
                   f"no tile has >= {params.min_tissue:.0%} tissue" + _colourless_hint(slide))
            raise NoTissueError(why, path=item.source, bag_id=item.bag_id)
        if qc_dir is not None:
            write_qc_thumbnail(bag_file(qc_dir, item.bag_id, ".png"), slide, grid, thumbnail=thumbnail)
        for batch_features, coords in batches:
            writer.write(batch_features, coords, np.full(len(coords), -1, dtype=np.int8))


# ----------------------------------------------------------------------------- the entry point
def ingest_slides(store: str | Path, slides: str | Path | Sequence[str | Path], *,
                  labels_csv: str | Path | None = None, params=None, extractor=None, batch_size: int = 64,
                  qc_dir: str | Path | None = None, name: str | None = None, client: Any = None,
                  max_workers: int = 1, fit_tiles: int = 512, seed: int = 0, extractor_from: str | Path | None = None,
                  report_path: str | Path | None = None, on_progress=None,
                  patterns: Sequence[str] = SLIDE_PATTERNS, recursive: bool = True, trusted: Collection[str] = ()) -> IngestReport:
    """Tile slides (a folder, searched for ``patterns`` recursively, or a list; bag id = file stem =
    PANDA ``image_id``, or the folder name of a DICOM-WSI) into the store.

    ``params`` is a :class:`TilingParams`; ``extractor`` defaults to
    :class:`tasks.ingest.features.HandcraftedHE`. An extractor that needs fitting is fitted once on
    up to ``fit_tiles`` tiles sampled from the first slides, or, when the store exists, taken from
    the store's recorded parameters (so a resumed or extended ingest uses the same features). A new
    store takes them from the store ``extractor_from`` if given: a new cohort gets the features of
    the cohort a model was trained on. ``trusted``: import paths the recorded extractor may name
    (:func:`plan_slides`).
    """
    plan = plan_slides(store, slides, labels_csv=labels_csv, params=params, extractor=extractor,
                       batch_size=batch_size, qc_dir=qc_dir, name=name, fit_tiles=fit_tiles, seed=seed,
                       extractor_from=extractor_from, patterns=patterns, recursive=recursive, trusted=trusted)
    return run_ingest(store, plan.spec, plan.items, plan.bag_writer, skipped=plan.skipped, client=client,
                      max_workers=max_workers, report_path=report_path, on_progress=on_progress)


def plan_slides(store: str | Path, slides: str | Path | Sequence[str | Path], *,
                labels_csv: str | Path | None = None, params=None, extractor=None, batch_size: int = 64,
                qc_dir: str | Path | None = None, name: str | None = None, fit_tiles: int = 512,
                seed: int = 0, extractor_from: str | Path | None = None,
                patterns: Sequence[str] = SLIDE_PATTERNS, recursive: bool = True, keep_unlabelled: bool = False,
                trusted: Collection[str] = ()) -> IngestPlan:
    """The plan of :func:`ingest_slides` (finds slides, reads labels, fits the extractor); files of
    the folder that are not slides are in ``skipped`` with the reason; slides the labels do not
    list are too, unless ``keep_unlabelled`` (then they are unlabelled bags). An extractor the store
    records is rebuilt only from installed code and the import paths in ``trusted`` or of the
    configured ``extractor`` (:func:`~tasks.ingest.features.extractor_from_spec`)."""
    from tasks.ingest.features import HandcraftedHE, extractor_from_spec, extractor_spec, needs_fit, trusted_imports

    params = params or TilingParams()
    recorded, recorded_in = recorded_extractor(store, extractor_from)
    if extractor is None and recorded is not None:  # the store's (or the training store's) extractor
        extractor = extractor_from_spec(recorded, source=recorded_in, trusted=trusted)
    extractor = extractor or HandcraftedHE()
    listed = isinstance(slides, (str, Path))
    paths, left_out = find_slides(slides, patterns, recursive)
    paths, undecodable = split_undecodable(paths)
    paths, ambiguous = _unique_stems(paths)
    labels, originals = ((None, None) if labels_csv is None else labels_csv.read() if isinstance(labels_csv, LabelSpec)
                         else read_panda_labels(labels_csv))
    labels_path = None if labels_csv is None else str(getattr(labels_csv, "file", labels_csv))
    items, unlabelled = labelled_items(((slide_id(p), str(p), None) for p in paths), labels, labels_path, originals,
                                       keep_unlabelled)
    items = [replace(item, inputs=slide_files(item.source)) for item in items]  # a DICOM-WSI folder, a MIRAX slide's data
    skipped = [Skipped.from_error(error) for error in left_out] + undecodable + ambiguous + unlabelled
    if listed and labels is not None:  # listed in the labels file, absent from the folder: say so
        present = [slide_id(p) for p in paths] + [s.bag_id for s in ambiguous] + ingested_from_elsewhere(store, slides)
        skipped += [Skipped(path=str(Path(slides) / bag_id), bag_id=bag_id, error="UnreadableFileError",
                            reason=f"listed in {labels_path} but no slide file {bag_id}.* under {slides}")
                    for bag_id in ids_without_input(labels, present)]
    if needs_fit(extractor):
        if recorded is not None and recorded.get("name") == extractor.name:
            extractor = extractor_from_spec(recorded, source=recorded_in, trusted={*trusted, *trusted_imports(extractor)})
        elif not items:
            raise IngestError(f"no slide to ingest: {summarise_left_out(f'{len(paths)} slide file(s) found', skipped)}",
                              path=str(slides) if listed else None)
        else:
            extractor = extractor.fit(_fit_sample(items, params, fit_tiles, seed))
    spec = CohortSpec(name=name or Path(str(store)).stem, n_features=int(extractor.n_features), coords_dim=4,
                      coords_meaning=COORDS_MEANING, feature_extractor=extractor_spec(extractor),
                      tiling=params.as_attrs(), labels=None if labels_csv is None else (
                          labels_csv if isinstance(labels_csv, LabelSpec) else LabelSpec.preset("panda", labels_csv)).describe())
    writer = functools.partial(slide_bag_writer, params=params, extractor=extractor, batch_size=batch_size,
                               qc_dir=None if qc_dir is None else str(qc_dir))
    return IngestPlan(spec, items, skipped, writer)


def _unique_stems(paths: Sequence[Path]) -> tuple[list[Path], list[Skipped]]:
    """Slides whose stem (the bag id) names one file only; ``x.tif`` beside ``x.tiff`` is
    ambiguous: both are skipped, never one of them picked silently."""
    by_stem: dict[str, list[Path]] = {}
    for path in paths:
        by_stem.setdefault(slide_id(path), []).append(path)
    unique = [p for p in paths if len(by_stem[slide_id(p)]) == 1]
    ambiguous = [Skipped(path=str(group[0].parent), bag_id=stem, error="DuplicateIdError",
                         reason=f"{len(group)} files for one slide id: {', '.join(str(p) for p in group)}; keep one")
                 for stem, group in by_stem.items() if len(group) > 1]
    return unique, ambiguous


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
        raise IngestError(f"none of the {len(items)} slide(s) gave a tile with tissue to fit the feature extractor on "
                          f"(unreadable, or smaller than one {params.tile_size}-px tile, or under min_tissue_fraction)")
    return np.concatenate(tiles)[:n_tiles]
