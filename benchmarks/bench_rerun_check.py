"""What the input stamps cost (``tasks.ingest.stamps``): stamping a bag's files at ingest, and a
rerun's check that they have not changed — by ``stat`` alone, and by sampled bytes after a
``touch`` (a copied cohort) — against reading each file once, on the same files.

    python benchmarks/bench_rerun_check.py --files 400 --mib 4 --workdir /tmp/rerun-bench

The files are written first (not timed) and are in the page cache when timed: the ratios are those
of a warm cache (a cold network file system makes the stamps' two 64 KiB reads relatively cheaper
still against a whole read, and the ``stat`` check's metadata calls the larger part).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tasks.ingest.stamps import file_change, file_stamp  # noqa: E402


def timed(work) -> tuple[float, object]:
    started = time.perf_counter()
    result = work()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=400)
    parser.add_argument("--mib", type=float, default=4.0, help="size of each file")
    parser.add_argument("--workdir", type=Path, required=True)
    args = parser.parse_args()

    folder = args.workdir / "inputs"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    block = rng.bytes(int(args.mib * 2**20))
    paths = []
    for k in range(args.files):
        path = folder / f"slide_{k:05d}.h5"
        path.write_bytes(block[k % 997:] + block[:k % 997])  # same size, other bytes
        paths.append(str(path))

    whole, _ = timed(lambda: [Path(p).read_bytes() for p in paths])
    stamping, stamps = timed(lambda: [file_stamp([p]) for p in paths])
    unchanged, changes = timed(lambda: [file_change([p], s) for p, s in zip(paths, stamps)])
    assert not any(changes)
    for p in paths:
        os.utime(p, ns=(1, 1))
    touched, changes = timed(lambda: [file_change([p], s) for p, s in zip(paths, stamps)])
    assert not any(changes)

    print(f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}; "
          f"{args.files} files of {args.mib:g} MiB in {folder} (warm page cache)")
    print("| step | s | ms per file | × reading every file once |")
    print("|---|---|---|---|")
    for name, seconds in (("read every file once (reference)", whole), ("stamp at ingest (stat + first and last 64 KiB)", stamping),
                          ("rerun check, files unchanged (stat only)", unchanged),
                          ("rerun check after a touch (stat + sampled bytes)", touched)):
        print(f"| {name} | {seconds:.3f} | {1e3 * seconds / args.files:.3f} | {seconds / whole:.3f} |")
    shutil.rmtree(folder)


if __name__ == "__main__":
    main()
