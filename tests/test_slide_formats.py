"""Slide files the readers misread, each written here with tifffile: CMYK and RGBX samples, planar
RGB, non-square pixels, µm/px in OME-XML, ImageJ and 1-dpi tags, an overview stored before the scan,
OME-TIFF names and slides behind folder links."""

from __future__ import annotations

import os

import numpy as np
import pytest
import tifffile

from tasks.ingest.errors import IngestError, UnreadableFileError
from tasks.ingest.slide_io import find_slides, open_slide
from tasks.ingest.wsi import TilingParams, plan_slides, tile_geometry
from tests.test_ingest_wsi import _MeanColour

pytest.importorskip("openslide")
HEADER = "image_id,data_provider,isup_grade,gleason_score\n"


@pytest.fixture(scope="module")
def tissue() -> np.ndarray:
    """A 1024 × 1536 RGB image: an H&E-like noisy block on a light background."""
    rng = np.random.default_rng(0)
    rgb = np.full((1024, 1536, 3), 242, dtype=np.uint8)
    rgb[256:768, 384:1152] = np.clip(rng.normal((200, 120, 170), 20, (512, 768, 3)), 0, 255).astype(np.uint8)
    return rgb


def test_a_cmyk_tiff_is_read_by_openslide_and_refused_by_the_tifffile_reader(tissue, tmp_path):
    """C, M, Y were read as R, G, B and K as alpha: K = 0 made the whole slide white ("no colour")."""
    path = tmp_path / "cmyk.tif"
    cmyk = np.dstack([255 - tissue, np.zeros(tissue.shape[:2], np.uint8)])
    tifffile.imwrite(path, cmyk, photometric="separated", tile=(256, 256), compression="zlib", metadata=None)
    with open_slide(path) as slide:
        assert slide.reader == "openslide"
        np.testing.assert_array_equal(slide.read(0, slice(0, 1024), slice(0, 1536)), tissue)
    with pytest.raises(UnreadableFileError, match="photometric SEPARATED is not read by the tifffile reader") as refused:
        open_slide(path, "tifffile")
    assert refused.value.path == str(path)


def test_a_fourth_sample_that_is_no_alpha_is_ignored(tissue, tmp_path):
    """RGB padded with an unspecified 4th sample of zeros (RGBX) was taken as transparent: all white."""
    path = tmp_path / "rgbx.tif"
    rgbx = np.dstack([tissue, np.zeros(tissue.shape[:2], np.uint8)])
    tifffile.imwrite(path, rgbx, photometric="rgb", extrasamples=["unspecified"], tile=(256, 256), metadata=None)
    with open_slide(path) as slide:
        assert slide.reader == "tifffile"
        np.testing.assert_array_equal(slide.read(0, slice(0, 1024), slice(0, 1536)), tissue)


def test_rgb_written_without_its_photometric_or_marked_minisblack_is_still_read_as_rgb(tissue, tmp_path):
    """Only other colour models (CMYK) leave the tifffile reader: a missing photometric tag (read as
    an int, which failed the whole ingest with AttributeError) and three samples marked MINISBLACK
    were read as RGB before and are read so still (OpenSlide would give grey)."""
    import struct

    bare, minisblack = tmp_path / "bare.tif", tmp_path / "minisblack.tif"
    tifffile.imwrite(bare, tissue, photometric="rgb", tile=(256, 256), metadata=None)
    with tifffile.TiffFile(bare) as tif:
        offset = tif.pages[0].tags["PhotometricInterpretation"].offset
    patched = bytearray(bare.read_bytes())
    patched[offset:offset + 2] = struct.pack("<H", 65001)  # the tag renamed to an unknown one: no photometric
    bare.write_bytes(bytes(patched))
    tifffile.imwrite(minisblack, tissue, photometric="minisblack", planarconfig="contig", tile=(256, 256), metadata=None)
    for path in (bare, minisblack):
        with open_slide(path) as slide:
            assert slide.reader == "tifffile"
            np.testing.assert_array_equal(slide.read(0, slice(0, 1024), slice(0, 1536)), tissue)


def test_planar_rgb_is_named_as_such_by_the_tifffile_reader_and_read_by_openslide(tissue, tmp_path):
    path = tmp_path / "planar.tif"
    tifffile.imwrite(path, np.moveaxis(tissue, -1, 0), photometric="rgb", planarconfig="separate", tile=(256, 256),
                     metadata=None)
    with pytest.raises(UnreadableFileError, match="planar configuration .* is not read by the tifffile reader; use "
                                                  "reader auto or openslide"):
        open_slide(path, "tifffile")
    with open_slide(path) as slide:
        assert slide.reader == "openslide"
        np.testing.assert_array_equal(slide.read(0, slice(0, 1024), slice(0, 1536)), tissue)


