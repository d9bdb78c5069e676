"""Prefect flows: ``ingest_cohort``, ``train_model``, ``predict_cohort``, ``evaluate_run`` and
``pipeline`` (all four), each parameterised by a YAML configuration (:mod:`flows.config`).

One Dask cluster per flow run, built from the configuration's ``dask`` section (a cluster class by
import path, default ``LocalCluster``, or a running scheduler's address; :mod:`tasks.cluster`);
the flow hands its address to the tasks, whose clients attach to it.

Flow parameters are JSON values (the configuration is a path), so a deployment can carry them,
and their annotations are real objects, not ``from __future__`` strings: a served deployment
runs the flow from a cloudpickled copy whose globals hold only what the body uses, where Prefect
could not resolve a string annotation such as ``"PipelineConfig"``.
"""

import json
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import dask
from distributed import Client
from prefect import flow, get_run_logger
from prefect.artifacts import create_link_artifact

from flows.checks import check_inputs, resolved_model_dir
from flows.config import IngestConfig, PipelineConfig, TableColumns, load_config, new_cohort_labels, new_cohort_store
from tasks import prefect_tasks as t
from tasks.cluster import check_scheduler_answers, dotted, start_cluster, wait_for_first_worker, worker_start_errors
from tasks.lease import reader_lease
from tasks.retention import LATEST_MODEL, record_run
from tasks.store import open_cohort

__all__ = ["ingest_cohort", "train_model", "predict_cohort", "evaluate_run", "pipeline", "run_cluster"]


@contextmanager
def run_cluster(config: PipelineConfig, scheduler_address: str | None = None) -> Iterator[str]:
    """The scheduler address of the run's one cluster: the given one (a parent flow's), the
    configured ``dask.scheduler_address``, or a cluster built from ``dask.cluster_class`` (default:
    a LocalCluster) and closed afterwards. Waits for the first worker; links the Dask dashboard
    to the flow run (a link artifact)."""
    if scheduler_address:
        yield scheduler_address
        return
    d = config.dask
    with ExitStack() as stack:
        if d.scheduler_address:  # the file's settings (timeouts, TLS) hold for the client too
            stack.enter_context(dask.config.set(dotted(d.cluster_spec()["dask_config"] or {})))
            check_scheduler_answers(d.scheduler_address, min(d.worker_timeout_s, 30.0))
        start_errors = stack.enter_context(worker_start_errors())
        cluster = None if d.scheduler_address else stack.enter_context(start_cluster(**d.cluster_spec()))
        client = stack.enter_context(Client(d.scheduler_address or cluster))
        wait_for_first_worker(client, d.worker_timeout_s, cluster, start_errors)
        if client.dashboard_link:
            create_link_artifact(client.dashboard_link, link_text="Dask dashboard", key=t.artifact_key("dask-dashboard", config.name),
                                 description=f"Dask dashboard of this run's cluster ({type(cluster).__name__ if cluster else d.scheduler_address})")
        yield client.scheduler.address


def _config(config: str, store: str | None = None, source: str | None = None) -> PipelineConfig:
    """The validated configuration with the command line's store / ingest source overrides."""
    cfg = load_config(config, **({"store": store} if store is not None else {}))
    if source is not None:
        cfg = cfg.model_copy(update={"ingest": cfg.ingest.model_copy(update={"source": Path(_beside(config, source))})})
    return cfg


@contextmanager
def _reading_model(config: str, cfg: PipelineConfig, model_dir: str, stage: str) -> Iterator[str]:
    """A flow's ``model_dir`` (beside the configuration when relative; for ``predict``, ``latest``:
    the model of the newest completed run of the configuration, named in the log), under a reader
    lease (:func:`tasks.lease.reader_lease`) so that no ``keep_runs`` removes it while it is read.
    A ``latest`` model removed just before the lease (a newer run pruned it) is looked up again; a
    missing folder is left to :func:`~flows.checks.check_inputs` to name; a folder this process
    cannot write into (read-only, another user's) is read without a lease, logged."""
    lease = ExitStack()
    for _ in range(3):
        resolved = _beside(config, resolved_model_dir(cfg, model_dir, stage))
        if _take_reader_lease(lease, resolved, f"{cfg.name}: {stage} with {Path(resolved).name}") or model_dir != LATEST_MODEL:
            break
    with lease:
        if model_dir == LATEST_MODEL:
            get_run_logger().info("MODEL_DIR %s: %s, the model of the newest completed run of %r", LATEST_MODEL, resolved, cfg.name)
        yield resolved


def _take_reader_lease(stack: ExitStack, model: str | Path, purpose: str) -> bool:
    """Enter ``model``'s reader lease on ``stack`` (:func:`tasks.lease.reader_lease`). False when it
    is no model folder (a lease file would be left in it) or went as we came (a ``keep_runs``
    removed it); a folder this process cannot write into (read-only, another user's) is read
    without one, logged."""
    if not Path(model, "model.json").is_file():
        return False
    try:
        stack.enter_context(reader_lease(model, purpose))
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as error:
        get_run_logger().warning("the model %s is read without a reader lease (%s: %s): a keep_runs of its configuration "
                                 "may remove it meanwhile", model, type(error).__name__, error)
    return True


