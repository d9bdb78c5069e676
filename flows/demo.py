"""``gpmil demo``: a synthetic slide cohort and a synthetic CT cohort through the whole pipeline.

Everything is generated locally (tiled pyramidal TIFF slides with tumour regions + a PANDA-style
labels CSV; DICOM head-CT series with bleeds on consecutive slices + an RSNA-style labels CSV) and
run on the embedded default: an ephemeral Prefect server, a LocalCluster, Zarr stores on disk.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from flows.pipeline import pipeline
from tasks.ingest.synthetic import make_ct_cohort, make_slide_cohort

__all__ = ["run_demo", "write_demo_configs"]


def write_demo_configs(workdir: str | Path, *, n_slides: int = 16, n_scans: int = 16, n_corrupt: int = 0, seed: int = 0,
                       max_iter: int = 30) -> dict[str, Path]:
    """Generate the two raw cohorts under ``workdir`` (if not there yet) and their pipeline configs;
    ``n_corrupt`` truncated slide files are added to show how bad input is reported."""
    workdir = Path(workdir).resolve()
    slides, scans = workdir / "raw" / "slides", workdir / "raw" / "ct"
    if not (slides / "labels.csv").exists():
        make_slide_cohort(slides, n_slides, map_shape=(16, 24), seed=seed, tile=128, n_corrupt=n_corrupt)
    if not (scans / "labels.csv").exists():
        make_ct_cohort(scans, n_scans, n_slices=16, size=64, seed=seed)
    model = {"name": "VGPMIL", "params": {"n_inducing": 32, "max_iter": max_iter, "random_state": seed}}
    configs = {
        "wsi": {"name": "demo-wsi", "store": str(workdir / "stores" / "slides.zarr"), "output_dir": str(workdir / "runs" / "wsi"),
                "ingest": {"kind": "wsi", "source": str(slides), "labels": str(slides / "labels.csv"), "tile_size": 128},
                "model": model, "prediction": {"rule": "max"}},
        "ct": {"name": "demo-ct", "store": str(workdir / "stores" / "ct.zarr"), "output_dir": str(workdir / "runs" / "ct"),
               "ingest": {"kind": "ct", "source": str(scans), "labels": str(scans / "labels.csv")},
               "model": model, "prediction": {"rule": "max"}},
    }
    paths = {}
    for name, config in configs.items():
        paths[name] = workdir / f"{name}.yaml"
        paths[name].write_text(yaml.safe_dump(config, sort_keys=False))
    return paths


def run_demo(workdir: str | Path = "gpmil-demo") -> dict[str, str]:
    """Run the pipeline on both demo cohorts; returns the report path of each."""
    return {name: pipeline(str(path))["report"].path for name, path in write_demo_configs(workdir).items()}