def test_non_square_pixels_are_refused_naming_both_sizes_unless_base_mpp_is_set(tissue, tmp_path):
    """Only the x resolution was read: 0.25 × 0.5 µm pixels made 128 × 256 µm tiles silently."""
    path, nearly = tmp_path / "aniso.tif", tmp_path / "nearly.tif"
    for name, mpp_y in ((path, 0.5), (nearly, 0.2512)):
        tifffile.imwrite(name, tissue, photometric="rgb", tile=(256, 256), metadata=None,
                         resolution=(1e4 / 0.25, 1e4 / mpp_y), resolutionunit="CENTIMETER")
    params = TilingParams(tile_size=256, target_mpp=0.5)
    for reader in ("tifffile", "openslide"):
        with open_slide(path, reader) as slide:
            with pytest.raises(IngestError, match="non-square pixels, 0.25 µm/px across and 0.5 µm/px down"):
                tile_geometry(slide, params)
            assert tile_geometry(slide, TilingParams(tile_size=256, target_mpp=0.5, base_mpp=0.25)).side0 == 512
        with open_slide(nearly, reader) as slide:  # 0.5 % apart: square enough
            assert tile_geometry(slide, params).side0 == pytest.approx(512)


def test_um_per_px_of_ome_xml_and_imagej_descriptions_is_read_and_an_unknown_unit_named(tissue, tmp_path):
    """OME ``PhysicalSizeX`` and ImageJ ``unit=micron`` (ResolutionUnit NONE) were ignored: "no µm/px"."""
    ome, imagej, parsec = tmp_path / "nm.ome.tif", tmp_path / "imagej.tif", tmp_path / "parsec.ome.tif"
    tifffile.imwrite(ome, tissue, ome=True, photometric="rgb", tile=(256, 256), metadata={
        "axes": "YXS", "PhysicalSizeX": 250, "PhysicalSizeXUnit": "nm", "PhysicalSizeY": 500, "PhysicalSizeYUnit": "nm"})
    tifffile.imwrite(imagej, tissue, imagej=True, photometric="rgb", resolution=(4.0, 4.0), metadata={"unit": "micron"})
    tifffile.imwrite(parsec, tissue, ome=True, photometric="rgb", tile=(256, 256), metadata={
        "axes": "YXS", "PhysicalSizeX": 1e-10, "PhysicalSizeXUnit": "pc"})
    with open_slide(ome) as slide:
        assert (slide.reader, slide.mpp, slide.mpp_y) == ("tifffile", pytest.approx(0.25), pytest.approx(0.5))
    with open_slide(imagej) as slide:
        assert (slide.mpp, slide.mpp_y) == (pytest.approx(0.25), pytest.approx(0.25))
        assert tile_geometry(slide, TilingParams(tile_size=256, target_mpp=0.5)).side0 == pytest.approx(512)
    with open_slide(parsec) as slide, pytest.raises(IngestError, match="µm/px in OME PhysicalSizeXUnit 'pc', which is no "
                                                                       "length unit gpmil converts .*: set ingest.base_mpp \\(a new cohort's in gpmil predict "
                                                                       "--source: --base-mpp\\)"):
        tile_geometry(slide, TilingParams(tile_size=256, target_mpp=0.5))


def test_a_1_dpi_tag_gives_the_same_implausible_value_through_both_readers(tissue, tmp_path):
    path = tmp_path / "dpi1.tif"
    tifffile.imwrite(path, tissue, photometric="rgb", tile=(256, 256), metadata=None, resolution=(1, 1),
                     resolutionunit="INCH")
    for reader in ("tifffile", "openslide"):
        with open_slide(path, reader) as slide, pytest.raises(IngestError, match="slide metadata gives 25400 µm/px, "
                                                                                 "which no scanner gives"):
            tile_geometry(slide, TilingParams(tile_size=256, target_mpp=0.5))


