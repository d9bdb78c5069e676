"""Slides: tissue detection on generated slides of known tissue area, bad inputs, resume after a crash."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import tifffile

from tasks.ingest.driver import run_ingest
from tasks.ingest.errors import IngestError
from tasks.ingest.synthetic import BACKGROUND, MAP_DOWNSAMPLE, TISSUE, TUMOUR, make_slide_cohort, write_slide
from tasks.ingest.slide_io import open_slide
from tasks.ingest.wsi import (TileGeometry, TilingParams, choose_level, heatmap_background, ingest_slides, plan_slides,
                              tile_geometry, tile_grid)
from tasks.paths import safe_filename
from tasks.store import open_cohort


@pytest.fixture(scope="module")
def slides(tmp_path_factory) -> tuple[Path, list]:
    folder = tmp_path_factory.mktemp("slides")
    generated = make_slide_cohort(folder, 4, seed=3, n_corrupt=1)
    return folder, generated


def test_tissue_mask_and_tile_fractions_match_the_rendered_tissue(slides):
    folder, generated = slides
    for slide in generated:
        with open_slide(slide.path) as opened:
            grid = tile_grid(opened, TilingParams(tile_size=256, min_tissue=0.5))
        assert abs(grid.mask.mean() - slide.tissue_fraction) < 0.01
        cells = 256 // MAP_DOWNSAMPLE  # label-map cells per tile side
        rows, cols = slide.label_map.shape[0] // cells, slide.label_map.shape[1] // cells
        true_fraction = (slide.label_map != BACKGROUND).reshape(rows, cells, cols, cells).mean(axis=(1, 3))
        kept = np.zeros((rows, cols), dtype=bool)
        kept[grid.coords[:, 0], grid.coords[:, 1]] = True
        clear_cut = np.abs(true_fraction - 0.5) > 0.05
        np.testing.assert_array_equal(kept[clear_cut], true_fraction[clear_cut] >= 0.5)
        np.testing.assert_allclose(grid.tissue, true_fraction[kept], atol=0.05)


def test_magnification_picks_the_matching_pyramid_level(slides):
    _, generated = slides
    with open_slide(generated[0].path) as slide:
        assert slide.magnification == 20.0 and slide.downsamples == [1.0, 4.0]
        assert slide.reader == "tifffile"  # a SubIFD pyramid: OpenSlide would see its base level only
        assert tile_geometry(slide, TilingParams(tile_size=64, magnification=5.0)) == TileGeometry(1, 64, 256.0)
        assert tile_geometry(slide, TilingParams(tile_size=64, magnification=20.0)) == TileGeometry(0, 64, 64.0)
        # 10x between the 20x and 5x levels: read at 20x and halved (the nearest level, 20x, was read as it is)
        assert tile_geometry(slide, TilingParams(tile_size=64, magnification=10.0)) == TileGeometry(0, 128, 128.0)
        assert choose_level(slide, TilingParams(level=1)) == 1
        grid = tile_grid(slide, TilingParams(tile_size=64, magnification=5.0, min_tissue=0.5))
    assert grid.geometry.level == 1 and grid.shape == (4, 6)
    np.testing.assert_array_equal(grid.coords[:, 2:], grid.coords[:, 1::-1] * 256)  # level-0 x, y


@pytest.mark.parametrize("tiling", [TilingParams(tile_size=64, magnification=5.0), TilingParams(tile_size=128, level=0)])
def test_heatmap_background_scales_tiles_onto_the_thumbnail(slides, tiling):
    _, generated = slides
    with open_slide(generated[0].path) as slide:
        grid = tile_grid(slide, tiling)
    thumbnail, thumb_downsample, side0 = heatmap_background(generated[0].path, tiling.as_attrs(), max_side=200)
    assert thumbnail.ndim == 3 and thumbnail.shape[2] == 3 and max(thumbnail.shape[:2]) <= 200
    tile_px = side0 / thumb_downsample
    np.testing.assert_allclose(np.array(grid.shape) * tile_px, thumbnail.shape[:2], atol=tile_px)


def test_slide_ingest_reports_bad_inputs_and_ingests_the_others(slides, tmp_path):
    folder, generated = slides
    work = tmp_path / "slides"
    shutil.copytree(folder, work)
    write_slide(work / "blank.tiff", np.zeros((32, 48), dtype=np.uint8), seed=1)
    write_slide(work / "nolabel.tiff", generated[0].label_map, seed=2)
    tifffile.imwrite(work / "tiny.tiff", np.full((20, 30, 3), 120, np.uint8))  # smaller than one tile
    labels = pd.read_csv(work / "labels.csv")
    extra = pd.DataFrame({"image_id": ["blank", "slide_00001", "tiny"], "data_provider": "x", "isup_grade": [0, 3, 0],
                          "gleason_score": ["0+0", "4+3", "0+0"]})
    pd.concat([labels, extra]).to_csv(work / "labels.csv", index=False)  # slide_00001 now listed twice

    report = ingest_slides(tmp_path / "s.zarr", work, labels_csv=work / "labels.csv", qc_dir=tmp_path / "qc")

    problems = {s.bag_id: s.error for s in report.skipped}
    assert problems == {"corrupt_00000": "UnreadableFileError", "blank": "NoTissueError", "tiny": "NoTissueError",
                        "nolabel": "MissingLabelError", "slide_00001": "DuplicateIdError"}
    reasons = {s.bag_id: s.reason for s in report.skipped}
    assert reasons["blank"] == "no tile has >= 50% tissue"
    assert reasons["tiny"] == "the slide (30 × 20 px at level 0) is smaller than one tile (256 level-0 px); lower ingest.tile_size"
    assert all(s.path.endswith(".tiff") or s.path.endswith("labels.csv") for s in report.skipped)
    written = json.loads(Path(report.report_path).read_text())
    assert {s["bag_id"] for s in written["skipped"]} == set(problems)
    cohort = open_cohort(tmp_path / "s.zarr")
    expected = [s for s in generated if s.image_id != "slide_00001"]
    assert list(cohort.bag_ids) == [s.image_id for s in expected]
    assert list(cohort.bag_labels) == [s.label for s in expected]
    assert cohort.n_features == 77 and cohort.attrs["tiling"]["tile_size"] == 256
    assert sorted(p.name for p in (tmp_path / "qc").glob("*.png")) == sorted(safe_filename(s.image_id, ".png") for s in expected)
    block = cohort.read_bags(0, cohort.n_bags)
    assert np.isfinite(block.features).all() and (block.instance_labels == -1).all()


def test_an_ingest_that_commits_nothing_leaves_no_store_to_fix_the_next_runs_settings(slides, tmp_path):
    """A first run whose every slide is left out (here: tiles larger than the slides) used to leave
    an empty store holding its tiling; the corrected rerun with another tile size was then refused
    as a settings mismatch of a store without a single bag."""
    folder = slides[0]
    report = ingest_slides(tmp_path / "s.zarr", folder, labels_csv=folder / "labels.csv",
                           params=TilingParams(tile_size=8192), extractor=_MeanColour())
    assert report.added == () and {s.error for s in report.skipped} == {"NoTissueError", "UnreadableFileError"}
    assert not (tmp_path / "s.zarr").exists() and Path(report.report_path).is_file()

    again = ingest_slides(tmp_path / "s.zarr", folder, labels_csv=folder / "labels.csv", params=TilingParams(tile_size=128),
                          extractor=_MeanColour())
    assert len(again.added) == 4 and open_cohort(tmp_path / "s.zarr").attrs["tiling"]["tile_size"] == 128
    blank = tmp_path / "blank"
    blank.mkdir()
    write_slide(blank / "blank.tiff", np.zeros((32, 48), dtype=np.uint8), seed=1)
    (blank / "labels.csv").write_text("image_id,data_provider,isup_grade,gleason_score\nblank,x,0,0+0\n")
    nothing = ingest_slides(tmp_path / "s.zarr", blank, labels_csv=blank / "labels.csv", params=TilingParams(tile_size=128),
                            extractor=_MeanColour())
    assert nothing.added == () and open_cohort(tmp_path / "s.zarr").n_bags == 4  # a store with bags stays
    with pytest.raises(IngestError, match="tiling.tile_size: store 128, this ingest 64"):
        ingest_slides(tmp_path / "s.zarr", folder, labels_csv=folder / "labels.csv", params=TilingParams(tile_size=64),
                      extractor=_MeanColour())

    killed = tmp_path / "killed.zarr"  # killed before its first commit: its empty store stays, the rerun must not meet it
    plan = plan_slides(killed, folder, labels_csv=folder / "labels.csv", params=TilingParams(tile_size=128), extractor=_MeanColour())
    with pytest.raises(Crash):
        run_ingest(killed, plan.spec, plan.items, crash_on("slide_00000", plan.bag_writer), commit_every=2)
    assert open_cohort(killed).n_bags == 0 and open_cohort(killed).attrs["tiling"]["tile_size"] == 128
    corrected = ingest_slides(killed, folder, labels_csv=folder / "labels.csv", params=TilingParams(tile_size=64),
                              extractor=_MeanColour())
    assert len(corrected.added) == 4 and open_cohort(killed).attrs["tiling"]["tile_size"] == 64

    class _Mean(_MeanColour):  # another extractor, another width
        name, n_features = "mean", 3

        def __call__(self, tiles: np.ndarray) -> np.ndarray:
            return super().__call__(tiles)[:, :3]

    narrower = tmp_path / "narrower.zarr"
    with pytest.raises(Crash):
        run_ingest(narrower, plan.spec, plan.items, crash_on("slide_00000", plan.bag_writer), commit_every=2)
    assert len(ingest_slides(narrower, folder, labels_csv=folder / "labels.csv", params=TilingParams(tile_size=128),
                             extractor=_Mean()).added) == 4 and open_cohort(narrower).n_features == 3


class Crash(BaseException):
    """Stands for a killed worker process (not an Exception, so nothing catches it)."""


def crash_on(bag_id: str, bag_writer):
    def writer(item, staging):
        if item.bag_id != bag_id:
            return bag_writer(item, staging)

        class Dying:  # passes the first batch on, then the process "dies"
            def write(self, *rows):
                staging.write(*rows)
                raise Crash

        bag_writer(item, Dying())
    return writer


def test_an_interrupted_ingest_resumes_to_the_same_store_and_a_rerun_adds_only_new_slides(slides, tmp_path):
    generated = slides[1]
    folder = tmp_path / "slides"
    shutil.copytree(slides[0], folder)
    crashed, fresh = tmp_path / "crashed.zarr", tmp_path / "fresh.zarr"
    plan = plan_slides(crashed, folder, labels_csv=folder / "labels.csv", batch_size=2)
    with pytest.raises(Crash):
        run_ingest(crashed, plan.spec, plan.items, crash_on("slide_00003", plan.bag_writer), commit_every=2)
    partial = open_cohort(crashed)
    assert list(partial.bag_ids) == ["slide_00000", "slide_00001"]  # slide 2 staged, slide 3 half-written

    resumed = ingest_slides(crashed, folder, labels_csv=folder / "labels.csv", batch_size=2)
    assert resumed.already_done == ("slide_00000", "slide_00001")
    assert resumed.added == ("slide_00002", "slide_00003")
    ingest_slides(fresh, folder, labels_csv=folder / "labels.csv")
    a, b = open_cohort(crashed), open_cohort(fresh)
    assert list(a.bag_ids) == list(b.bag_ids)
    np.testing.assert_array_equal(a.offsets, b.offsets)
    np.testing.assert_array_equal(a.read_bags(0, a.n_bags).features, b.read_bags(0, b.n_bags).features)
    assert not list((crashed / "staging").glob("*/zarr.json"))

    label_map = generated[1].label_map.copy()
    label_map[label_map == TISSUE] = TUMOUR
    write_slide(folder / "late_arrival.tiff", label_map, seed=9)
    labels = pd.read_csv(folder / "labels.csv")
    labels.loc[len(labels)] = ["late_arrival", "synthetic", 4, "4+4"]
    labels.to_csv(folder / "labels.csv", index=False)
    extended = ingest_slides(crashed, folder, labels_csv=folder / "labels.csv")
    assert extended.added == ("late_arrival",) and len(extended.already_done) == 4
    assert open_cohort(crashed).bag_labels[-1] == 1


def test_a_slide_staged_by_a_killed_run_and_removed_since_leaves_no_staging_behind(slides, tmp_path):
    """Its staged features stayed in ``staging/`` through every later complete run (no run lists it
    again); the staged slide of an input still there is committed by the rerun, as before."""
    folder = tmp_path / "slides"
    shutil.copytree(slides[0], folder)
    store = tmp_path / "s.zarr"
    plan = plan_slides(store, folder, labels_csv=folder / "labels.csv", batch_size=2)
    with pytest.raises(Crash):
        run_ingest(store, plan.spec, plan.items, crash_on("slide_00003", plan.bag_writer), commit_every=2)
    assert len(list((store / "staging").glob("*/zarr.json"))) == 2  # slide 2 staged, slide 3 half-written
    (folder / "slide_00002.tiff").unlink()  # a bad scan, removed
    resumed = ingest_slides(store, folder, labels_csv=folder / "labels.csv", batch_size=2)
    assert resumed.added == ("slide_00003",) and list(open_cohort(store).bag_ids) == ["slide_00000", "slide_00001", "slide_00003"]
    assert not list((store / "staging").glob("*/zarr.json"))


def test_a_dask_client_gives_the_same_store_as_the_serial_ingest(slides, tmp_path):
    distributed = pytest.importorskip("distributed")
    folder, _ = slides
    ingest_slides(tmp_path / "serial.zarr", folder, labels_csv=folder / "labels.csv")
    with distributed.Client(processes=False, n_workers=2, threads_per_worker=1, dashboard_address=None) as client:
        report = ingest_slides(tmp_path / "dask.zarr", folder, labels_csv=folder / "labels.csv", client=client)
    assert len(report.added) == 4 and [s.bag_id for s in report.skipped] == ["corrupt_00000"]
    a, b = open_cohort(tmp_path / "serial.zarr"), open_cohort(tmp_path / "dask.zarr")
    assert list(a.bag_ids) == list(b.bag_ids)
    np.testing.assert_array_equal(a.read_bags(0, a.n_bags).features, b.read_bags(0, b.n_bags).features)


# ------------------------------------------------------------------ single-level slides: one read
def _single_level_slide(path: Path, side: int = 2048, hole: tuple[int, int] | None = (768, 1280), seed: int = 0) -> Path:
    """A single-level tiled TIFF: a square of H&E-like tissue (noisy) on white, with a white hole."""
    import tifffile

    rng = np.random.default_rng(seed)
    rgb = np.full((side, side, 3), 245, dtype=np.uint8)
    tissue = np.clip(np.array([200, 120, 170]) + rng.normal(0, 20, (side - 512, side - 512, 3)), 0, 255)
    rgb[256:side - 256, 256:side - 256] = tissue.astype(np.uint8)
    if hole is not None:
        rgb[hole[0]:hole[1], hole[0]:hole[1]] = 255
    tifffile.imwrite(path, rgb, tile=(256, 256), photometric="rgb", compression="zlib",
                     resolution=(1e4 / 0.5, 1e4 / 0.5), resolutionunit="CENTIMETER", metadata=None)
    return path


class _MeanColour:
    """Per-tile mean and std of each channel (independent of the batch a tile is in; fitted as it is)."""

    name, version, n_features = "mean-colour", "1", 6

    def params(self) -> dict:
        return {}

    def __call__(self, tiles: np.ndarray) -> np.ndarray:
        tiles = tiles.astype(np.float64)
        return np.concatenate([tiles.mean(axis=(1, 2)), tiles.std(axis=(1, 2))], axis=1).astype(np.float32)


@pytest.fixture
def decoded_pixels(monkeypatch):
    """Pixels of the tile level each TiffSlide.read decodes (within the level), summed."""
    from tasks.ingest.slide_io import TiffSlide

    read, counter = TiffSlide.read, {"pixels": 0}

    def counting(self, level, rows, cols):
        height, width = self.level_shapes[level]
        counter["pixels"] += max(0, min(rows.stop, height) - rows.start) * max(0, min(cols.stop, width) - cols.start)
        return read(self, level, rows, cols)

    monkeypatch.setattr(TiffSlide, "read", counting)
    return counter


@pytest.mark.parametrize("hole", [None, (768, 1280)])
def test_a_single_level_slide_is_read_once_and_gives_the_tiles_and_features_of_two_passes(tmp_path, decoded_pixels, hole):
    """The one-pass tiler keeps exactly the tiles the thumbnail-then-tiles path keeps, with the same
    features, decoding the level once; tiles kept only because the mask fills a hole (no saturated
    pixel within the filters' reach: never featurised in the pass) are read again, and only they."""
    from tasks.ingest.wsi import features_in_one_pass, iter_tile_batches, reads_once

    path = _single_level_slide(tmp_path / "single.tif", hole=hole)
    params = TilingParams(tile_size=128, mask_max_side=256, min_object_fraction=0.08, reader="tifffile")
    extractor = _MeanColour()
    with open_slide(path, "tifffile") as slide:
        assert reads_once(slide, params) and len(slide.level_shapes) == 1
        level_pixels = slide.level_shapes[0][0] * slide.level_shapes[0][1]
        decoded_pixels["pixels"] = 0
        reference = tile_grid(slide, params)
        expected = np.concatenate([extractor(t) for t, _ in iter_tile_batches(slide, reference, 16)])
        two_passes = decoded_pixels["pixels"] / level_pixels
        decoded_pixels["pixels"] = 0
        grid, features, (thumb, downsample) = features_in_one_pass(slide, params, extractor, batch_size=16)
        one_pass = decoded_pixels["pixels"] / level_pixels
    np.testing.assert_array_equal(grid.coords, reference.coords)
    np.testing.assert_array_equal(grid.mask, reference.mask)
    np.testing.assert_array_equal(features, expected)
    white = expected[:, 3:].max(axis=1) == 0  # kept tiles without a single tissue pixel: the filled hole
    assert int(white.sum()) == (0 if hole is None else 16)  # the 4 x 4 tiles of the hole
    assert two_passes > 1.4
    # Re-read: the hole's tiles that tissue within the filters' reach (7 thumbnail px) does not cover
    # to min_tissue: all but its 4 corners (tissue on two sides covers 175 of their 256 px).
    reread = 0 if hole is None else 12
    assert one_pass == pytest.approx(1.0 + reread * 128 * 128 / level_pixels, abs=1e-9)


def test_ingesting_a_single_level_slide_stores_what_the_two_pass_path_computes(tmp_path):
    from tasks.ingest.features import extractor_from_spec
    from tasks.ingest.wsi import iter_tile_batches

    (tmp_path / "slides").mkdir()
    path = _single_level_slide(tmp_path / "slides" / "single.tif")
    params = TilingParams(tile_size=128, mask_max_side=256, min_object_fraction=0.08)
    ingest_slides(tmp_path / "s.zarr", tmp_path / "slides", params=params, fit_tiles=32, batch_size=7,
                  qc_dir=tmp_path / "qc")
    cohort = open_cohort(tmp_path / "s.zarr")
    stored = cohort.read_bags(0, 1)
    extractor = extractor_from_spec(cohort.attrs["feature_extractor"], source=tmp_path / "s.zarr")
    with open_slide(path) as slide:
        grid = tile_grid(slide, params)
        expected = np.concatenate([extractor(t) for t, _ in iter_tile_batches(slide, grid, 64)])
    np.testing.assert_array_equal(stored.coords, grid.coords)
    np.testing.assert_allclose(stored.features, expected, rtol=1e-6, atol=1e-6)
    assert (tmp_path / "qc" / safe_filename("single", ".png")).stat().st_size > 0


def test_a_slide_named_with_decomposed_accents_takes_its_composed_labels_row(slides, tmp_path):
    """A macOS copy names the slide 'café' as c-a-f-e + U+0301; the labels CSV has the composed é.
    The slide was refused as unlabelled and its row reported as 'no slide file'."""
    import unicodedata

    folder = tmp_path / "slides"
    folder.mkdir()
    decomposed = unicodedata.normalize("NFD", "café")
    shutil.copy(slides[0] / "slide_00000.tiff", folder / f"{decomposed}.tiff")
    shutil.copy(slides[0] / "slide_00001.tiff", folder / "plain.tiff")
    (folder / "labels.csv").write_text("image_id,data_provider,isup_grade,gleason_score\ncafé,x,3,4+3\nplain,x,0,0+0\n",
                                       encoding="utf-8")
    plan = plan_slides(tmp_path / "s.zarr", folder, labels_csv=folder / "labels.csv", extractor=_MeanColour())
    assert sorted((i.bag_id, i.label) for i in plan.items) == [(decomposed, 1), ("plain", 0)]
    assert plan.skipped == []


def test_a_resolution_no_scanner_gives_is_refused_not_tiled_into_a_billion_cells(tmp_path, slides):
    """A TIFF's default 72-dpi tag reads as 352.8 µm/px: target_mpp 0.5 made 1-px reads of a
    2822 × 4233 grid per small slide, for minutes, without a word."""
    write_slide(tmp_path / "dpi72.tiff", slides[1][0].label_map, seed=1, mpp=352.8)
    with open_slide(tmp_path / "dpi72.tiff") as slide:
        assert slide.mpp == pytest.approx(352.8)
        with pytest.raises(IngestError, match=r"slide metadata gives 352.8 µm/px, which no scanner gives .*set ingest.base_mpp"):
            tile_geometry(slide, TilingParams(tile_size=64, target_mpp=0.5))
        assert tile_geometry(slide, TilingParams(tile_size=64, target_mpp=0.5, base_mpp=0.25)).side0 == 128.0


def test_a_grayscale_slide_is_named_as_such_not_only_as_without_tissue(tmp_path):
    """A grayscale TIFF was reported as 'no tile has >= 50% tissue' only."""
    gray = np.tile(np.linspace(60, 240, 512, dtype=np.uint8)[None, :], (512, 1))
    tifffile.imwrite(tmp_path / "gray.tiff", np.repeat(gray[..., None], 3, axis=2), photometric="rgb", tile=(256, 256))
    (tmp_path / "labels.csv").write_text("image_id,data_provider,isup_grade,gleason_score\ngray,x,0,0+0\n")
    report = ingest_slides(tmp_path / "s.zarr", [tmp_path / "gray.tiff"], labels_csv=tmp_path / "labels.csv",
                           params=TilingParams(tile_size=128), extractor=_MeanColour())
    (skipped,) = report.skipped
    assert skipped.error == "NoTissueError" and "the slide has no colour (grayscale" in skipped.reason


def test_a_noisy_black_background_is_not_tissue():
    """A slide scanned on a dark background (noise around 8 of 255) had its mask inverted: the
    background's random channels are fully saturated, the stained tissue less so."""
    from tasks.ingest.wsi import tissue_mask

    rng = np.random.default_rng(0)
    rgb = np.clip(rng.normal(8, 4, size=(256, 256, 3)), 0, 255).astype(np.uint8)
    rgb[64:192, 64:192] = np.clip(rng.normal((200, 130, 185), 12, size=(128, 128, 3)), 0, 255).astype(np.uint8)
    mask = tissue_mask(rgb)
    assert mask[70:186, 70:186].mean() > 0.95 and mask[:48].mean() < 0.01 and mask[208:].mean() < 0.01


def test_the_mask_of_a_pyramid_down_to_one_tile_is_read_where_tiles_span_enough_pixels(tmp_path):
    """The mask was read at the lowest level however small: on a pyramid down to one TIFF tile (as
    libvips writes them) a 64-px tile spanned 2 mask pixels and every 128-px fragment was lost.
    A pyramid whose lowest level is fine enough still gives its mask from that level."""
    from tasks.ingest.synthetic import write_pyramid
    from tasks.ingest.wsi import mask_level

    rng = np.random.default_rng(0)
    rgb = np.full((2048, 3072, 3), 242, dtype=np.uint8)
    corners = [(256, 256 + 384 * i) for i in range(7)] + [(1024, 128)]  # 128-px fragments, a 192-px strip
    for (y, x), (h, w) in zip(corners, [(128, 128)] * 7 + [(192, 2816)]):
        rgb[y:y + h, x:x + w] = np.clip(rng.normal((200, 120, 170), 20, (h, w, 3)), 0, 255).astype(np.uint8)
    truth = (rgb != 242).any(axis=-1).reshape(32, 64, 48, 64).mean(axis=(1, 3)) >= 0.5
    deep = write_pyramid(tmp_path / "deep.tif", rgb, mpp=0.5, levels=6, level_factor=2, tile=64)  # down to 64 × 96
    shallow = write_pyramid(tmp_path / "shallow.tif", rgb, mpp=0.5, levels=2, level_factor=4, tile=64)
    params = TilingParams(tile_size=64)
    for path, downsamples, level in ((deep, [1, 2, 4, 8, 16, 32], 3), (shallow, [1, 4], 1)):
        with open_slide(path) as slide:
            assert slide.downsamples == downsamples and mask_level(slide, params) == level
            grid = tile_grid(slide, params)
        kept = np.zeros_like(truth)
        kept[grid.coords[:, 0], grid.coords[:, 1]] = True
        np.testing.assert_array_equal(kept, truth)
        assert grid.mask_downsample == downsamples[level]  # a 64-px tile spans 8 (16) mask pixels


def test_where_mask_max_side_bounds_the_mask_its_coarsest_level_that_fine_is_read(tmp_path):
    """Where no level lets a tile span 8 mask pixels within ``mask_max_side`` (a 100k-px slide's
    2048-px mask), the mask level was the finest one the bound allows, subsampled down to the lowest
    level's resolution: the same mask from up to 16x the pixels read. Levels of downsample 1, 3 and
    9 with a 256-px bound all give 8-9 level-0 px per mask pixel: the lowest is read, whole."""
    from tasks.ingest.synthetic import write_pyramid
    from tasks.ingest.wsi import mask_level

    path = write_pyramid(tmp_path / "bounded.tif", np.full((2048, 2048, 3), 242, np.uint8), mpp=0.5, levels=3, level_factor=3,
                         tile=64)
    with open_slide(path) as slide:
        assert slide.downsamples == pytest.approx([1, 3, 9], rel=0.01)
        assert mask_level(slide, TilingParams(tile_size=32, mask_max_side=256)) == 2
        assert mask_level(slide, TilingParams(tile_size=32)) == 1  # unbounded: the coarsest level where a tile spans 8 px


def test_a_blank_slide_is_named_blank_not_grayscale(tmp_path):
    """Blank glass (one grey level) was described as 'no colour (grayscale, or fluorescence ...)'."""
    tifffile.imwrite(tmp_path / "blank.tiff", np.full((512, 768, 3), 250, np.uint8), photometric="rgb", tile=(256, 256),
                     metadata=None)
    report = ingest_slides(tmp_path / "s.zarr", [tmp_path / "blank.tiff"], params=TilingParams(tile_size=128),
                           extractor=_MeanColour())
    (skipped,) = report.skipped
    assert (skipped.error, skipped.reason) == ("NoTissueError", "no tile has >= 50% tissue; the slide is blank (every "
                                                                "pixel grey 250 of 255 or within 8 of it): no tissue was found")
