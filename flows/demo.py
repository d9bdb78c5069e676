"""``gpmil demo``: synthetic slide and CT cohorts through the whole pipeline, evaluated on held-out cohorts.

Everything is generated locally (tiled pyramidal TIFF slides with tumour regions + a PANDA-style
labels CSV; DICOM head-CT series with bleeds on consecutive slices + an RSNA-style labels CSV) and
run on the embedded default: an ephemeral Prefect server, one LocalCluster, Zarr stores on disk.

For each modality there are two cohorts from the same generator with different seeds: a training
cohort and a held-out cohort. The model is trained on the first; the stored model then predicts the
second (the "new cohort, trained model" path), and the report's metrics are on the held-out cohort.
"""

from pathlib import Path

import yaml
from prefect import flow

from flows.config import load_config
from flows.pipeline import ingest_cohort, pipeline, run_cluster
from tasks.ingest.synthetic import make_ct_cohort, make_slide_cohort

__all__ = ["demo", "write_demo_configs", "MODALITIES"]

MODALITIES = ("wsi", "ct")
HELDOUT_SEED_OFFSET = 1000


def write_demo_configs(workdir: str | Path, *, n_slides: int = 16, n_scans: int = 16, n_heldout: int = 16, n_corrupt: int = 0,
                       seed: int = 0, max_iter: int = 30) -> dict[str, Path]:
    """Generate the raw cohorts under ``workdir`` (if not there yet) and their pipeline configs.

    Per modality: ``<modality>.yaml`` (ingest and train on the training cohort, predict and evaluate
    the held-out store) and ``<modality>-heldout.yaml`` (ingest the held-out cohort of ``n_heldout``
    slides/scans, generated with seed ``seed + 1000``; the slides take the training store's fitted
    feature extractor). ``n_corrupt`` truncated slide files are added to the training slides to
    show how bad input is reported.
    """
    workdir = Path(workdir).resolve()
    raw, stores = workdir / "raw", workdir / "stores"
    cohorts = {
        "wsi": lambda folder, n, s, corrupt: make_slide_cohort(folder, n, map_shape=(16, 24), seed=s, tile=128, n_corrupt=corrupt),
        "ct": lambda folder, n, s, corrupt: make_ct_cohort(folder, n, n_slices=16, size=64, seed=s),
    }
    sizes = {"wsi": n_slides, "ct": n_scans}
    model = {"name": "VGPMIL", "params": {"n_inducing": 32, "max_iter": max_iter, "random_state": seed}}
    paths = {}
    for modality, make in cohorts.items():
        train_dir, heldout_dir = raw / modality, raw / f"{modality}-heldout"
        if not (train_dir / "labels.csv").exists():
            make(train_dir, sizes[modality], seed, n_corrupt)
        if not (heldout_dir / "labels.csv").exists():
            make(heldout_dir, n_heldout, seed + HELDOUT_SEED_OFFSET, 0)
        train_store, heldout_store = stores / f"{modality}.zarr", stores / f"{modality}-heldout.zarr"
        ingest = {"kind": modality, **({"tile_size": 128} if modality == "wsi" else {})}
        configs = {
            modality: {"name": f"demo-{modality}", "store": str(train_store), "output_dir": str(workdir / "runs" / modality),
                       "ingest": {**ingest, "source": str(train_dir), "labels": str(train_dir / "labels.csv")},
                       "model": model, "prediction": {"store": str(heldout_store)}},
            f"{modality}-heldout": {"name": f"demo-{modality}-heldout", "store": str(heldout_store),
                                    "output_dir": str(workdir / "runs" / f"{modality}-heldout"),
                                    "ingest": {**ingest, "source": str(heldout_dir), "labels": str(heldout_dir / "labels.csv"),
                                               "extractor_from": str(train_store)}},
        }
        for name, config in configs.items():
            paths[name] = workdir / f"{name}.yaml"
            paths[name].write_text(yaml.safe_dump(config, sort_keys=False))
    return paths


@flow(name="gpmil-demo", log_prints=True)
def demo(workdir: str = "gpmil-demo", n_slides: int = 16, n_scans: int = 16, n_heldout: int = 16, n_corrupt: int = 0,
         max_iter: int = 30) -> dict[str, str]:
    """Per modality, on one Dask cluster: ingest the training cohort, ingest the held-out cohort
    with the training cohort's features, then train on the first and predict + evaluate the
    held-out one with the stored model (:func:`write_demo_configs` for the sizes). Returns the
    report path of each modality."""
    paths = write_demo_configs(workdir, n_slides=n_slides, n_scans=n_scans, n_heldout=n_heldout, n_corrupt=n_corrupt, max_iter=max_iter)
    configs = {name: str(path) for name, path in paths.items()}
    reports = {}
    with run_cluster(load_config(configs[MODALITIES[0]])) as address:
        for modality in MODALITIES:
            ingest_cohort(configs[modality], scheduler_address=address)  # first: held-out slides take its extractor
            ingest_cohort(configs[f"{modality}-heldout"], scheduler_address=address)
            reports[modality] = pipeline(configs[modality], scheduler_address=address)["report"].path
    return reports
