"""Costs that grow with a cohort's bags and tiles: a feature table of many small bags into a
store, one slide's QuPath GeoJSON, and the instance probabilities with their Monte Carlo std.

    python benchmarks/bench_cohort_scale.py                      # 10,000 bags x 100 rows, 10^5 tiles
    python benchmarks/bench_cohort_scale.py --bags 2000 --rows 50 --tiles 20000   # quicker

Prints one Markdown row per measurement (pasted into docs/BENCHMARKS.md); inputs are generated
first and not timed. Run it at two commits to compare (the ratio within one machine's run).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def table_ingest(folder: Path, bags: int, rows: int, features: int) -> float:
    """Seconds to ingest a Parquet table of ``bags`` × ``rows`` rows into a new store."""
    import pandas as pd

    from tasks.ingest.tables import ingest_table, read_parquet_table

    rng = np.random.default_rng(0)
    table = pd.DataFrame(rng.normal(size=(bags * rows, features)).astype(np.float32),
                         columns=[f"f{j}" for j in range(features)])
    table.insert(0, "bag", np.repeat([f"s{b:05d}" for b in range(bags)], rows))
    table.insert(1, "label", np.repeat(np.arange(bags) % 2, rows))
    table.to_parquet(folder / "table.parquet")
    start = time.perf_counter()
    ingest_table(folder / "store.zarr", read_parquet_table(folder / "table.parquet", bag_column="bag", label_column="label"))
    return time.perf_counter() - start


def geojson(folder: Path, tiles: int) -> float:
    """Seconds to write one slide's GeoJSON of ``tiles`` tiles (best of two)."""
    from tasks import report

    rng = np.random.default_rng(0)
    xy, scores = rng.integers(0, 100_000, size=(tiles, 2)) * 1.0, rng.uniform(size=tiles)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        report.write_geojson(report.tile_geojson(xy, 224.0, scores, scores / 5, bag_id="slide"), folder / "slide.geojson")
        times.append(time.perf_counter() - start)
    return min(times)


def instance_std(tiles: int, features: int) -> float:
    """Seconds for ``VGPMIL.predict_instance_proba(X, return_std=True)`` of ``tiles`` rows (best of
    two; the model fitted first on 40 small bags, not timed; its default 500 Monte Carlo draws)."""
    from mil_core import RBF, VGPMIL

    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(40) % 2, 10)
    X = rng.normal(size=(labels.size, features))
    X[:, 0] += 2.0 * labels * (rng.random(labels.size) < 0.3)
    with warnings.catch_warnings():  # 5 sweeps: a model to predict with, not a converged one
        warnings.simplefilter("ignore")
        model = VGPMIL(kernel=RBF(4.0), n_inducing=50, max_iter=5, random_state=0).fit(X, np.repeat(np.arange(40), 10), labels)
    rows = rng.normal(size=(tiles, features))
    times = []
    for _ in range(2):
        start = time.perf_counter()
        model.predict_instance_proba(rows, return_std=True)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bags", type=int, default=10_000)
    parser.add_argument("--rows", type=int, default=100)
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--tiles", type=int, default=100_000)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="gpmil-scale-"))
    try:
        seconds = table_ingest(folder, args.bags, args.rows, args.features)
        print(f"| feature table, {args.bags} bags × {args.rows} rows, D = {args.features} | {seconds:.1f} s |")
        seconds = geojson(folder, args.tiles)
        print(f"| GeoJSON of one slide, {args.tiles} tiles | {seconds:.2f} s ({1e6 * seconds / args.tiles:.1f} µs a tile) |")
        seconds = instance_std(args.tiles, args.features)
        print(f"| instance probability and std, {args.tiles} tiles | {seconds:.2f} s ({1e6 * seconds / args.tiles:.1f} µs a tile) |")
    finally:
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