def _beside(config: str, path: str | None) -> str | None:
    """A flow parameter's path as the configuration's own paths are read: relative to the config
    file's folder (a deployment's run parameters, typed in the UI, would otherwise be read from
    the working directory of whichever process serves it). The command line passes absolute paths."""
    if path is None:
        return None
    path = Path(path).expanduser()
    return str(path if path.is_absolute() else (Path(config).resolve().parent / path).resolve())


@flow(name="ingest-cohort", log_prints=True)
def ingest_cohort(config: str, store: str | None = None, source: str | None = None,
                  scheduler_address: str | None = None) -> t.StageResult:
    """Tile + featurise new slides/scans (one task each, on the cluster) or load a feature table
    into the cohort store; slides already in the store are skipped."""
    cfg = _config(config, store=store, source=source)
    check_inputs(cfg, "ingest")
    with run_cluster(cfg, scheduler_address) as address:
        return t.ingest_cohort_items(cfg, address)


@flow(name="train-model", log_prints=True)
def train_model(config: str, store: str | None = None, scheduler_address: str | None = None) -> t.StageResult:
    """Train the configured model on the store (reusing a model trained on the same content)."""
    cfg = _config(config, store=store)
    check_inputs(cfg, "train")
    with run_cluster(cfg, scheduler_address) as address:
        fingerprint = t.fingerprint_cohort(str(cfg.store))
        return t.train(cfg, str(cfg.store), cfg.model_key(fingerprint), address)


def new_cohort_ingest(ingest: IngestConfig, source: str | Path, labels: str | Path | None,
                      trained: dict[str, Any], base_mpp: float | None = None) -> IngestConfig:
    """How ``predict --source`` reads a new cohort: like ``ingest`` (the training cohort's settings)
    from ``source``, with the training store's fitted extractor (``trained``: the model's
    ``model.json``), its labels from ``labels`` read as the config's labels section reads its file
    (its id and label columns, target or positive values; else the kind's convention), and a
    Parquet table's features by the model's column names; bags the labels do not give are predicted,
    unlabelled (``ingest.unlabelled: keep``), not left out. Slides are tiled and featurised as the
    training store records (its tiling and its extractor, whatever the config says now: a config
    edited since trained on 128-px tiles and predicted 256-px ones, or featurised with new weights
    and failed only after the whole ingest). Each new slide's µm/px is its own metadata's, or
    ``base_mpp`` where given: the training cohort's ``base_mpp`` described its scanner, and
    overrode every new slide's own (0.5 µm/px slides tiled as 0.25, each tile four times the area)."""
    new_labels = new_cohort_labels(ingest.labels, labels)
    training_store = Path(trained["store"]) if trained.get("store") else None
    ingest = ingest.model_copy(update={"source": Path(source), "labels": new_labels, "unlabelled": "keep",
                                       "extractor_from": training_store})
    if training_store is not None and (training_store / "zarr.json").is_file() and ingest.kind in ("wsi", "ct"):
        from tasks.ingest.features import import_paths

        named = import_paths(ingest.extractor, ingest.extractor_params) if ingest.extractor else frozenset()
        ingest = ingest.model_copy(update={"extractor": None, "extractor_params": {},  # the store's, by extractor_from,
                                           "trusted_imports": sorted({*ingest.trusted_imports, *named})})  # built from code the config names
        tiling = open_cohort(training_store).attrs.get("tiling") or {}
        if ingest.kind == "wsi" and "tile_size" in tiling:
            ingest = ingest.model_copy(update={
                "tile_size": tiling["tile_size"], "level": tiling["level"], "magnification": tiling.get("magnification"),
                "target_mpp": tiling.get("target_mpp"),
                "min_tissue_fraction": tiling.get("min_tissue", ingest.min_tissue_fraction)})
    if ingest.kind == "wsi":
        ingest = ingest.model_copy(update={"base_mpp": base_mpp})  # the new slides' own, not the training scanner's
    if trained.get("feature_columns") and Path(source).suffix.lower() == ".parquet":
        columns = (ingest.columns or TableColumns()).model_copy(update={"features": list(trained["feature_columns"])})
        ingest = ingest.model_copy(update={"columns": columns})
    return ingest


