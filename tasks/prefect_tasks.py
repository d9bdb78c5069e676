"""Prefect tasks: thin wrappers of the store, training, prediction and report functions.

Results are keyed on content and persisted next to the data (model files under
``<output_dir>/models/<key>/``, predictions in the store under ``predictions/<key>``), so a task
whose result exists returns it without recomputing (``reused=True`` in its result); Prefect's own
result caching is therefore off. I/O tasks retry with back-off on transient errors only.
"""

from __future__ import annotations

import functools
import hashlib
import html
import json
import os
import secrets
import shutil
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import zarr
from distributed import Client
from prefect import get_run_logger, task
from prefect.artifacts import (create_image_artifact, create_link_artifact, create_markdown_artifact, create_progress_artifact,
                               create_table_artifact, update_progress_artifact)
from prefect.cache_policies import NO_CACHE

from flows.config import PipelineConfig, make_model
from mil_core import EmbeddedGPMIL, persist
from mil_core.persist import write_whole
from mil_core.models.base import sweep_budget
from mil_core.models.embedded import default_gp
from tasks import diagnostics, report, retention
from tasks.ingest.driver import (BagWriter, IngestItem, IngestRun, Skipped, ingested_from_elsewhere, left_out_lines, recorded_extractor,
                                 stage_item, summarise_left_out)
from tasks.ingest.h5 import H5_COORDS_MEANING, h5_patch_side
from tasks.ingest.errors import NothingIngestedError
from tasks.ingest.stamps import file_change, stamp_content
from tasks.lease import ensure_still_held, writer_lease
from tasks.paths import bag_file
from tasks.store import Cohort, column_difference, open_cohort
from tasks.training import FeatureScaling, fit_cohort, predict_cohort, read_predictions
from tasks.training.embedded import fit_cohort_embedded
from tasks.training.errors import CohortError
from tasks.training.predict import prediction_kwargs



@dataclass(frozen=True)
class StageResult:
    """What a stage produced and whether it was reused from an earlier run."""

    key: str
    path: str
    reused: bool
    info: dict[str, Any]


ARTIFACT_KEY_CHARS = 100
ARTIFACT_KEY_DIGEST_CHARS = 12


def artifact_key(*parts: str) -> str:
    """Prefect artifact keys allow lowercase letters, digits and dashes only. A key longer than
    :data:`ARTIFACT_KEY_CHARS` keeps its readable start and ends with a digest of the whole key:
    cut at the length alone, two figures whose keys differed only at the end (the hash
    ``safe_filename`` gives two DICOM UIDs ``…637.1`` and ``…637.2``) got one key."""
    text = "".join(c if c.isascii() and c.isalnum() else "-" for c in "-".join(parts).lower()).strip("-")  # 'é' is refused
    if len(text) <= ARTIFACT_KEY_CHARS:
        return text
    digest = hashlib.sha256(text.encode()).hexdigest()[:ARTIFACT_KEY_DIGEST_CHARS]
    return f"{text[: ARTIFACT_KEY_CHARS - ARTIFACT_KEY_DIGEST_CHARS - 1].rstrip('-')}-{digest}"


def progress_bar(done: int, total: int, width: int = 24) -> str:
    """A text progress bar for logs (they reach the console and the Prefect UI): ``[#####.....] 5/10``."""
    filled = int(round(width * done / max(total, 1)))
    return f"[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"


def is_transient(error: BaseException | None) -> bool:
    """Worth a retry: I/O and network errors (a stale NFS handle, a dropped connection), a timeout,
    a lost Dask worker. Deterministic errors fail the same way every time and are not retried: a
    missing file or folder, a permission, bad input (an :class:`IngestError`: unreadable file,
    no tissue, wrong label), a validation error, a bug."""
    from distributed import KilledWorker
    from distributed.comm.core import CommClosedError

    from tasks.ingest.errors import IngestError

    deterministic = (IngestError, FileNotFoundError, FileExistsError, IsADirectoryError, NotADirectoryError, PermissionError)
    return (isinstance(error, (OSError, TimeoutError, KilledWorker, CommClosedError)) and not isinstance(error, deterministic)
            and not _while_stopping(error))


