"""Peak memory of slide ingest on a large single-level TIFF, and of the report step's per-slide outputs.

    nice python benchmarks/bench_wsi_memory.py                 # 40 000 x 40 000 px (about 10 minutes on 2 cores)
    nice python benchmarks/bench_wsi_memory.py --side 12000    # quicker
    nice python benchmarks/bench_wsi_memory.py --slide /tmp/big.tif --reader tifffile   # reuse a written slide
    nice python benchmarks/bench_wsi_memory.py --compare-readers 8000   # OpenSlide vs tifffile thumbnails
    nice python benchmarks/bench_wsi_memory.py --side 20000 --before /tmp/gpmil-before   # each ingest step also
        # with the code of another checkout (e.g. ``git archive <commit> tasks mil_core | tar -x -C /tmp/gpmil-before``)

A single-level tiled TIFF (zlib, 256 px tiles, 0.25 µm/px in its resolution tags; a disc of
H&E-like tissue on white) is written tile by tile, then each step runs in a fresh Python process
whose peak resident memory (VmHWM) is its own: opening the slide and reading its thumbnail (the
lowest level is level 0: read 512 rows at a time), the tile grid with the tissue mask, the whole
ingest of that slide (256-px tiles at 0.5 µm/px, read at level 0 as 512 px and resized,
HandcraftedHE fitted on the slide first, Zarr store), the same ingest into a second store with the
first store's fitted extractor (``extractor_from``: the per-slide work of a cohort whose extractor
is fitted), and the report's per-slide outputs from the store (heatmap over the
thumbnail, GeoJSON). A last step paints the heatmap of 20 CLAM-style ``.h5`` bags whose level-0
coordinates reach 100 000 px (the case that allocated a (max+1)^2 grid before). ``base MB`` is
the peak of a process that only imported the modules. Prints a Markdown table for docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_ingest import answer_child_step, machine, run_child_step  # noqa: E402

MPP = 0.25


def write_big_tiff(path: Path, side: int, tile: int = 256, seed: int = 0) -> None:
    """A single-level tiled RGB TIFF, generated a tile at a time (never held whole)."""
    import tifffile

    rng = np.random.default_rng(seed)
    bank = [np.clip(np.array([200, 120, 170]) + rng.normal(0, 25, (tile, tile, 3)), 0, 255).astype(np.uint8)
            for _ in range(8)]
    white = np.full((tile, tile, 3), 242, dtype=np.uint8)
    n = -(-side // tile)
    centre, radius = side / 2, 0.35 * side

    def tiles():
        for r in range(n):
            for c in range(n):
                inside = np.hypot((r + 0.5) * tile - centre, (c + 0.5) * tile - centre) < radius
                yield bank[(r * 7 + c) % len(bank)] if inside else white

    with tifffile.TiffWriter(path, bigtiff=True) as tif:
        tif.write(tiles(), shape=(side, side, 3), dtype=np.uint8, tile=(tile, tile), photometric="rgb",
                  compression="zlib", resolution=(1e4 / MPP, 1e4 / MPP), resolutionunit="CENTIMETER", metadata=None)


# ------------------------------------------------------------------------------------ steps
def step_base(args: dict) -> dict:
    import tasks.ingest.slide_io  # noqa: F401
    import tasks.ingest.wsi  # noqa: F401
    import tasks.report  # noqa: F401
    import skimage.transform  # noqa: F401
    return {}


def step_thumbnail(args: dict) -> dict:
    from tasks.ingest.slide_io import open_slide

    step_base(args)
    start = time.perf_counter()
    with open_slide(args["slide"], args["reader"]) as slide:
        thumb, downsample = slide.thumbnail(2048)
        reader, levels = slide.reader, len(slide.level_shapes)
    return {"seconds": time.perf_counter() - start, "detail": f"{reader}, {levels} level(s), thumbnail {thumb.shape[1]}x{thumb.shape[0]}"}


def step_grid(args: dict) -> dict:
    from tasks.ingest.slide_io import open_slide
    from tasks.ingest.wsi import TilingParams, tile_grid

    step_base(args)
    start = time.perf_counter()
    with open_slide(args["slide"], args["reader"]) as slide:
        grid = tile_grid(slide, TilingParams(tile_size=256, target_mpp=0.5, reader=args["reader"]))
    return {"seconds": time.perf_counter() - start, "detail": f"{len(grid.coords)} of {grid.shape[0] * grid.shape[1]} tiles kept"}


def step_ingest(args: dict) -> dict:
    from tasks.ingest.wsi import TilingParams, ingest_slides

    step_base(args)
    start = time.perf_counter()
    report = ingest_slides(args["store"], [args["slide"]], params=TilingParams(tile_size=256, target_mpp=0.5, reader=args["reader"]),
                           batch_size=64)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "detail": f"{report.n_instances_added} tiles, {report.n_instances_added / seconds:.0f} tiles/s"}


def step_ingest_again(args: dict) -> dict:
    from tasks.ingest.wsi import TilingParams, ingest_slides

    step_base(args)
    start = time.perf_counter()
    report = ingest_slides(args["store"] + ".again", [args["slide"]], batch_size=64, extractor_from=args["store"],
                           params=TilingParams(tile_size=256, target_mpp=0.5, reader=args["reader"]))
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "detail": f"{report.n_instances_added} tiles, {report.n_instances_added / seconds:.0f} tiles/s"}


def step_report(args: dict) -> dict:
    import zarr

    from tasks import report
    from tasks.ingest.wsi import heatmap_background
    from tasks.store import open_cohort

    step_base(args)
    start = time.perf_counter()
    cohort = open_cohort(args["store"])
    coords = zarr.open_group(args["store"], mode="r", zarr_format=3)["instances/coords"][: cohort.n_instances]
    xy, side = report.level0_tiles(coords, cohort.attrs["coords_meaning"])
    scores = np.random.default_rng(0).uniform(size=len(xy))
    thumbnail, downsample, _ = heatmap_background(args["slide"], cohort.attrs["tiling"])
    report.plot_wsi_heatmap(xy, side, scores, Path(args["out"]) / "heatmap.png", thumbnail=thumbnail, thumb_downsample=downsample)
    report.write_geojson(report.tile_geojson(xy, side, scores, np.zeros(len(xy))), Path(args["out"]) / "slide.geojson")
    return {"seconds": time.perf_counter() - start, "detail": f"heatmap {thumbnail.shape[1]}x{thumbnail.shape[0]} + GeoJSON of {len(xy)} tiles"}


def step_h5_heatmaps(args: dict) -> dict:
    from tasks import report

    step_base(args)
    rng = np.random.default_rng(0)
    start = time.perf_counter()
    for b in range(20):
        cells = rng.choice(200 * 200, size=2000, replace=False)
        xy = np.stack([cells % 200, cells // 200], axis=1) * 500.0  # level-0 px up to 99 500
        tiles, side = report.level0_tiles(xy, "x,y (level-0 pixels, as in the .h5)")
        report.plot_wsi_heatmap(tiles, side, rng.uniform(size=len(xy)), Path(args["out"]) / f"h5_{b}.png")
    return {"seconds": time.perf_counter() - start, "detail": "20 bags x 2000 patches, coords up to 99 500 px"}


def compare_readers(side: int) -> None:
    """Thumbnail time and peak memory of each reader on one generic tiled TIFF (same pixels)."""
    with tempfile.TemporaryDirectory() as tmp:
        slide = Path(tmp) / "generic.tif"
        write_big_tiff(slide, side)
        base = run_step("base")["peak_mb"]
        print(f"Readers on a {side} x {side} px single-level tiled TIFF (zlib); base MB = {base:.0f}.\n")
        print("| reader | thumbnail seconds | peak MB |")
        print("|---|---|---|")
        for reader in ("openslide", "tifffile"):
            r = run_step("thumbnail", slide=str(slide), reader=reader)
            print(f"| {reader} | {r['seconds']:.1f} | {r['peak_mb']:.0f} |")


STEPS = {name[5:]: fn for name, fn in globals().items() if name.startswith("step_")}


def run_step(name: str, **args) -> dict:
    return run_child_step(__file__, name, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--side", type=int, default=40_000, help="slide side in pixels (default 40 000)")
    parser.add_argument("--slide", type=Path, help="reuse a slide this script wrote before (its --side must match)")
    parser.add_argument("--reader", default="auto", help="auto | openslide | tifffile")
    parser.add_argument("--steps", default="thumbnail,grid,ingest,ingest_again,report,h5_heatmaps", help="which steps to run")
    parser.add_argument("--before", type=Path, help="also run the ingest steps with the tasks/ of this checkout (before/after)")
    parser.add_argument("--compare-readers", type=int, metavar="SIDE", help="only time both readers' thumbnails at this side")
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("args", nargs="?", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.step:
        code = json.loads(options.args).get("code")
        if code:  # the checkout whose code this step measures
            sys.path.insert(0, code)
        answer_child_step(STEPS, options.step, options.args)
        return
    print(f"Machine: {machine()}\n")
    if options.compare_readers:
        compare_readers(options.compare_readers)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        slide = options.slide or tmp / "big.tif"
        start = time.perf_counter()
        if options.slide is None:
            write_big_tiff(slide, options.side)
        level_mb = options.side ** 2 * 3 / 2**20
        print(f"Slide: {options.side} x {options.side} px single-level tiled TIFF (zlib, 256 px tiles, {MPP} µm/px), "
              f"{slide.stat().st_size / 2**20:.0f} MB on disk, {level_mb:.0f} MB decoded (written in "
              f"{time.perf_counter() - start:.0f} s).\n")
        base = run_step("base")["peak_mb"]
        print("| step | seconds | peak MB | peak − base MB | peak / decoded level | detail |")
        print("|---|---|---|---|---|---|")
        for name, label, args in (
            ("thumbnail", "open + thumbnail (≤ 2048 px)", {"slide": str(slide), "reader": options.reader}),
            ("grid", "tile grid: thumbnail + tissue mask + tiles kept", {"slide": str(slide), "reader": options.reader}),
            ("ingest", "ingest_slides (256 px at 0.5 µm/px, HandcraftedHE fitted first, store)",
             {"slide": str(slide), "store": str(tmp / "s.zarr"), "reader": options.reader}),
            ("ingest_again", "ingest_slides, extractor already fitted (extractor_from)",
             {"slide": str(slide), "store": str(tmp / "s.zarr"), "reader": options.reader}),
            ("report", "report outputs: heatmap over thumbnail + GeoJSON", {"slide": str(slide), "store": str(tmp / "s.zarr"), "out": str(tmp)}),
            ("h5_heatmaps", "20 h5 heatmaps, level-0 coords ≤ 99 500 px", {"out": str(tmp)}),
        ):
            if name not in options.steps.split(","):
                continue
            versions = [("", {})]
            if options.before and name.startswith("ingest"):
                versions = [(" — before", {"code": str(options.before.resolve()), "store": str(tmp / "before.zarr")}),
                            (" — after", {})]
            for suffix, changes in versions:
                r = run_step(name, **(args | changes))
                print(f"| {label}{suffix} | {r['seconds']:.1f} | {r['peak_mb']:.0f} | {r['peak_mb'] - base:.0f} | "
                      f"{r['peak_mb'] / level_mb:.3f} | {r['detail']} |")
        print(f"\nbase MB = {base:.0f} (imports only).")
        if options.before and "ingest_again" in options.steps.split(","):
            from tasks.store import open_cohort

            before, after = open_cohort(str(tmp / "before.zarr") + ".again"), open_cohort(str(tmp / "s.zarr") + ".again")
            a, b = before.read_bags(0, 1), after.read_bags(0, 1)
            same = a.coords.shape == b.coords.shape and bool((a.coords == b.coords).all())
            gap = float(abs(a.features - b.features).max()) if same else float("nan")
            print(f"before/after stores: same tiles {same}, max |feature difference| {gap:.3g}")


if __name__ == "__main__":
    main()
