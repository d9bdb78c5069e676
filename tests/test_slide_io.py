"""Slide readers on files the tests write: OpenSlide (generic tiled TIFF, Aperio SVS), tifffile
(SubIFD pyramids, strip TIFFs), discovery, and tiling at a physical scale."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import tifffile

from tasks.ingest.errors import UnreadableFileError
from tasks.ingest.slide_io import find_slides, open_slide
from tasks.ingest.synthetic import _render_tile, write_pyramid
from tasks.ingest.wsi import TilingParams, iter_tile_batches, plan_slides, tile_grid, tile_geometry

pytest.importorskip("openslide")


@pytest.fixture(scope="module")
def tissue() -> np.ndarray:
    """A 1024 × 1536 RGB H&E-like image with two tissue blobs."""
    label_map = np.zeros((32, 48), dtype=np.uint8)
    label_map[4:20, 6:22] = 1
    label_map[18:30, 28:44] = 1
    rng = np.random.default_rng(0)
    return np.concatenate([np.concatenate([_render_tile(label_map, y, x, 256, 1, rng) for x in range(0, 1536, 256)], axis=1)
                        for y in range(0, 1024, 256)], axis=0)


def test_openslide_reads_a_generic_tiled_pyramid_and_an_aperio_svs(tissue, tmp_path):
    generic = write_pyramid(tmp_path / "generic.tiff", tissue, mpp=0.5)
    svs = write_pyramid(tmp_path / "aperio.svs", tissue, mpp=0.25, flavour="aperio", magnification=40)
    with open_slide(generic) as auto:
        assert auto.reader == "tifffile"  # a generic TIFF: tifffile, faster on the same pixels
    with open_slide(generic, reader="openslide") as slide:
        assert slide.reader == "openslide" and slide.vendor == "generic-tiff"
        assert slide.level_shapes == [(1024, 1536), (256, 384)] and slide.mpp == pytest.approx(0.5)
        np.testing.assert_array_equal(slide.read(0, slice(100, 160), slice(300, 420)), tissue[100:160, 300:420])
        np.testing.assert_array_equal(slide.read(1, slice(10, 20), slice(5, 25)), tissue[::4, ::4][10:20, 5:25])
        edge = slide.read(0, slice(1000, 1100), slice(0, 10))  # past the bottom: white
        assert edge.shape == (100, 10, 3) and (edge[24:] == 255).all()
    with open_slide(svs) as slide:
        assert (slide.reader, slide.vendor, slide.magnification) == ("openslide", "aperio", 40.0)
        assert slide.mpp == pytest.approx(0.25)
    with open_slide(generic, reader="tifffile") as slide:  # the same pixels through tifffile
        assert slide.reader == "tifffile" and slide.mpp == pytest.approx(0.5)
        np.testing.assert_array_equal(slide.read(0, slice(100, 160), slice(300, 420)), tissue[100:160, 300:420])


def test_tiles_at_a_physical_scale_cover_the_same_tissue_whatever_the_scanner_resolution(tissue, tmp_path):
    coarse = write_pyramid(tmp_path / "coarse.tiff", tissue, mpp=0.5)
    fine = write_pyramid(tmp_path / "fine.tiff", np.repeat(np.repeat(tissue, 2, axis=0), 2, axis=1), mpp=0.25)
    params = TilingParams(tile_size=128, target_mpp=1.0)  # 128 µm tiles: 256 px at 0.5 µm/px, 512 at 0.25
    with open_slide(coarse) as a, open_slide(fine) as b:
        ga, gb = tile_grid(a, params), tile_grid(b, params)
        assert (tile_geometry(a, params).side0, tile_geometry(b, params).side0) == (256, 512)
        assert (ga.geometry.level, ga.geometry.read_size) == (0, 256)  # read at 0.5 µm/px, resized to 128 px
        assert (gb.geometry.level, gb.geometry.read_size) == (1, 128)  # level 1 of the fine scan is at 1 µm/px
        np.testing.assert_array_equal(ga.coords[:, :2], gb.coords[:, :2])  # same grid cells kept
        np.testing.assert_array_equal(gb.coords[:, 2:], 2 * ga.coords[:, 2:])  # level-0 pixels of each scanner
        tiles_a, _ = next(iter_tile_batches(a, ga, 4))
        tiles_b, _ = next(iter_tile_batches(b, gb, 4))
    assert tiles_a.shape == tiles_b.shape == (4, 128, 128, 3)
    np.testing.assert_allclose(tiles_a.mean(axis=(1, 2)), tiles_b.mean(axis=(1, 2)), atol=3)  # same tissue
    with open_slide(coarse) as a, pytest.raises(Exception, match="no µm/px"):
        a.mpp = None
        tile_geometry(a, params)
    with open_slide(coarse) as a:
        a.mpp = None  # an explicit base_mpp stands in for missing metadata
        assert tile_geometry(a, TilingParams(tile_size=128, target_mpp=1.0, base_mpp=0.5)).side0 == 256


def test_a_single_level_strip_tiff_is_read_with_tifffile_a_strip_at_a_time(tissue, tmp_path):
    path = tmp_path / "strips.tif"
    tifffile.imwrite(path, tissue, photometric="rgb", rowsperstrip=64, metadata=None)
    with open_slide(path) as slide:
        assert slide.reader == "tifffile" and slide.level_shapes == [(1024, 1536)]
        thumb, downsample = slide.thumbnail(256)
        assert max(thumb.shape[:2]) <= 256 and downsample == 6
        np.testing.assert_array_equal(thumb, tissue[::6, ::6])


def test_discovery_is_recursive_and_names_every_file_left_out(tissue, tmp_path):
    (tmp_path / "site_a" / "batch_1").mkdir(parents=True)
    write_pyramid(tmp_path / "site_a" / "batch_1" / "deep.svs", tissue, mpp=0.5, flavour="aperio")
    write_pyramid(tmp_path / "top.tiff", tissue, mpp=0.5)
    (tmp_path / "scanner_export.ndpi").write_bytes(b"not really a slide")
    (tmp_path / "notes.bin").write_bytes(b"?")
    (tmp_path / "labels.csv").write_text("image_id,isup_grade\n")
    slides, left_out = find_slides(tmp_path)
    assert [p.name for p in slides] == ["scanner_export.ndpi", "deep.svs", "top.tiff"]
    assert [e.path for e in left_out] == [str(tmp_path / "notes.bin")] and "patterns" in left_out[0].reason
    assert [p.name for p in find_slides(tmp_path, patterns=["*.SVS"])[0]] == ["deep.svs"]
    assert find_slides(tmp_path, recursive=False)[0] == [tmp_path / "scanner_export.ndpi", tmp_path / "top.tiff"]
    with pytest.raises(UnreadableFileError, match="OpenSlide.*tifffile"):
        open_slide(tmp_path / "scanner_export.ndpi")

    plan = plan_slides(tmp_path / "s.zarr", tmp_path, params=TilingParams(target_mpp=0.5, tile_size=128))
    assert {item.bag_id for item in plan.items} == {"deep", "top", "scanner_export"}
    assert [(s.path, s.error) for s in plan.skipped] == [(str(tmp_path / "notes.bin"), "UnreadableFileError")]
    assert plan.spec.coords_dim == 4 and plan.spec.coords_meaning.startswith("tile_row,tile_col,x,y")


def test_openslide_opens_a_dicom_wsi_folder_with_the_pixels_and_scale_written(tissue, tmp_path):
    from tasks.ingest.synthetic import write_dicom_wsi

    _, files = write_dicom_wsi(tmp_path / "slide-7", tissue, mpp=0.5, series_key="s7")
    assert [f.name for f in files] == ["level0.dcm", "level1.dcm"]
    with open_slide(tmp_path / "slide-7") as slide:
        assert (slide.reader, slide.vendor) == ("openslide", "dicom")
        assert slide.level_shapes == [(1024, 1536), (256, 384)] and slide.downsamples == [1.0, 4.0]
        assert slide.mpp == pytest.approx(0.5) and slide.magnification == 20.0
        np.testing.assert_array_equal(slide.read(0, slice(100, 160), slice(300, 420)), tissue[100:160, 300:420])
        np.testing.assert_array_equal(slide.read(1, slice(10, 20), slice(5, 25)), tissue[::4, ::4][10:20, 5:25])
    with pytest.raises(UnreadableFileError, match="read by OpenSlide"):
        open_slide(tmp_path / "slide-7", reader="tifffile")


def test_a_dicom_wsi_folder_of_upper_case_files_opens_and_a_macos_resource_fork_is_no_slide(tissue, tmp_path):
    from tasks.ingest.slide_io import slide_files
    from tasks.ingest.synthetic import write_dicom_wsi

    _, files = write_dicom_wsi(tmp_path / "case", tissue, mpp=0.5, series_key="up")
    for f in files:
        f.rename(f.with_suffix(".DCM"))
    with open_slide(tmp_path / "case") as slide:
        assert slide.vendor == "dicom"
    assert slide_files(tmp_path / "case") == tuple(str(tmp_path / "case" / n) for n in ("level0.DCM", "level1.DCM"))
    write_pyramid(tmp_path / "a.tiff", tissue, mpp=0.5)
    (tmp_path / "._a.tiff").write_bytes(b"\x00\x05\x16\x07")  # what macOS writes beside a file on a foreign disk
    assert find_slides(tmp_path)[0] == [tmp_path / "a.tiff", tmp_path / "case"]


def test_dicom_wsi_folders_are_discovered_and_tiled_like_the_same_pixels_in_a_tiff(tissue, tmp_path):
    """A DICOM-WSI folder is one slide (bag id = folder name) and gives the tiles and features of
    the same pixels written as a TIFF; a CT series, a WSI OpenSlide refuses and a folder of two WSI
    series are listed with their reasons."""
    from tasks.ingest.synthetic import write_ct_series, write_dicom_wsi
    from tasks.ingest.wsi import ingest_slides
    from tasks.store import open_cohort

    root = tmp_path / "cohort"
    write_dicom_wsi(root / "site_a" / "case-1.v2", tissue, mpp=0.5, series_key="case-1")
    write_pyramid(root / "case-2.tiff", tissue, mpp=0.5)
    write_dicom_wsi(root / "planar", tissue, mpp=0.5, series_key="planar", levels=1, PlanarConfiguration=1)
    write_dicom_wsi(root / "two", tissue, mpp=0.5, series_key="two-a", levels=1)
    (root / "two" / "level0.dcm").rename(root / "two" / "a.dcm")
    write_dicom_wsi(root / "two", tissue, mpp=0.5, series_key="two-b", levels=1)
    write_ct_series(root / "ct", np.zeros((3, 16, 16)), series_key="ct")
    (root / "broken").mkdir()
    (root / "broken" / "x.dcm").write_bytes(b"no DICOM here")

    slides, left_out = find_slides(root)
    assert slides == [root / "case-2.tiff", root / "planar", root / "site_a" / "case-1.v2"]
    reasons = {e.path: e.reason for e in left_out}
    assert "SOP class CT Image Storage (Modality CT); CT series are ingested with ingest.kind ct" in reasons[str(root / "ct")]
    assert "holds 2 DICOM-WSI series" in reasons[str(root / "two")]
    assert "not a readable DICOM file" in reasons[str(root / "broken" / "x.dcm")]

    params = TilingParams(tile_size=128, target_mpp=1.0, min_tissue=0.3)
    report = ingest_slides(tmp_path / "s.zarr", root, params=params, fit_tiles=64)
    assert sorted(report.added) == ["case-1.v2", "case-2"]
    refused = {s.bag_id: s for s in report.skipped if s.bag_id == "planar"}["planar"]
    assert refused.error == "UnreadableFileError" and "PlanarConfiguration value 1 != 0" in refused.reason
    cohort = open_cohort(tmp_path / "s.zarr")
    dicom, tiff = (cohort.read_bags(b, b + 1) for b in (list(cohort.bag_ids).index("case-1.v2"), list(cohort.bag_ids).index("case-2")))
    assert cohort.sources[list(cohort.bag_ids).index("case-1.v2")] == str(root / "site_a" / "case-1.v2")
    assert len(dicom.coords) > 10
    np.testing.assert_array_equal(dicom.coords, tiff.coords)
    np.testing.assert_allclose(dicom.features, tiff.features, rtol=1e-5, atol=1e-5)
    from tasks.ingest.wsi import heatmap_background  # the report paints heatmaps over the folder's thumbnail

    thumbnail, downsample, side = heatmap_background(root / "site_a" / "case-1.v2", cohort.attrs["tiling"])
    np.testing.assert_array_equal(thumbnail, tissue[::4, ::4])  # level 1, whole: at most 1024 px a side
    assert (downsample, side) == (4.0, 256.0)
    # The folder's stamp covers its .dcm files: a level rewritten since is reported; the folder moved, it is done.
    level1 = root / "site_a" / "case-1.v2" / "level1.dcm"
    original = level1.read_bytes()
    level1.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
    again = ingest_slides(tmp_path / "s.zarr", root, params=params, fit_tiles=64)
    assert [s.error for s in again.skipped if s.bag_id == "case-1.v2"] == ["SourceChangedError"]
    level1.write_bytes(original)
    shutil.move(root / "site_a", root / "site_b")
    again = ingest_slides(tmp_path / "s.zarr", root, params=params, fit_tiles=64)
    assert sorted(again.already_done) == ["case-1.v2", "case-2"] and not again.added
    shutil.move(root / "site_b", root / "site_a")
    from tasks.ingest.ct import scan_dicom_dir  # and the CT reader names the slide for what it is

    series, errors = scan_dicom_dir(root / "site_a")
    assert series == [] and "Modality 'SM', not CT (level0.dcm); a DICOM whole-slide image is ingested with " \
        "ingest.kind wsi" in errors[0].reason


def test_transparent_pixels_are_white_in_both_readers(tissue, tmp_path):
    """An RGBA slide whose unscanned area is transparent (alpha 0, colour 0) was black through
    tifffile (the auto choice for it) and white through OpenSlide: its edge tiles differed."""
    rgba = np.concatenate([tissue, np.full(tissue.shape[:2] + (1,), 255, np.uint8)], axis=2)
    rgba[:, :512] = 0  # a transparent band
    path = tmp_path / "rgba.tiff"
    tifffile.imwrite(path, rgba, photometric="rgb", extrasamples=["unassalpha"], tile=(256, 256), metadata=None)
    with open_slide(path, reader="tifffile") as slide:
        pixels = slide.read(0, slice(0, 1024), slice(0, 1536))
    assert (pixels[:, :512] == 255).all()
    np.testing.assert_array_equal(pixels[:, 512:], tissue[:, 512:])