def test_a_tiff_whose_first_image_is_an_overview_is_refused_and_an_svs_is_not(tissue, tmp_path):
    """A generic TIFF holding an overview before the scan was tiled as the overview, by either reader."""
    path = tmp_path / "scan.tif"
    with tifffile.TiffWriter(path) as tif:
        tif.write(tissue[::4, ::4], tile=(256, 256), photometric="rgb", metadata=None)
        tif.write(tissue, tile=(256, 256), photometric="rgb", metadata=None)
    for reader in ("auto", "tifffile"):
        with pytest.raises(IngestError, match=r"first image \(384 × 256 px\) is smaller than a later one "
                                              r"\(1536 × 1024 px\)") as refused:
            open_slide(path, reader)
        assert refused.value.path == str(path)
    svs = tmp_path / "aperio.svs"  # the pyramid first, then thumbnail, label and macro images: as before
    aperio = "Aperio Image Library v12.0.15 \r\n1536x1024 [0,0 1536x1024] (256x256) |AppMag = 20|MPP = 0.5"
    with tifffile.TiffWriter(svs) as tif:
        tif.write(tissue, tile=(256, 256), photometric="rgb", description=aperio, metadata=None)
        tif.write(tissue[::8, ::8], photometric="rgb", description="Aperio Image Library v12.0.15 \r\n1536x1024 -> 192x128",
                  metadata=None)
        tif.write(tissue[::4, ::4], tile=(256, 256), photometric="rgb", description=aperio, metadata=None)
        tif.write(tissue[::16, ::16], photometric="rgb", subfiletype=1, description="Aperio Image Library\r\nlabel",
                  metadata=None)
        tif.write(tissue[::2, ::2], photometric="rgb", subfiletype=9, description="Aperio Image Library\r\nmacro",
                  metadata=None)
    for reader, name in (("auto", "openslide"), ("tifffile", "tifffile")):
        with open_slide(svs, reader) as slide:
            assert (slide.reader, slide.level_shapes, slide.mpp) == (name, [(1024, 1536), (256, 384)], 0.5)
            np.testing.assert_array_equal(slide.read(0, slice(0, 1024), slice(0, 1536)), tissue)


def test_an_ome_tiff_labelled_without_its_ome_is_named_not_reported_missing(tissue, tmp_path):
    """``case7.ome.tif`` (bag ``case7.ome``, as stores and labels files hold it) with a labels row
    ``case7`` was skipped with no hint, and the row reported as having no slide file ``case7.*``,
    which was there."""
    folder = tmp_path / "slides"
    folder.mkdir()
    tifffile.imwrite(folder / "case7.ome.tif", tissue, ome=True, photometric="rgb", tile=(256, 256))
    tifffile.imwrite(folder / "case8.TIFF", tissue, photometric="rgb", tile=(256, 256), metadata=None)
    (folder / "labels.csv").write_text(f"{HEADER}case7,x,3,4+3\ncase8,x,0,0+0\n")
    plan = plan_slides(tmp_path / "s.zarr", folder, labels_csv=folder / "labels.csv", extractor=_MeanColour())
    assert [(item.bag_id, item.label) for item in plan.items] == [("case8", 0)]
    assert [(s.bag_id, s.error) for s in plan.skipped] == [("case7.ome", "MissingLabelError")]
    assert "(it has 'case7': ids must equal the file stem" in plan.skipped[0].reason
    (folder / "labels.csv").write_text(f"{HEADER}case7.ome,x,3,4+3\ncase8,x,0,0+0\n")  # its id, as before
    plan = plan_slides(tmp_path / "s.zarr", folder, labels_csv=folder / "labels.csv", extractor=_MeanColour())
    assert sorted((item.bag_id, item.label) for item in plan.items) == [("case7.ome", 1), ("case8", 0)] and not plan.skipped


def test_slides_behind_a_folder_link_are_found_and_a_broken_link_is_reported(tissue, tmp_path):
    """``rglob`` did not enter linked folders and ``is_file`` dropped broken links: both silently."""
    root, share = tmp_path / "slides", tmp_path / "share"
    (root / "site_a").mkdir(parents=True)
    share.mkdir()
    for path in (root / "site_a" / "a1.tif", share / "b1.tif"):
        tifffile.imwrite(path, tissue[:256, :256], photometric="rgb", metadata=None)
    os.symlink(share, root / "site_b")
    os.symlink(tmp_path / "gone.svs", root / "site_a" / "a2.svs")
    os.symlink(root, root / "site_a" / "loop")  # a link back up: walked once
    slides, left_out = find_slides(root)
    assert slides == [root / "site_a" / "a1.tif", root / "site_b" / "b1.tif"]
    assert [(e.path, e.reason) for e in left_out] == [
        (str(root / "site_a" / "a2.svs"), f"a broken symbolic link: its target {tmp_path / 'gone.svs'} does not exist")]
    assert find_slides(root, recursive=False) == ([], [])