def _while_stopping(error: BaseException) -> bool:
    """Whether ``error`` came about while the run was being stopped (Ctrl-C, SIGTERM): a closed
    connection raised as a KeyboardInterrupt unwinds is no transient fault, and a retry would resume
    the work the user stopped."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            return True
        seen.add(id(error))
        error = error.__cause__ or error.__context__
    return False


def _retry_if_transient(task, task_run, state) -> bool:
    return is_transient(state.result(raise_on_failure=False))


# Prefect retries a task with these settings only when ``is_transient`` says so.
RETRY_IF_TRANSIENT = dict(retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=_retry_if_transient)


@task(name="fingerprint-cohort", task_run_name="fingerprint {store}", cache_policy=NO_CACHE, **RETRY_IF_TRANSIENT)
def fingerprint_cohort(store: str) -> str:
    """Content fingerprint of a store: bag ids, labels, offsets, the feature extractor and — for
    bags ingested with one — the content part of each bag's input stamp, so that two stores of one
    cohort whose features came from other files (two extractors' ``.h5`` folders, tables with
    other columns) do not share a model key. Stores without stamps keep the fingerprint they had."""
    cohort = open_cohort(store)
    digest = hashlib.sha256()
    for array in (np.asarray(cohort.bag_ids, dtype=str), np.asarray(cohort.bag_labels), np.asarray(cohort.offsets)):
        digest.update(array.tobytes())
    digest.update(json.dumps(cohort.attrs.get("feature_extractor"), sort_keys=True, default=str).encode())
    contents = [stamp_content(stamp) for stamp in cohort.input_stamps]
    if any(contents):
        digest.update("\0".join(contents).encode())
    return digest.hexdigest()[:16]


@task(name="train-model", task_run_name="train {config.model.name} on {store}", cache_policy=NO_CACHE)
def train(config: PipelineConfig, store: str, model_key: str, scheduler_address: str) -> StageResult:
    """Fit the configured model on the store's labelled bags on the Dask cluster (resuming a
    checkpointed run with the same key), or reuse the model saved under that key."""
    logger = get_run_logger()
    model_dir = Path(config.output_dir) / "models" / model_key
    if (model_dir / MODEL_FILE).exists():
        try:
            described = json.loads((model_dir / "model.json").read_text())
            logger.info("model %s already trained on this cohort with this configuration: reusing %s", model_key, model_dir)
            return StageResult(model_key, str(model_dir), True, described)
        except (OSError, ValueError) as error:  # its description deleted or damaged since: trained (resumed) again
            logger.warning("model %s: %s beside %s is unreadable (%s): training it again", model_key, "model.json",
                           MODEL_FILE, error)
            (model_dir / MODEL_FILE).unlink()
    model = make_model(config.model)
    embedded = isinstance(model, EmbeddedGPMIL)  # the network trains on the client, its GP on the cluster
    model.set_params(standardize=config.training.standardize)  # the one switch; the saved params then say how it was trained
    gp = (model.gp or default_gp()) if embedded else model  # the estimator whose sweeps are reported
    warnings = []
    if not config.training.standardize and (message := diagnostics.feature_scale_spread(diagnostics.sample_features(store))):
        warnings.append(message)
        logger.warning(message)
    progress = create_progress_artifact(0.0, key=artifact_key("training", config.name), description=f"{config.model.name} iterations")

    def on_iteration(iteration: int, objective: float) -> None:
        budget = sweep_budget(gp, None)[0]  # the sweeps kernel=None chose, else max_iter
        update_progress_artifact(progress, 100.0 * iteration / budget)
        logger.info("training %s %s %.4f", progress_bar(iteration, budget), gp.objective_name, objective)

    with Client(scheduler_address) as client:
        summary = (fit_cohort_embedded if embedded else fit_cohort)(
            model, store, client, run=model_key, partition_bytes=int(config.training.partition_mib * 2**20),
            mode=config.training.mode, device=config.training.device, gpu_namespace=config.training.gpu_namespace,
            device_memory=None if config.training.device_memory_gib is None else int(config.training.device_memory_gib * 2**30),
            compute_dtype=config.training.compute_dtype,
            checkpoint_every=config.training.checkpoint_every,
            standardize=config.training.standardize, on_iteration=on_iteration,
        )
    update_progress_artifact(progress, 100.0)
    gp = model.gps_[-1] if embedded else model  # an ensemble: its last member's GP (fit_cohort_embedded's summary)
    trace = gp.elbo_ if hasattr(gp, "elbo_") else gp.objective_  # AbSMIL: its loss (Eq. 3) per iteration
    stored = open_cohort(store).attrs
    info = {
        "model": config.model.name, "params": config.model.params, "store": store, "key": model_key,
        "n_iter": int(gp.n_iter_), "converged": bool(gp.converged_),
        "chosen_sweeps": budget if (budget := sweep_budget(gp, None)[0]) < gp.max_iter else None,  # kernel=None's stop
        "choices": report.model_choices(model),  # kernel variance, the choice's held-out AUCs, bag rule
        "objective_name": gp.objective_name, "objective": [float(e) for e in trace],  # ELBO, a chain's log joint, a loss
        "mode": summary.mode, "device": summary.device, "n_partitions": summary.n_partitions,
        "n_bags": summary.n_bags, "n_instances": summary.n_instances, "resumed_from": summary.resumed_from,
        "feature_extractor": stored.get("feature_extractor"),
        "feature_columns": stored.get("feature_columns"),  # a named table's, else None
    }
    if hasattr(gp, "rhat_") and not gp.converged_:  # a sampler: its chain, not a tolerance
        warnings.append(f"the chain's largest split-R-hat is {gp.rhat_:.2f} > 1.05 after {gp.n_iter_} sweeps: its samples "
                        "are not yet from the posterior; run a longer chain (model.params.n_samples, thin, burn_in)")
        logger.warning(warnings[-1])
    elif getattr(gp, "converged_", True) is False and gp.n_iter_ >= gp.max_iter:
        warnings.append(f"the fit stopped at max_iter={gp.max_iter} without converging (tol={gp.tol}): raise "
                        f"model.params.max_iter, or check the {gp.objective_name} trace ({OBJECTIVE_FIGURE})")
        logger.warning(warnings[-1])
    info["warnings"] = warnings
    write_whole(model_dir / "model.json", json.dumps(info, indent=1, default=str).encode())
    report.plot_objective(trace, model_dir / OBJECTIVE_FIGURE, gp.objective_name)
    save_model(model_dir, TrainedModel(model, summary.scaling))  # last: marks it complete
    logger.info("trained %s in %d iterations (%s mode, %s) → %s", config.model.name, gp.n_iter_, summary.mode, summary.device, model_dir)
    return StageResult(model_key, str(model_dir), False, info)




@dataclass(frozen=True)
class IngestWork:
    """What the per-item tasks need: the open ingest (store, items to stage) and the bag writer."""

    run: IngestRun
    bag_writer: BagWriter


def _ingest_files(config: PipelineConfig, client: Any) -> StageResult:
    """:func:`ingest_table` of a ``.h5`` or ``.npy`` folder, each file staged by a task of ``client``."""
    from tasks.ingest.h5 import ingest_h5_features
    from tasks.ingest.labels import LabelSpec
    from tasks.ingest.npy import ingest_bag_files

    source, ing = config.ingest.source, config.ingest
    labels = _label_source(ing.labels)
    spec = labels if isinstance(labels, LabelSpec) else None if labels is None else LabelSpec(str(labels))
    if ing.kind == "h5":
        result = ingest_h5_features(str(config.store), source, None if spec is None else spec.file, name=config.name,
                                    slides=ing.slides, nonfinite=ing.nonfinite, keep_unlabelled=ing.unlabelled == "keep",
                                    client=client, **({} if spec is None else {
                                        "id_column": spec.id_column, "label_column": spec.label_column,
                                        "positive": spec.positive, "target": spec.target}))
    else:
        folder = Path(source)
        optional = {name: folder / name for name in ("inst_labels", "coords") if (folder / name).is_dir()}
        result = ingest_bag_files(str(config.store), folder / "features", name=config.name, labels_file=spec,
                                  labels_dir=folder / "labels" if spec is None and (folder / "labels").is_dir() else None,
                                  inst_labels_dir=optional.get("inst_labels"), coords_dir=optional.get("coords"),
                                  nonfinite=ing.nonfinite, keep_unlabelled=ing.unlabelled == "keep", client=client)
    return StageResult(key=config.name, path=str(config.store), reused=not result.added, info=result.to_json())


@task(name="list-inputs", task_run_name="list {config.ingest.kind} inputs in {config.ingest.source}", cache_policy=NO_CACHE,
      **RETRY_IF_TRANSIENT)
def list_inputs(config: PipelineConfig) -> IngestWork:
    """List and validate the slides/scans (labels, duplicates, the store's settings; fit the
    extractor once) and open the store: items already in it are not run again."""
    from tasks.ingest.ct import plan_ct
    from tasks.ingest.features import extractor_from_spec, make_extractor, trusted_imports
    from tasks.ingest.slide_io import SLIDE_PATTERNS
    from tasks.ingest.wsi import TilingParams, plan_slides

    ing, store = config.ingest, str(config.store)
    extractor = make_extractor(ing.extractor, **ing.extractor_params) if ing.extractor else None
    trusted = {*ing.trusted_imports, *trusted_imports(extractor)}  # the import paths a store's extractor may name
    if ing.kind == "wsi":
        tiling = TilingParams(tile_size=ing.tile_size, level=ing.level, magnification=ing.magnification, target_mpp=ing.target_mpp,
                              base_mpp=ing.base_mpp, reader=ing.reader, min_tissue=ing.min_tissue_fraction)
        plan = plan_slides(store, ing.source, labels_csv=_label_source(ing.labels), params=tiling, extractor=extractor,
                           qc_dir=Path(config.output_dir) / "qc", name=config.name, extractor_from=ing.extractor_from,
                           patterns=ing.patterns or SLIDE_PATTERNS, recursive=ing.recursive,
                           keep_unlabelled=ing.unlabelled == "keep", trusted=trusted)
    elif ing.kind == "ct":
        recorded, recorded_in = recorded_extractor(store, ing.extractor_from) if extractor is None else (None, "")
        if recorded is not None:  # the store's own, else a cohort to predict's training store's (also on a rerun)
            extractor = extractor_from_spec(recorded, source=recorded_in, trusted=trusted)
        plan = plan_ct(store, ing.source, labels_csv=getattr(ing.labels, "file", ing.labels), extractor=extractor, name=config.name,
                       keep_unlabelled=ing.unlabelled == "keep")
    else:
        raise ValueError(f"ingest.kind={ing.kind!r} has no per-item inputs")
    run = IngestRun(store, plan.spec, plan.items, skipped=plan.skipped)
    get_run_logger().info("%s inputs in %s: %d to ingest (%d of them already staged), %d already in %s, %d rejected",
                          ing.kind, ing.source, len(run.pending), len(run.pending) - len(run.to_run), len(run.already_done),
                          store, len(run.skipped))
    return IngestWork(run, plan.bag_writer)


@task(name="ingest-item", task_run_name="ingest {item.bag_id}", cache_policy=NO_CACHE, **RETRY_IF_TRANSIENT)
def ingest_item(store: str, item: IngestItem, bag_writer: BagWriter, client: Client, nonfinite: str = "reject") -> int:
    """Tile + featurise one slide/scan on the Dask cluster into its own staging group; returns its
    number of instances. Bad input fails this task only (and is not retried)."""
    return client.submit(stage_item, store, item, bag_writer, nonfinite, pure=False).result()


@task(name="finalise-store", task_run_name="finalise {config.store}", cache_policy=NO_CACHE)
def finalise_store(config: PipelineConfig, work: IngestWork, outcomes: dict[str, BaseException | None]) -> StageResult:
    """Commit the staged bags in item order (``bags/done`` last), write the ingest report, and
    list the inputs left out, and why (table artifact). Not retried: it holds the open ingest's
    state; if it fails, the staged bags stay and the next run commits them without recomputing."""
    run = work.run
    for item in run.to_run:
        if item.bag_id in outcomes:  # an item without an outcome stays staged or pending for a rerun
            error = outcomes[item.bag_id]
            run.record(item.bag_id, None if error is None else Skipped.from_error(error, item))
    result = run.finish()
    info = result.to_json()
    _report_left_out(config, info)
    return StageResult(key=config.name, path=str(config.store), reused=not result.added, info=info)


def _report_left_out(config: PipelineConfig, info: dict[str, Any]) -> None:
    """Every input an ingest left out (its report's ``info``), and why: a warning line each and the
    ``skipped-inputs`` table artifact; then the counts."""
    logger = get_run_logger()
    if info["skipped"]:
        create_table_artifact(info["skipped"], key=artifact_key("skipped-inputs", config.name),
                              description="Inputs left out of the cohort, and why")
        for line in left_out_lines([Skipped(**skipped) for skipped in info["skipped"]], info.get("report_path")):
            logger.warning("%s", line)
    logger.info("ingest: %d bags added (%d instances), %d already done, %d skipped", len(info["added"]),
                info["n_instances_added"], len(info["already_done"]), len(info["skipped"]))


def _label_source(labels: Any) -> Any:
    """A labels path as it is (the source's convention), or the LabelSpec of a ``labels`` section."""
    return labels.spec() if hasattr(labels, "spec") else labels


@task(name="ingest-table", task_run_name="ingest {config.ingest.kind} {config.ingest.source}", cache_policy=NO_CACHE,
      **RETRY_IF_TRANSIENT)
def ingest_table(config: PipelineConfig, scheduler_address: str | None = None) -> StageResult:
    """Load feature files into the store: a MIL feature table (CSV, Parquet, ``.npz``), a CLAM/TRIDENT
    ``.h5`` folder or a torchmil ``.npy`` folder; bags already there are skipped. The files of a
    folder are staged on the cluster at ``scheduler_address`` (one Dask task per file; in this
    process without one), a table here."""
    from tasks.ingest.tables import ingest_table as ingest_feature_table
    from tasks.ingest.tables import read_mil_csv, read_npz_table, read_parquet_table

    source, ing = config.ingest.source, config.ingest
    if ing.kind in ("h5", "npy"):
        if scheduler_address is None:
            return _ingest_files(config, None)
        with Client(scheduler_address) as client:
            return _ingest_files(config, client)
    readers = {".csv": read_mil_csv, ".parquet": read_parquet_table, ".npz": read_npz_table}
    suffix = source.suffix.lower()
    if suffix not in readers:
        raise ValueError(f"ingest.source {source}: feature tables must be .csv, .parquet or .npz")
    options = {} if ing.original_label_column is None else {"original_label_column": ing.original_label_column}
    if ing.columns is not None and suffix == ".parquet":  # a predicted cohort's table is read like the training one
        options |= ing.columns.reader_arguments()
    result = ingest_feature_table(str(config.store), readers[suffix](source, **options), name=config.name,
                                  nonfinite=config.ingest.nonfinite)
    return StageResult(key=config.name, path=str(config.store), reused=not result.added, info=result.to_json())


def ingest_cohort_items(config: PipelineConfig, scheduler_address: str) -> StageResult:
    """The ingest stage, called inside a flow: ``list-inputs`` → one ``ingest <bag id>`` task per
    slide/scan (concurrent on the flow's thread-pool task runner, each running its tiling and
    featurisation on the flow's Dask cluster) → ``finalise-store``. A progress artifact and log
    lines follow the items as they finish. Holds the store's writer lease throughout (a second
    run on the same store fails at once with :class:`tasks.lease.StoreLockedError`)."""
    with writer_lease(str(config.store), f"gpmil ingest {config.name!r} ({config.ingest.kind} from {config.ingest.source})"):
        result = _ingest_cohort_items(config, scheduler_address)
        if (Path(config.store) / "zarr.json").is_file():
            result.info["unconfirmed"] = _record_unconfirmed(str(config.store), result.info, config.ingest.source)
    if not result.info.get("added") and not result.info.get("already_done"):
        raise NothingIngestedError(_nothing_ingested(config, result.info))
    return result


UNCONFIRMED_SHOWN = 5
"""Bags named where a report or log lists the bags an ingest did not confirm (the rest counted)."""


def _record_unconfirmed(store: str, info: dict[str, Any], source: Any) -> dict[str, str]:
    """The store's bags this ingest did not confirm — gone from ``ingest.source``, or skipped there
    (a changed label or input, a file now unreadable) — with why, kept in the store's attribute
    ``unconfirmed_bags`` for the report: the store keeps them as first ingested, and the training
    and the report still use them."""
    confirmed = set(info.get("added", [])) | set(info.get("already_done", []))
    reasons = {s["bag_id"]: f"{s['error']}: {s['reason']}" for s in info.get("skipped", []) if s.get("bag_id")}
    elsewhere = set(ingested_from_elsewhere(store, source))  # another folder's bags: not this ingest's to confirm
    unconfirmed = {bag_id: reasons.get(bag_id, f"not in {source}") for bag_id in open_cohort(store).bag_ids
                   if bag_id not in confirmed and (bag_id in reasons or bag_id not in elsewhere)}
    zarr.open_group(store, mode="a", zarr_format=3).attrs["unconfirmed_bags"] = unconfirmed
    if unconfirmed:
        get_run_logger().warning("%d bag(s) of %s were not confirmed by this ingest and are still used as first ingested: %s",
                                 len(unconfirmed), store, _unconfirmed_text(unconfirmed))
    return unconfirmed


def _unconfirmed_text(unconfirmed: dict[str, str]) -> str:
    shown = "; ".join(f"{bag_id} ({reason[:160]})" for bag_id, reason in list(unconfirmed.items())[:UNCONFIRMED_SHOWN])
    more = f"; and {len(unconfirmed) - UNCONFIRMED_SHOWN} more" if len(unconfirmed) > UNCONFIRMED_SHOWN else ""
    return f"{shown}{more}. To drop or update them, ingest the cohort into a new store"


def _training_bags_in(cohort, training_store: str) -> list[str]:
    """Ids of ``cohort``'s bags that the training store holds from the same input (same id, same
    content stamp: the training folder ingested again, or a copy of it), in ``cohort``'s order;
    none when the training store is gone or has no stamps."""
    if not (Path(training_store) / "zarr.json").exists():
        return []
    trained = open_cohort(training_store)
    stamps = {bag_id: content for bag_id, stamp in zip(trained.bag_ids, trained.input_stamps)
              if (content := stamp_content(stamp))}
    return [bag_id for bag_id, stamp in zip(cohort.bag_ids, cohort.input_stamps)
            if bag_id in stamps and stamp_content(stamp) == stamps[bag_id]]


def _nothing_ingested(config: PipelineConfig, info: dict[str, Any]) -> str:
    """Why an ingest added no bag and found none done before, from its report's ``info``."""
    where = f"ingest.source {config.ingest.source}: no bag ingested into {config.store}"
    skipped = [Skipped(**s) for s in info.get("skipped", [])]
    if not skipped:
        return f"{where}: no {config.ingest.kind} input found there"
    return f"{where}: {summarise_left_out(f'{len(skipped)} input(s)', skipped)}; the ingest report {info.get('report_path')} lists each"


PROGRESS_EVERY_S = 2.0
"""Seconds between two updates of the ingest's progress artifact (the last is always shown)."""


def _ingest_cohort_items(config: PipelineConfig, scheduler_address: str) -> StageResult:
    from prefect.futures import as_completed

    if config.ingest.kind in ("features", "h5", "npy"):
        result = ingest_table(config, scheduler_address)
        _report_left_out(config, result.info)
        return result
    logger = get_run_logger()
    work = list_inputs(config)
    todo = work.run.to_run
    progress = create_progress_artifact(0.0, key=artifact_key("ingest", config.name), description=f"{config.ingest.kind} items ingested")
    outcomes: dict[str, BaseException | None] = {}
    shown = time.monotonic()
    with Client(scheduler_address) as client:
        futures = {ingest_item.submit(work.run.store, item, work.bag_writer, client, config.ingest.nonfinite): item for item in todo}
        for done, future in enumerate(as_completed(list(futures)), start=1):
            bag_id = futures[future].bag_id
            outcome = future.result(raise_on_failure=False)  # the instance count, or the task's exception
            failure = outcomes[bag_id] = outcome if isinstance(outcome, BaseException) else None
            if time.monotonic() - shown >= PROGRESS_EVERY_S:  # a call to the server each: ~80 ms, 13 min over 10,000 slides
                update_progress_artifact(progress, 100.0 * done / max(len(todo), 1))
                shown = time.monotonic()
            logger.info("ingest %s %s%s", progress_bar(done, len(todo)), bag_id, f" failed: {failure}" if failure else "")
    result = finalise_store(config, work, outcomes)
    update_progress_artifact(progress, 100.0, description=f"{len(result.info['added'])} bags added, {len(result.info['already_done'])} "
                                                          f"already in the store, {len(result.info['skipped'])} skipped")
    return result


@dataclass(frozen=True)
class TrainedModel:
    """What ``model.npz`` holds: the fitted estimator and the feature scaling it was trained with
    (a GP model's also in its ``feature_mean_`` / ``feature_scale_``; ``predict_cohort`` applies it once)."""

    estimator: Any
    scaling: FeatureScaling | None


MODEL_FILE = "model.npz"
OBJECTIVE_FIGURE = "objective.png"  # the training objective per iteration, beside model.json and the report
persist.allow_types(TrainedModel)


def save_model(model_dir: str | Path, trained: TrainedModel) -> Path:
    """Arrays + JSON (:mod:`mil_core.persist`), written atomically; never a pickle."""
    return persist.save(trained, Path(model_dir) / MODEL_FILE)


def load_model(model_dir: str | Path) -> TrainedModel:
    """The model saved by :func:`save_model`. A ``model.pkl`` of an older gpmil is refused, not
    unpickled: a pickle runs code when loaded, and model folders are shared between teams."""
    model_dir = Path(model_dir)
    if not (model_dir / MODEL_FILE).exists() and (model_dir / "model.pkl").exists():
        raise persist.UnsafeFileError(f"{model_dir / 'model.pkl'}: a pickled model from an older gpmil; pickles are never "
                                      "loaded (they can run code). Retrain to write model.npz.")
    trained = persist.load(model_dir / MODEL_FILE)
    if not isinstance(trained, TrainedModel):
        raise persist.UnsafeFileError(f"{model_dir / MODEL_FILE}: holds a {type(trained).__name__}, not a trained model")
    return trained


@task(name="predict-cohort", task_run_name="predict {store} with {model_dir}", cache_policy=NO_CACHE)
def predict(config: PipelineConfig, store: str, model_dir: str, prediction_key: str, scheduler_address: str) -> StageResult:
    """Instance and bag probabilities with std for every bag of ``store``, written to the store
    under ``predictions/<key>``; reused when that group is complete."""
    logger = get_run_logger()
    root = zarr.open_group(store, mode="r", zarr_format=3)
    name = f"predictions/{prediction_key}"
    if name in root and root[name].attrs.get("complete"):
        logger.info("predictions %s already complete in %s: reusing", prediction_key, store)
        return StageResult(prediction_key, f"{store}/{name}", True, {"n_bags": open_cohort(store).n_bags})
    _check_same_features(store, model_dir)
    trained = load_model(model_dir)
    model = trained.estimator
    instance_kwargs, bag_kwargs = prediction_kwargs(model, config.prediction.method, config.prediction.rule)
    with Client(scheduler_address) as client:
        path = predict_cohort(model, store, client, run=prediction_key, partition_bytes=int(config.training.partition_mib * 2**20),
                              device=config.training.device, gpu_namespace=config.training.gpu_namespace,
                              compute_dtype=config.training.compute_dtype,
                              scaling=trained.scaling, instance_kwargs=instance_kwargs,
                              bag_kwargs=bag_kwargs, provenance={"model_key": Path(model_dir).name, "model_dir": str(model_dir),
                                                                 "prediction": config.prediction_settings(),
                                                                 "bag_kwargs": bag_kwargs, "instance_kwargs": instance_kwargs})
    return StageResult(prediction_key, path, False, {"n_bags": open_cohort(store).n_bags})


def _check_same_features(store: str, model_dir: str) -> None:
    """A cohort must be featurised like the model's training cohort (same extractor, version and
    fitted parameters), else its predictions are meaningless."""
    trained_on = json.loads((Path(model_dir) / "model.json").read_text())
    if "feature_extractor" not in trained_on:
        return
    attrs = open_cohort(store).attrs
    columns, given = trained_on.get("feature_columns"), attrs.get("feature_columns")
    if columns and given and columns != given:  # tables of the same width whose columns differ: features that do not compare
        raise CohortError(f"{store}'s features are other table columns than those the model {model_dir} was trained on "
                         f"({column_difference(given, columns, 'here', 'in ' + trained_on['store'])}): read the table "
                         "with the training table's feature columns (ingest.columns.features)")
    expected, actual = trained_on["feature_extractor"], attrs.get("feature_extractor")
    if actual != expected:
        def describe(spec):
            return "no recorded extractor" if spec is None else f"{spec['name']} v{spec['version']}"

        detail = "fitted with other parameters" if describe(actual) == describe(expected) else f"not {describe(expected)}"
        raise CohortError(f"{store} was featurised with {describe(actual)} ({detail}) but the model {model_dir} was trained on "
                         f"features of {trained_on['store']}: ingest the cohort with ingest.extractor_from: {trained_on['store']}")


def output_url(config: PipelineConfig, path: Path) -> str:
    """The URL of a file under ``output_dir``: below ``output_url`` where the folder is served,
    else a ``file://`` URI."""
    from urllib.parse import quote

    if config.output_url:
        return f"{config.output_url.rstrip('/')}/{quote(path.resolve().relative_to(Path(config.output_dir).resolve()).as_posix())}"
    return path.resolve().as_uri()


def _figure_artifacts(config: PipelineConfig, figures: list[Path], report_md: Path) -> list[str]:
    """One image artifact per figure and a link artifact to the report file; the Markdown image
    lines for the UI's report (URLs: the UI cannot read files next to the report)."""
    lines = []
    for figure in figures:
        url = output_url(config, figure)
        where = figure.relative_to(report_md.parent).with_suffix("")
        create_image_artifact(url, key=artifact_key("figure", config.name, *where.parts), description=str(where))
        lines.append(f"![{figure.stem}]({url})")
    create_link_artifact(output_url(config, report_md), link_text=str(report_md), key=artifact_key("report-file", config.name),
                         description="The report, with its tables and figures beside it")
    return lines


def _slide_background(source: str, bag_id: str, tiling: dict[str, Any] | None, logger: Any,
                      slides: dict[str, str] | None = None) -> tuple[np.ndarray | None, float | None]:
    """The slide thumbnail under a heatmap and its downsample from level 0, or none (feature
    cohorts without their slides; a slide moved or unreadable since ingest: the heatmap is then drawn
    without it, and the log says why). ``slides``: bag id → slide file of a feature cohort whose
    slides are known (``tiling.slides_dir``)."""
    from tasks.ingest.errors import IngestError
    from tasks.ingest.slide_io import open_slide
    from tasks.ingest.wsi import heatmap_background

    if not tiling:
        return None, None
    if "slides_dir" in tiling:
        if not slides or bag_id not in slides:
            logger.info("no slide for %s in %s: heatmap without a thumbnail", bag_id, tiling["slides_dir"])
            return None, None
        source = slides[bag_id]
    if not Path(source).exists():  # a file, or a DICOM-WSI folder
        logger.warning("slide %s not found: heatmap without the slide thumbnail", source)
        return None, None
    try:
        if "slides_dir" in tiling:
            with open_slide(source) as slide:
                thumbnail, downsample = slide.thumbnail(1024)
                return thumbnail, downsample
        thumbnail, downsample, _ = heatmap_background(source, tiling)
        return thumbnail, downsample
    except IngestError as error:
        logger.warning("heatmap without the slide thumbnail: %s", error)
        return None, None


def _ct_series_by_uid(sources: Any, logger: Any, moved_to: Path | None = None) -> dict[str, Any]:
    """SeriesInstanceUID → its :class:`tasks.ingest.ct.CTSeries` (files in spatial order, for the
    slice images of the strips), reading the headers of each source folder once. Where folders are
    gone, the run's ``ingest.source`` (``moved_to``: the cohort moved since its ingest) is read
    instead; a strip takes a series' slices by the SOPInstanceUIDs stored at ingest, so only the
    same slices are used. Empty where neither is there (findings still name slices by UID)."""
    from tasks.ingest.ct import scan_dicom_dir

    folders = sorted(set(map(str, sources)))
    gone = [folder for folder in folders if not Path(folder).is_dir()]
    if gone and moved_to is not None and Path(moved_to).is_dir():
        logger.info("%d CT folder(s) not found where they were ingested (first: %s): reading the series under %s",
                    len(gone), gone[0], moved_to)
        folders = [folder for folder in folders if folder not in gone] + [str(moved_to)]
    elif gone:
        logger.warning("CT folder %s not found: no slice images in the strips (findings by SOPInstanceUID come from the store)",
                       gone[0])
    outermost: list[Path] = []
    for folder in sorted(map(Path, folders), key=lambda path: path.parts):  # a folder's sub-folders follow it
        if not (outermost and folder.is_relative_to(outermost[-1])):  # one under another is read with it
            outermost.append(folder)
    found: dict[str, Any] = {}
    for folder in outermost:
        if folder.is_dir():
            for s in scan_dicom_dir(folder)[0]:
                if s.series_uid not in found or len(s.files) > len(found[s.series_uid].files):
                    found[s.series_uid] = s  # a series in parts is whole where a folder holds all of them
    return found


def _ct_strip_slices(cohort: Any, found: Any, rows: slice, scores: np.ndarray, coords: np.ndarray
                     ) -> tuple[list[str], np.ndarray, list[str]] | None:
    """Files, bag-row order and SOPInstanceUIDs of the slices a CT strip shows, the files found in
    the series by the UIDs stored at ingest; None when the series folder is gone or lacks a slice."""
    if found is None or cohort.instance_id_kind != "SOPInstanceUID":
        return None
    order = np.argsort(coords[rows, 0])[report.strip_slices(scores[rows])]
    uids = cohort.instance_ids(rows)[order].tolist()
    files = dict(zip(found.sop_uids, found.files))
    return ([files[uid] for uid in uids], order, uids) if all(uid in files for uid in uids) else None


def _slides_by_stem(tiling: dict[str, Any] | None) -> dict[str, str] | None:
    """Slide file by stem under a feature cohort's ``slides_dir`` (None without one)."""
    from tasks.ingest.slide_io import find_slides, slide_id

    if not tiling or "slides_dir" not in tiling or not Path(tiling["slides_dir"]).is_dir():
        return None
    return {slide_id(path): str(path) for path in find_slides(tiling["slides_dir"])[0]}


def _slides_as_ingested(cohort: Any, bags: Any, folder: Path | None) -> dict[str, str | None]:
    """For the ``bags`` with an input stamp whose stored slide path no longer holds the slide they
    were tiled from: bag id → the slide of that name under ``folder`` (the run's
    ``ingest.source``) whose files match the stamp (the same slide, moved since its ingest), or
    None (the slide changed or is gone: a heatmap of the stored tiles goes without a thumbnail
    rather than over another image). Bags whose stored path still matches are not listed."""
    from tasks.ingest.slide_io import find_slides, slide_files, slide_id

    stamps = cohort.input_stamps
    changed = [b for b in bags if stamps[b] and file_change(slide_files(cohort.sources[b]), stamps[b]) is not None]
    if not changed:
        return {}
    found = ({slide_id(path): path for path in find_slides(folder)[0]} if folder is not None and Path(folder).is_dir()
             else {})
    chosen: dict[str, str | None] = {}
    for b in changed:
        path = found.get(cohort.bag_ids[b])
        chosen[cohort.bag_ids[b]] = (str(path) if path is not None and file_change(slide_files(path), stamps[b]) is None
                                     else None)
    return chosen


REPORT_MANIFEST = "report-settings.json"
"""Written last into a report folder: the settings it was written with and every file it wrote."""
_REPORT_OUTPUTS = ("report.md", "bag_predictions.csv", "bag_predictions.parquet", "instance_predictions.parquet",
                   "instance_predictions.csv", "metrics.json", "calibration.csv", "roc.png", "uncertain_bags.csv",
                   "objective.png", "geojson", "heatmaps", "slices", "strips")


def _labels_digest(cohort: Cohort) -> str:
    """What the report reads of the store's labels (bag labels, original labels): a store relabelled
    since a report was written gets a new one."""
    digest = hashlib.sha256(np.asarray(cohort.bag_labels).tobytes())
    digest.update("\0".join(map(str, cohort.original_labels)).encode())
    return digest.hexdigest()[:16]


def _report_complete(out: Path, settings: str) -> bool:
    """Whether ``out`` holds a report written with ``settings`` and still every file it wrote (a
    deleted table or figure is written again, not reported as there)."""
    try:
        manifest = json.loads((out / REPORT_MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (isinstance(manifest, dict) and manifest.get("settings") == settings
            and all((out / name).is_file() for name in manifest.get("files", ["report.md"])))


STAGING = ".writing"
"""The prefix of the folder inside a report folder where a run writes a new report before it
replaces the old one (``.writing-<run>``: a writer frozen past its lease never writes into, or
removes, the folder of the run that took the lease over)."""


def _staged_report_folder(out: Path, staging: Path) -> Path:
    """``staging``, an empty folder inside ``out`` (its file system: a report folder may be a mount)
    to write a new report into; killed runs' are removed (the report folder's writer lease makes
    this run the only writer, and only report files are ever in them)."""
    ensure_still_held(out)  # a run frozen since it took the lease must not remove the new holder's
    for left in out.glob(f"{STAGING}*"):
        shutil.rmtree(left, ignore_errors=True)
    staging.mkdir(parents=True)
    return staging


def _replace_report(staging: Path, out: Path) -> None:
    """Put the report written in ``staging`` in place of ``out``'s: the earlier report stays whole
    while the new one is written, then its files (manifest first) give way to the new ones, renamed
    into place, the manifest last (a run killed in that moment leaves no manifest: the next run
    writes the report again). No earlier report file stays beside the new one (figures of bags no
    longer at the top, metrics of a cohort no longer labelled); files no report writes (a user's
    notes) are not touched. A run whose lease on ``out`` was taken over stops first."""
    ensure_still_held(out)
    (out / REPORT_MANIFEST).unlink(missing_ok=True)
    for name in _REPORT_OUTPUTS:
        old = out / name
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink(missing_ok=True)
    for entry in sorted(staging.iterdir(), key=lambda e: e.name == REPORT_MANIFEST):
        entry.rename(out / entry.name)
    staging.rmdir()


@task(name="keep-newest-runs", task_run_name="keep the newest {config.keep_runs} runs", cache_policy=NO_CACHE)
def keep_newest_runs(config: PipelineConfig, record: str) -> list[str]:
    """``keep_runs``: remove what only this configuration's runs older than its newest
    ``keep_runs`` results use, never the run recorded at ``record`` (:mod:`tasks.retention`); say
    what went. A removal that fails is logged and left for a later run: the run's own outputs are
    complete, and its state stays Completed."""
    logger = get_run_logger()
    stores = [config.store, *([config.prediction.store] if config.prediction.store else [])]
    removed = retention.prune_runs(config.output_dir, config.name, stores, config.keep_runs, Path(record))
    if removed:
        shown = ", ".join(removed[:8]) + (f" and {len(removed) - 8} more" if len(removed) > 8 else "")
        logger.info("keep_runs=%d: removed %d outputs of older runs: %s", config.keep_runs, len(removed), shown)
    return removed


@task(name="evaluate-and-report", task_run_name="report {prediction_key}", cache_policy=NO_CACHE, **RETRY_IF_TRANSIENT)
def write_report(config: PipelineConfig, store: str, model_dir: str, prediction_key: str) -> StageResult:
    """Per-bag tables (CSV, Parquet), evaluation where labels exist, heatmaps / slice plots, a
    Markdown report, and the matching Prefect artifacts. Holds the report folder's writer lease
    (:mod:`tasks.lease`): a second run of the same configuration, past the stages the store's
    lease guards, is refused here (it deleted the first run's files as that one wrote them)."""
    out = Path(config.output_dir) / "predictions" / prediction_key
    staging = out / f"{STAGING}-{os.getpid()}-{secrets.token_hex(4)}"
    with writer_lease(out, f"report {prediction_key}"):
        try:
            return _write_report(config, store, model_dir, prediction_key, out, staging)
        finally:  # a report that failed half-way leaves the earlier one, not its own pieces
            shutil.rmtree(staging, ignore_errors=True)


def _model_figure(path: Path, logger: Any) -> bytes | None:
    """The bytes of a figure in a model folder, not read through a link (a link planted in a
    shared model folder would copy any file the run can read into the report) nor from anything
    but a regular file (a FIFO would block the report); ``None`` when there is none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # a FIFO would block the open
    except FileNotFoundError:
        return None
    except OSError as error:  # ELOOP: a link
        logger.warning("%s is not copied into the report: %s (a model folder's figure is a file, not a link)", path, error.strerror)
        return None
    with os.fdopen(fd, "rb") as file:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            logger.warning("%s is not copied into the report: not a regular file", path)
            return None
        return file.read()


def _write_report(config: PipelineConfig, store: str, model_dir: str, prediction_key: str, out: Path,
                  staging: Path) -> StageResult:
    logger = get_run_logger()
    cohort = open_cohort(store)
    settings = json.dumps({**config.prediction.model_dump(mode="json"), "name": config.name, "model_dir": str(model_dir),
                           "store": str(Path(store).resolve()),  # the store predicted, not the configured prediction.store (often unset)
                           "labels": _labels_digest(cohort),  # labels that arrived since: metrics now
                           "unconfirmed_bags": cohort.attrs.get("unconfirmed_bags") or {}},  # its warnings follow the last ingest
                          sort_keys=True)
    if _report_complete(out, settings):
        logger.info("report for %s already written with these settings: reusing %s", prediction_key, out / "report.md")
        create_link_artifact(output_url(config, out / "report.md"), link_text=str(out / "report.md"),
                             key=artifact_key("report-file", config.name), description="The report (reused: nothing changed since it was written)")
        metrics = json.loads((out / "metrics.json").read_text()) if (out / "metrics.json").exists() else {}
        metrics.pop("threshold", None)  # the file says it beside the metrics; the stage's result holds the metrics
        return StageResult(prediction_key, str(out / "report.md"), True, metrics)
    final, out = out, _staged_report_folder(out, staging)  # written inside, then put in place
    table = report.bag_table(store, prediction_key, threshold=config.prediction.threshold, top_k=config.prediction.top_k)
    report.write_tables(table, out)
    predictions = read_predictions(store, prediction_key)
    root = zarr.open_group(store, mode="r", zarr_format=3)
    instance_labels = root["instances/label"][: cohort.n_instances].astype(int)
    coords = root["instances/coords"][: cohort.n_instances]

    trained_on_info = json.loads((Path(model_dir) / "model.json").read_text())
    trained_on = trained_on_info["store"]
    in_sample = Path(trained_on).resolve() == Path(store).resolve()
    objective = trained_on_info.get("objective_name", "ELBO")  # model.json written before the name was kept: a variational fit
    written = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    sections = [f"# gpmil report: {config.name}", "", f"Written {written}. Cohort `{store}` ({cohort.n_bags} bags, {cohort.n_instances} "
                f"instances); model `{model_dir}` ({trained_on_info['model']}, {trained_on_info['n_iter']} iterations; training objective: "
                f"{objective}, `{OBJECTIVE_FIGURE}`).", ""]
    if chosen := report.choices_text(trained_on_info.get("choices", {}), trained_on_info.get("chosen_sweeps")):
        sections += [chosen, ""]
    made = dict(root[f"predictions/{prediction_key}"].attrs)
    if scored := report.scoring_text(made.get("bag_kwargs"), made.get("instance_kwargs"), trained_on_info.get("choices", {})):
        sections += [scored, ""]
    shared = [] if in_sample else _training_bags_in(cohort, trained_on)
    if in_sample:
        sections += ["**These predictions are on the cohort the model was trained on: the metrics are in-sample "
                     "(optimistic). Predict a held-out cohort (`prediction.store`) for an honest estimate.**", ""]
    elif shared:
        logger.warning("%d of the %d bags predicted were in the training cohort %s (same id, same input)",
                       len(shared), cohort.n_bags, trained_on)
        sections += [f"**{len(shared)} of these {cohort.n_bags} bags are bags the model was trained on (same id and same "
                     f"input as in `{trained_on}`, e.g. `{shared[0]}`): the metrics are partly in-sample (optimistic), "
                     "not held out.**", ""]
    else:
        sections += [f"The model was trained on `{trained_on}`; these predictions and metrics are on a held-out cohort.", ""]
    metrics: dict[str, Any] = {}
    figures: list[Path] = []
    if report.can_evaluate(table):
        evaluation = report.evaluate(table, threshold=config.prediction.threshold, instance_labels=instance_labels,
                                     instance_proba=predictions.get("instances/proba"))
        metrics = evaluation.metrics
        (out / "metrics.json").write_text(json.dumps({**metrics, "threshold": config.prediction.threshold}, indent=1))
        evaluation.calibration.to_csv(out / "calibration.csv", index=False)
        figures.append(report.plot_roc(evaluation, out / "roc.png"))
        sections += ["## Metrics", "", f"Accuracy, F1 and the confusion matrix at threshold {config.prediction.threshold:g} "
                     "(`prediction.threshold`); AUC, Brier score and ECE do not depend on it.", "",
                     report.markdown_table(_metrics_frame(metrics)), "", "Confusion matrix (rows: true 0/1; columns: predicted 0/1): "
                     f"`{evaluation.confusion.tolist()}`", "", "## Calibration", "", report.markdown_table(evaluation.calibration), ""]
        create_table_artifact([{"metric": k, "value": v} for k, v in metrics.items()], key=artifact_key("metrics", config.name),
                              description="Bag (and instance) metrics")
    else:
        sections += ["No labelled bags of both classes: no evaluation.", ""]
    if (figure := _model_figure(Path(model_dir) / OBJECTIVE_FIGURE, logger)) is not None:  # beside the report: its links stay relative
        write_whole(out / OBJECTIVE_FIGURE, figure)
        figures.insert(0, out / OBJECTIVE_FIGURE)

    not_predicted = dict(made.get("not_predicted", {}))
    spread = diagnostics.constant_predictions(table["probability"]) or diagnostics.one_sided_predictions(
        table["probability"], table["label"], config.prediction.threshold)
    warnings = trained_on_info.get("warnings", []) + [m for m in [spread] if m]
    warnings += [f"bag {bag_id!r} not predicted: {reason}" for bag_id, reason in not_predicted.items()]
    if unconfirmed := dict(cohort.attrs.get("unconfirmed_bags") or {}):
        warnings.append(f"{len(unconfirmed)} bag(s) of this cohort were not confirmed by its last ingest and are kept, and "
                        f"reported{', and trained on' if in_sample else ''}, as first ingested: {_unconfirmed_text(unconfirmed)}")
    if warnings:
        for message in warnings:
            logger.warning(message)
        sections += ["## Warnings", "", *[f"- {html.escape(m, quote=False)}" for m in warnings], ""]  # bag ids are text

    with_std = table[table["std"].notna()]
    if len(with_std):
        uncertain = with_std.sort_values("std", ascending=False).head(config.prediction.n_uncertain)
        review = ["bag_id", "probability", "std", "label"] + (["original_label"] if (table["original_label"] != "").any() else [])
        report.write_csv(uncertain[review], out / "uncertain_bags.csv")
        sections += ["## Bags to review (highest predictive std)", "", report.markdown_table(uncertain[review]), ""]
    else:
        sections += ["## Bags to review", "", f"{trained_on_info['model']} gives no predictive std: no bags to review by it.", ""]

    scores, kind = report.instance_scores(predictions)
    instances = report.instance_table(store, prediction_key)
    series = (_ct_series_by_uid(table["source"], logger, config.ingest.source if config.ingest.kind == "ct" else None)
              if cohort.attrs.get("coords_meaning") == "slice_index" else {})
    instances.to_parquet(out / "instance_predictions.parquet", index=False)
    if len(instances) <= 1_000_000:
        report.write_csv(instances, out / "instance_predictions.csv")
    sections += [f"Per-instance table: `instance_predictions.parquet` ({len(instances)} rows: bag, instance, "
                 f"{', '.join(c for c in instances.columns if c not in ('bag_id', 'instance', kind, 'std'))}, {kind}, std).", ""]
    meaning = str(cohort.attrs.get("coords_meaning", ""))
    cohort_side = report.cohort_tile_side(coords, np.asarray(cohort.offsets), meaning)  # one patch size per cohort
    if cohort_side is None and not in_sample and _same_coordinates(trained_on, meaning):  # bags of one tile: the training cohort's
        training = open_cohort(trained_on)
        cohort_side = report.cohort_tile_side(zarr.open_group(str(trained_on), mode="r", zarr_format=3)["instances/coords"][: training.n_instances],
                                              np.asarray(training.offsets), meaning)

    @functools.cache  # the GeoJSON and the heatmap of a bag: its file read once
    def patch_side(b: int) -> float | None:  # a .h5 file that says its patch size (TRIDENT, CLAM), else the cohort's
        return (h5_patch_side(table.at[b, "source"]) if meaning == H5_COORDS_MEANING else None) or cohort_side

    if report.in_level0_pixels(meaning):
        for b in range(cohort.n_bags):  # one QuPath-importable GeoJSON per slide, tiles in level-0 pixels
            rows = cohort.bag_slice(b)
            xy, side = report.level0_tiles(coords[rows], meaning, patch_side(b))
            report.write_geojson(report.tile_geojson(xy, side, scores[rows], predictions["instances/std"][rows], kind=kind,
                                                     bag_id=table.at[b, "bag_id"]),
                                 bag_file(out / "geojson", table.at[b, "bag_id"], ".geojson"))
        sections += ["Tiles per slide for QuPath (File → Import objects): `geojson/<slide>.geojson`, level-0 pixels, "
                     f"with {kind} and std as measurements.", ""]

    top = report.most_likely_positive(table, config.prediction.n_heatmaps)  # a bag not predicted has no scores to draw
    slides = _slides_by_stem(cohort.attrs.get("tiling"))
    as_ingested = {} if slides is not None or config.ingest.kind != "wsi" else _slides_as_ingested(
        cohort, [int(b) for b in top.index], config.ingest.source)
    for b in top.index:
        rows = cohort.bag_slice(int(b))
        bag_id = table.at[b, "bag_id"]
        if meaning != "slice_index" and coords.shape[1] < 2:  # rows without a position (a table or .h5 without them): no figure
            continue
        if meaning != "slice_index":
            xy, side = report.level0_tiles(coords[rows], meaning, patch_side(int(b)))
            source = as_ingested.get(bag_id, table.at[b, "source"])
            if source is None:
                logger.warning("slide %s changed or is gone since its ingest: heatmap without the slide thumbnail",
                               table.at[b, "source"])
                thumbnail, downsample = None, None
            else:
                thumbnail, downsample = _slide_background(source, bag_id, cohort.attrs.get("tiling"), logger, slides)
            figures.append(report.plot_wsi_heatmap(xy, side, scores[rows], bag_file(out / "heatmaps", bag_id, ".png"), kind=kind,
                                                   thumbnail=thumbnail, thumb_downsample=downsample,
                                                   title=f"{bag_id}: p = {table.at[b, 'probability']:.2f}"))
        else:
            strip = _ct_strip_slices(cohort, series.get(bag_id), rows, scores, coords)
            if strip is not None:
                from tasks.ingest.ct import load_windowed_slices

                files, order, uids = strip
                figures.append(report.plot_ct_strip(
                    load_windowed_slices(files), coords[rows, 0][order],
                    scores[rows][order], predictions["instances/std"][rows][order], bag_file(out / "strips", bag_id, ".png"),
                    sop_uids=uids, kind=kind, title=f"{bag_id}: p = {table.at[b, 'probability']:.2f}"))
            figures.append(report.plot_ct_slices(coords[rows, 0], scores[rows], predictions["instances/std"][rows],
                                                 bag_file(out / "slices", bag_id, ".png"), kind=kind, instance_labels=instance_labels[rows],
                                                 title=f"{bag_id}: p = {table.at[b, 'probability']:.2f}"))
    sections += ["## Figures", ""]
    (out / "report.md").write_text("\n".join(sections + [f"![{f.stem}]({f.relative_to(out).as_posix()})" for f in figures]))
    written = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    (out / REPORT_MANIFEST).write_text(json.dumps({"settings": settings, "files": written}))  # last: marks it complete
    _replace_report(out, final)
    figures, out = [final / f.relative_to(out) for f in figures], final
    create_markdown_artifact("\n".join(sections + _figure_artifacts(config, figures, out / "report.md")),
                             key=artifact_key("report", config.name), description="Evaluation report with figures")
    create_table_artifact(table.drop(columns=["most_suspicious"]).head(200).to_dict(orient="records"),
                          key=artifact_key("bag-predictions", config.name), description="Per-bag predictions (first 200 bags)")
    logger.info("report written to %s", out / "report.md")
    return StageResult(prediction_key, str(out / "report.md"), False, metrics)


def _same_coordinates(store: str, meaning: str) -> bool:
    """Whether ``store`` exists and holds coordinates of the kind ``meaning`` names (level-0 pixels
    or slide tiles), so that its patch size is this cohort's (a new cohort of the same pipeline)."""
    try:
        return report.in_level0_pixels(meaning) and open_cohort(store).attrs.get("coords_meaning") == meaning
    except Exception:  # moved or gone since training
        return False


def _metrics_frame(metrics: dict[str, Any]):
    """The metrics as the report's table shows them: counts as integers (``n_bags | 16``, not 16.000)."""
    import pandas as pd

    return pd.DataFrame({"metric": list(metrics),
                         "value": pd.Series([v if isinstance(v, int) else float(v) for v in metrics.values()], dtype=object)})
