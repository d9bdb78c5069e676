"""Ingest benchmark: tiles/s per core for slide tiling + handcrafted features, CT slices/s, and the
time and peak memory of writing a 1M-instance feature table into a cohort store.

    python benchmarks/bench_ingest.py            # full run (about 4 minutes on 2 cores)
    python benchmarks/bench_ingest.py --quick    # smaller inputs (about 1 minute)

Each measurement runs in a fresh Python process, so its peak resident memory (``ru_maxrss``) is its
own; ``base MB`` is the peak of a process that only imported the modules. Synthetic inputs are
generated first and not timed. Prints Markdown tables (pasted into docs/BENCHMARKS.md, ## Ingest).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def peak_mb() -> float:
    """Peak resident memory of this process (VmHWM; ``ru_maxrss`` would include the forking parent's)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


# ----------------------------------------------------------------------------- steps (children)
def step_base(args: dict) -> dict:
    import tasks.ingest.driver  # noqa: F401
    import tasks.ingest.features  # noqa: F401
    import tasks.ingest.tables  # noqa: F401
    import tasks.ingest.wsi  # noqa: F401
    import skimage.transform  # noqa: F401  (lazily loaded by scikit-image)
    return {}


def step_slides(args: dict) -> dict:
    step_base(args)  # imports are not timed
    from tasks.ingest.driver import run_ingest
    from tasks.ingest.wsi import plan_slides

    start = time.perf_counter()
    plan = plan_slides(args["store"], args["slides"], labels_csv=Path(args["slides"]) / "labels.csv", batch_size=64)
    fitted = time.perf_counter()
    report = run_ingest(args["store"], plan.spec, plan.items, plan.bag_writer, max_workers=args["workers"])
    return {"seconds": time.perf_counter() - fitted, "fit_seconds": fitted - start, "bags": len(report.added),
            "instances": report.n_instances_added}


def step_ct(args: dict) -> dict:
    step_base(args)
    import tasks.ingest.ct  # noqa: F401
    from tasks.ingest.ct import ingest_ct

    start = time.perf_counter()
    report = ingest_ct(args["store"], args["dicom"], labels_csv=Path(args["dicom"]) / "labels.csv",
                       max_workers=args["workers"])
    return {"seconds": time.perf_counter() - start, "bags": len(report.added), "instances": report.n_instances_added}


def step_extractor(args: dict) -> dict:
    from tasks.ingest.features import HandcraftedCT, HandcraftedHE

    rng = np.random.default_rng(0)
    if args["kind"] == "he":
        batch = rng.integers(0, 256, size=(64, 256, 256, 3), dtype=np.uint8)
        extractor = HandcraftedHE().fit(batch)
    else:
        batch = rng.random((32, 512, 512, 3), dtype=np.float32)
        extractor = HandcraftedCT()
    extractor(batch)  # warm-up
    start, repeats = time.perf_counter(), 5
    for _ in range(repeats):
        extractor(batch)
    return {"seconds": time.perf_counter() - start, "instances": repeats * len(batch)}


def step_table(args: dict) -> dict:
    from tasks.ingest.tables import ingest_table, read_parquet_table

    start = time.perf_counter()
    report = ingest_table(args["store"], read_parquet_table(args["parquet"]))
    return {"seconds": time.perf_counter() - start, "bags": len(report.added), "instances": report.n_instances_added}


def step_arrays(args: dict) -> dict:
    from tasks.store import write_cohort_from_arrays

    X = np.load(args["npy"], mmap_mode="r")
    bags = np.load(args["bags"])
    start = time.perf_counter()
    cohort = write_cohort_from_arrays(args["store"], X, bags, bags % 2)
    return {"seconds": time.perf_counter() - start, "bags": cohort.n_bags, "instances": cohort.n_instances}


def step_synthetic(args: dict) -> dict:
    from tasks.ingest.synthetic import make_feature_cohort

    start = time.perf_counter()
    cohort = make_feature_cohort(args["store"], args["n_bags"], args["mean_bag_size"], args["n_features"], 0.1, 0)
    return {"seconds": time.perf_counter() - start, "bags": cohort.n_bags, "instances": cohort.n_instances}


def step_read(args: dict) -> dict:
    from tasks.store import open_cohort

    cohort = open_cohort(args["store"])
    start = time.perf_counter()
    for partition in cohort.partitions(128 * 2**20):
        cohort.read_partition(partition)
    return {"seconds": time.perf_counter() - start, "bags": cohort.n_bags, "instances": cohort.n_instances}


STEPS = {name[5:]: fn for name, fn in globals().items() if name.startswith("step_")}


def run_child_step(script: str, name: str, args: dict) -> dict:
    """Run step ``name`` of ``script`` in a fresh interpreter; return its result with its peak memory."""
    out = subprocess.run([sys.executable, script, "--step", name, json.dumps(args)], check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def answer_child_step(steps: dict, name: str, args_json: str) -> None:
    """The child's side of :func:`run_child_step`: run the step, print its result and peak memory."""
    result = steps[name](json.loads(args_json))
    print(json.dumps({**result, "peak_mb": peak_mb()}))


def run_step(name: str, **args) -> dict:
    return run_child_step(__file__, name, args)


# ---------------------------------------------------------------------------------- the driver
def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return f"{os.cpu_count()} cores (`nproc`), {model}, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="smaller inputs")
    parser.add_argument("--rows", type=int, default=None, help="feature-table rows (default 1e6; 2e5 with --quick)")
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--step", help=argparse.SUPPRESS)
    parser.add_argument("args", nargs="?", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.step:
        answer_child_step(STEPS, options.step, options.args)
        return

    from tasks.ingest.synthetic import make_ct_cohort, make_slide_cohort

    n_slides = 3 if options.quick else 12
    n_scans = 3 if options.quick else 8
    rows = options.rows or (200_000 if options.quick else 1_000_000)
    workers = [1] if options.quick else [1, 2]
    print(f"Machine: {machine()}\n")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        base = run_step("base")["peak_mb"]
        make_slide_cohort(tmp / "slides", n_slides, map_shape=(128, 192), seed=0)
        make_ct_cohort(tmp / "dicom", n_scans, n_slices=32, size=512, seed=0)
        print(f"Slides: {n_slides} synthetic 4096 x 6144 px pyramidal TIFFs (zlib, 256 px tiles), tile 256 at level 0, "
              f"min_tissue 0.5, HandcraftedHE (77 features). CT: {n_scans} series of 32 slices 512 x 512, "
              f"HandcraftedCT (73 features). base MB = {base:.0f}.\n")
        print("`workers` > 1: spawned processes (`max_workers`), start-up (~3 s) included; peak MB is the driver's.\n")
        print("| stage | workers | bags | instances | seconds | instances/s | instances/s per core | peak MB |")
        print("|---|---|---|---|---|---|---|---|")
        for kind in ("he", "ct"):
            r = run_step("extractor", kind=kind)
            label = "HandcraftedHE alone, 64 tiles 256 px" if kind == "he" else "HandcraftedCT alone, 32 slices 512 px"
            rate = r["instances"] / r["seconds"]
            print(f"| {label} | 1 | — | {r['instances']} | {r['seconds']:.2f} | {rate:.0f} | {rate:.0f} | {r['peak_mb']:.0f} |")
        for w in workers:
            for stage, step, source in (("slides: mask + tiles + features + store", "slides", {"slides": str(tmp / "slides")}),
                                        ("CT: DICOM + HU + windows + features + store", "ct", {"dicom": str(tmp / "dicom")})):
                r = run_step(step, store=str(tmp / f"{step}{w}.zarr"), workers=w, **source)
                if "fit_seconds" in r and w == 1:
                    print(f"| slides: fit the HOG PCA (mask + 512 sampled tiles) | 1 | 8 | 512 | {r['fit_seconds']:.2f} "
                          f"| — | — | {r['peak_mb']:.0f} |")
                rate = r["instances"] / r["seconds"]
                print(f"| {stage} | {w} | {r['bags']} | {r['instances']} | {r['seconds']:.2f} | {rate:.0f} | "
                      f"{rate / w:.0f} | {r['peak_mb']:.0f} |")

        import pandas as pd

        rng = np.random.default_rng(0)
        mean_bag = 100
        bags = np.repeat(np.arange(rows // mean_bag), mean_bag)[:rows]
        X = np.lib.format.open_memmap(tmp / "X.npy", mode="w+", dtype=np.float32, shape=(rows, options.features))
        for start in range(0, rows, 100_000):
            X[start:start + 100_000] = rng.normal(size=(min(100_000, rows - start), options.features))
        X.flush()
        np.save(tmp / "bags.npy", bags)
        frame = pd.DataFrame(np.asarray(X), columns=[f"f{i}" for i in range(options.features)])
        frame["bag_id"], frame["label"] = bags.astype(str), bags % 2
        frame.to_parquet(tmp / "table.parquet")
        del frame, X
        data_mb = rows * options.features * 4 / 2**20
        print(f"\nFeature table: {rows:,} instances x {options.features} float32 features ({data_mb:.0f} MB), "
              f"bags of {mean_bag}; base MB = {base:.0f}.\n")
        print("| path | bags | instances | seconds | instances/s | peak MB |")
        print("|---|---|---|---|---|---|")
        for label, step, args in (
            ("Parquet → read_parquet_table → ingest_table", "table", {"parquet": str(tmp / "table.parquet")}),
            ("memmapped .npy → write_cohort_from_arrays", "arrays", {"npy": str(tmp / "X.npy"), "bags": str(tmp / "bags.npy")}),
            ("make_feature_cohort (generated)", "synthetic", {"n_bags": rows // mean_bag, "mean_bag_size": mean_bag,
                                                              "n_features": options.features}),
        ):
            r = run_step(step, store=str(tmp / f"{step}.zarr"), **args)
            print(f"| {label} | {r['bags']} | {r['instances']} | {r['seconds']:.2f} | {r['instances'] / r['seconds']:.0f} | "
                  f"{r['peak_mb']:.0f} |")
        r = run_step("read", store=str(tmp / "arrays.zarr"))
        print(f"| read back: all 128 MB partitions | {r['bags']} | {r['instances']} | {r['seconds']:.2f} | "
              f"{r['instances'] / r['seconds']:.0f} | {r['peak_mb']:.0f} |")


if __name__ == "__main__":
    main()