@flow(name="predict-cohort", log_prints=True)
def predict_cohort(config: str, model_dir: str, store: str | None = None, source: str | None = None,
                   labels: str | None = None, scheduler_address: str | None = None,
                   base_mpp: float | None = None) -> t.StageResult:
    """Predict every bag of a cohort (``store``, else ``prediction.store``, else the training store)
    with a saved model and write its report and tables; the result's ``info`` says where.

    With ``source`` (a folder of new slides, scans or feature files, read like ``ingest.source``)
    the new cohort is first ingested into its own store (``store``, else
    ``<output_dir>/stores/<folder>-<hash>.zarr``) with the feature extractor of the store the model
    was trained on (``labels``: optional, for metrics; ``base_mpp``: the new slides' level-0 µm/px
    where their metadata gives none or a wrong one)."""
    cfg = _config(config)
    store, source, labels = (_beside(config, path) for path in (store, source, labels))
    with _reading_model(config, cfg, model_dir, "predict") as model_dir:
        trained = json.loads((Path(model_dir) / "model.json").read_text()) if Path(model_dir, "model.json").is_file() else {}
        if source is not None:
            new_store = Path(store) if store else new_cohort_store(cfg.output_dir, source)
            cfg = cfg.model_copy(update={"ingest": new_cohort_ingest(cfg.ingest, source, labels, trained, base_mpp),
                                         "prediction": cfg.prediction.model_copy(update={"store": new_store})})
            check_inputs(cfg, "predict", model_dir=model_dir, source=source)
        else:
            check_inputs(cfg, "predict", store=store, model_dir=model_dir)
        target = str(store or cfg.prediction.store or cfg.store) if source is None else str(cfg.prediction.store)
        with run_cluster(cfg, scheduler_address) as address:
            ingested = t.ingest_cohort_items(cfg.model_copy(update={"store": Path(target)}), address) if source is not None else None
            key = cfg.prediction_key(Path(model_dir).name, t.fingerprint_cohort(target))
            predicted = t.predict(cfg, target, model_dir, key, address)
        reported = t.write_report(cfg, target, model_dir, key)
    info = {"store": target, "report": reported.path, "metrics": reported.info,
            "skipped": [] if ingested is None else ingested.info.get("skipped", []),
            "ingest_report": None if ingested is None else ingested.info.get("report_path")}
    return t.StageResult(key, predicted.path, predicted.reused and reported.reused, info)


@flow(name="evaluate-run", log_prints=True)
def evaluate_run(config: str, model_dir: str, prediction_key: str, store: str | None = None) -> t.StageResult:
    """Tables, metrics, figures and the report of one prediction run."""
    cfg = _config(config)
    store = _beside(config, store)
    with _reading_model(config, cfg, model_dir, "evaluate") as model_dir:
        check_inputs(cfg, "evaluate", store=store, model_dir=model_dir, prediction_key=prediction_key)
        target = str(store or cfg.prediction.store or cfg.store)
        return t.write_report(cfg, target, model_dir, prediction_key)


@flow(name="gpmil-pipeline", log_prints=True)
def pipeline(config: str, store: str | None = None, source: str | None = None,
             scheduler_address: str | None = None) -> dict[str, t.StageResult]:
    """Ingest → train → predict → evaluate on one cluster. Reruns skip what is done: slides
    already ingested, a model trained on the same cohort content and configuration, complete
    predictions; a changed configuration recomputes only the stages it affects."""
    logger = get_run_logger()
    cfg = _config(config, store=store, source=source)
    check_inputs(cfg, "run")
    results: dict[str, t.StageResult] = {}
    # The model's reader lease, from before the training stage looks at it (a model trained before is
    # an older record's, which a parallel run's keep_runs may remove) until this run's record names it.
    with ExitStack() as reading_model:
        with run_cluster(cfg, scheduler_address) as address:
            if cfg.ingest.kind != "none":
                results["ingest"] = t.ingest_cohort_items(cfg, address)
            training_store = str(cfg.store)
            model_key = cfg.model_key(t.fingerprint_cohort(training_store))
            purpose = f"{cfg.name}: run with {model_key}"
            leased = _take_reader_lease(reading_model, Path(cfg.output_dir) / "models" / model_key, purpose)
            trained = t.train(cfg, training_store, model_key, address)
            results["train"] = trained
            if not leased:
                _take_reader_lease(reading_model, trained.path, purpose)
            target = str(cfg.prediction.store or cfg.store)
            key = cfg.prediction_key(trained.key, t.fingerprint_cohort(target))
            results["predict"] = t.predict(cfg, target, trained.path, key, address)
        results["report"] = t.write_report(cfg, target, trained.path, key)
        logger.info("report: %s", results["report"].path)
        record = _write_latest(cfg, results)
    if cfg.keep_runs is not None:
        t.keep_newest_runs(cfg, str(record))
    return results


def _write_latest(cfg: PipelineConfig, results: dict[str, t.StageResult]) -> Path:
    """``latest-run.json`` and the run's record in ``runs/`` (:func:`tasks.retention.record_run`), whose path it returns."""
    latest = {"finished": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "config": cfg.name, "store": str(cfg.store),
              "model_dir": results["train"].path, "predicted_store": str(cfg.prediction.store or cfg.store),
              "prediction_key": results["report"].key, "report": results["report"].path}
    return record_run(cfg.output_dir, latest, results["train"].key)
