"""A run's inputs checked before anything starts (no Prefect server, no cluster, no retries):
every file and folder the stage reads exists and is of the right kind, the folders it writes into
are not files, a model folder is complete, and ``evaluate``'s key names a complete prediction of
its store by its model.

The CLI calls :func:`check_inputs` right after loading the configuration; each flow calls it
again first thing, so a deployment's run with a missing input fails at once too. Problems raise
:class:`~flows.config.ConfigError` naming the field and the path.
"""

import difflib
import json
import tempfile
from pathlib import Path
from typing import Any, Literal

from flows.config import ConfigError, IngestConfig, LabelsConfig, PipelineConfig
from tasks.retention import LATEST_MODEL, RUNS, newest_model_dir

__all__ = ["check_inputs", "resolved_model_dir", "Stage"]

Stage = Literal["run", "ingest", "train", "predict", "evaluate"]


def _problem(field: str, path: Path | str | None, kind: Literal["file", "dir", "any"]) -> str | None:
    if path is None:
        return None
    path = Path(path)
    if not path.exists():
        return f"{field}: {path} does not exist"
    if kind == "file" and not path.is_file():
        return f"{field}: {path} is not a file"
    if kind == "dir" and not path.is_dir():
        return f"{field}: {path} is not a folder"
    return None


def _extractor_problem(ing: IngestConfig) -> str | None:
    """Why the configured feature extractor cannot be built (a misspelt parameter, a missing module
    or weights file, weights of another shape): at once, not after Prefect and the cluster started
    and the first slide's task failed with a traceback."""
    from tasks.ingest.features import make_extractor

    try:
        extractor = make_extractor(ing.extractor, **ing.extractor_params)
        if callable(check := getattr(extractor, "check", None)):  # a lazily built module (torch): built now
            check()
    except Exception as error:  # whatever the user's module raises
        return f"ingest.extractor_params: {ing.extractor} cannot be built: {type(error).__name__}: {error}"
    return None


def _table_columns_problem(path: Path | str | None, ing: IngestConfig) -> str | None:
    """The feature table at ``path`` lacks a column the config names (``ingest.original_label_column``,
    ``ingest.columns``): read from its header only (a Parquet schema, a CSV's first row)."""
    named = ([] if ing.columns is None else [("ingest.columns", c) for c in ing.columns.named()]) + (
        [] if ing.original_label_column is None else [("ingest.original_label_column", ing.original_label_column)])
    if not named or path is None or not Path(path).is_file():
        return None
    path = Path(path)
    try:
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            columns: list[str | int] = list(pq.read_schema(path).names)
        elif path.suffix.lower() == ".csv":
            import pandas as pd

            columns = list(range(2, pd.read_csv(path, header=None, nrows=1).shape[1]))  # 0, 1: bag label, bag id
        else:
            return f"{named[0][0]}: {path} is not a .parquet or .csv table (an .npz names its arrays)"
    except Exception as error:  # the ingest names the unreadable file with the full reason
        return f"{named[0][0]}: cannot read the columns of {path}: {type(error).__name__}: {error}"
    absent = [(field, column) for field, column in named if column not in columns or isinstance(column, bool)]
    if absent:
        shown = ", ".join(map(str, columns[:20])) + (", …" if len(columns) > 20 else "")
        field = absent[0][0]
        missing = ", ".join(repr(column) for f, column in absent if f == field)
        return f"{field}: {path} has no column {missing} (its columns: {shown})"
    return None


def _dask_config_problem(path: Path | None) -> str | None:
    """A ``dask.config_file`` that is no Dask configuration (YAML that is not a mapping, or not
    YAML): read now, not as the cluster starts."""
    if path is None or not Path(path).is_file():
        return None  # a missing file is reported with the paths
    from tasks.cluster import read_dask_config

    try:
        read_dask_config(path)
    except Exception as error:
        return f"dask.config_file: {error}" if isinstance(error, ValueError) and str(path) in str(error) else (
            f"dask.config_file: {path} is not a Dask configuration: {type(error).__name__}: {error}")
    return None


def _jobqueue_profile_problem(dask_section: Any) -> str | None:
    """``cluster_kwargs.config_name`` of a dask-jobqueue cluster names a profile under ``jobqueue``
    in ``dask.config_file`` or dask-jobqueue's own: a misspelt one started the cluster, and then
    failed with a bare ``KeyError``."""
    name = dask_section.cluster_kwargs.get("config_name")
    if name is None or not str(dask_section.cluster_class or "").startswith("dask_jobqueue"):
        return None
    import dask

    from tasks.cluster import dotted, import_cluster_class, read_dask_config

    import_cluster_class(dask_section.cluster_class)  # dask-jobqueue's own profiles join the configuration
    file = dask_section.config_file
    with dask.config.set(dotted(read_dask_config(file) if file is not None and Path(file).is_file() else {})):
        profiles = sorted(dask.config.get("jobqueue", default={}) or {})
    if name in profiles:
        return None
    near = difflib.get_close_matches(str(name), profiles, n=1)
    return (f"dask.cluster_kwargs.config_name: no profile {name!r} under jobqueue in {file or 'the Dask configuration'}"
            f"{f'; did you mean {near[0]!r}?' if near else ''} (profiles: {', '.join(profiles)})")


def _trained_on(model_dir: Path | str | None) -> str | None:
    """The training store a model folder's ``model.json`` names (None where unreadable: reported
    by :func:`_model_dir_problem`)."""
    meta_path = None if model_dir is None else Path(model_dir) / "model.json"
    if meta_path is None or not meta_path.is_file():
        return None
    try:
        store = json.loads(meta_path.read_text()).get("store")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
        return None
    return str(store) if store else None


def _new_cohort_problem(ing: IngestConfig, source: str, model_dir: Path | str | None) -> str | None:
    """A new cohort (``predict --source``) the model cannot predict, found before its ingest: slides
    or scans whose features would come from a training store that is gone, or feature files
    (``.h5``, ``.npy``) of another width than the training store's (found after a whole ingest)."""
    trained_on = _trained_on(model_dir)
    if trained_on is None:
        return None
    if not (Path(trained_on) / "zarr.json").is_file():
        if ing.kind in ("wsi", "ct"):
            return (f"MODEL_DIR: the model was trained on {trained_on}, which is gone; a new cohort's "
                    f"{'slides' if ing.kind == 'wsi' else 'scans'} are featurised with that store's extractor: restore "
                    "it, or ingest the cohort with ingest.extractor_from and predict it with --store")
        return None
    import zarr

    width = int(zarr.open_group(trained_on, mode="r", zarr_format=3).attrs["n_features"])
    first, found = None, None
    try:
        if ing.kind == "h5":
            from tasks.ingest.h5 import H5_SUFFIXES, h5_feature_dim

            first = next(iter(sorted(f for f in Path(source).iterdir() if f.suffix.lower() in H5_SUFFIXES)), None)
            found = None if first is None else h5_feature_dim(first)
        elif ing.kind == "npy":
            import numpy as np

            first = next(iter(sorted((Path(source) / "features").glob("*.npy"))), None)
            found = None if first is None else int(np.load(first, mmap_mode="r", allow_pickle=False).shape[-1])
    except Exception:  # an unreadable file is the ingest's to name, with the others
        return None
    if found is not None and found != width:
        return (f"--source: {first} has {found} features per instance, but the model was trained on {width} "
                f"({trained_on}): features of another extractor")
    return None


def _training_store_problem(store: Path | str | None, model_dir: Path | str | None) -> str | None:
    """A new cohort (``predict --source``) would be ingested into the store the model was trained
    on: its bags would join the training data of the next run."""
    trained_on = _trained_on(model_dir)
    if store is not None and trained_on and Path(store).resolve() == Path(trained_on).resolve():
        return (f"--store: {store} is the store the model was trained on; a new cohort ingested there would become training "
                "data of the next run: give --store a new path (or leave it out)")
    return None


def _other_cohort_problem(store: Path | str | None, source: str) -> str | None:
    """A new cohort (``predict --source``) would be ingested into a ``--store`` that holds bags of
    another folder: it would join that cohort (its predictions, metrics and report) rather than go
    into a store of its own. The same folder's store (a nightly rerun as slides arrive) is fine."""
    if store is None or not (Path(store) / "zarr.json").is_file():
        return None
    from tasks.ingest.driver import ingested_from_elsewhere
    from tasks.store import open_cohort

    try:
        others = ingested_from_elsewhere(store, source)
    except Exception as error:  # not a cohort store: nothing could be ingested into it
        return f"--store: cannot open {store} as a cohort store: {type(error).__name__}: {error}"
    if not others:
        return None
    cohort = open_cohort(store)
    bag_id, bag_source = others[0], dict(zip(cohort.bag_ids, cohort.sources))[others[0]]
    return (f"--store: {store} already holds {len(others)} bag(s) not from --source {source} (e.g. {bag_id!r} from {bag_source}): "
            "the new cohort would be predicted and reported together with them; give --store a new path (or leave it out), "
            f"or predict that store as it is with --store alone")


def _unwritable(field: str, path: str | Path) -> str | None:
    """Why nothing can be written at ``path`` (or in the folder it would be made in), found by writing
    a temporary file there: a read-only mount, a system folder, no permission — at once rather than
    after the ingest and the fit."""
    folder = Path(path).absolute()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as error:
        return f"{field}: {path} cannot be written ({folder}: {error.strerror or error})"


def _model_dir_problem(model_dir: Path | str | None) -> str | None:
    """A model folder ``gpmil train`` did not finish writing: ``model.json`` unreadable or without
    the training store every stage reads, or no ``model.npz`` (written last)."""
    if model_dir is None or not (Path(model_dir) / "model.json").is_file():
        return None  # its absence is reported with the paths
    meta_path, arrays = Path(model_dir) / "model.json", Path(model_dir) / "model.npz"
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return f"MODEL_DIR: {meta_path} is not readable JSON ({error}); retrain to rewrite the model folder"
    if not isinstance(meta, dict) or "store" not in meta:  # every stage reads the training store from it
        return f"MODEL_DIR: {meta_path} lacks store: not a model folder written by gpmil train"
    if not arrays.is_file() and not (Path(model_dir) / "model.pkl").is_file():  # a pickle is refused, naming it, at load
        return f"MODEL_DIR: {arrays} is missing (training did not finish?); retrain"
    return None


def _stores_with_prediction(output_dir: Path | str, key: str) -> list[str]:
    """The new cohorts' stores ``gpmil predict --source`` made under ``output_dir/stores`` that hold
    ``predictions/<key>``."""
    return sorted(str(store) for store in Path(output_dir, "stores").glob("*.zarr") if (store / "predictions" / key).is_dir())


def _prediction_problem(store: Path | str, key: str, model_dir: Path | str | None, output_dir: Path | str | None = None,
                        settings: dict[str, Any] | None = None) -> str | None:
    """``evaluate``'s PREDICTION_KEY: a complete ``predictions/<key>`` of ``store``, made with
    ``model_dir`` and the configuration's prediction ``settings`` (its rule and method) where the
    prediction recorded them (``model_key``, ``prediction``; an older prediction without them is not
    checked for them): a report names its configuration, whose settings must be those its numbers
    were made with."""
    import zarr

    if key in ("", ".", "..") or "/" in key or "\\" in key:
        return f"PREDICTION_KEY: {key!r} is not a prediction key (the key printed by gpmil predict)"
    try:
        predictions = zarr.open_group(str(store), mode="r", zarr_format=3).get("predictions")
    except Exception as error:  # not a store: the stage names it when it opens the cohort
        return f"store: cannot open {store} as a cohort store: {type(error).__name__}: {error}"
    if predictions is None or key not in predictions:
        known = sorted(predictions.group_keys()) if predictions is not None else []
        elsewhere = [] if output_dir is None else _stores_with_prediction(output_dir, key)
        hint = f"; it is in {elsewhere[0]}: give --store {elsewhere[0]}" if elsewhere else ""
        return (f"PREDICTION_KEY: no prediction {key} in {store} (its predictions: {', '.join(known) or 'none'}); "
                f"the key is printed by gpmil predict{hint}")
    attrs = predictions[key].attrs
    if not attrs.get("complete"):
        return f"PREDICTION_KEY: predictions/{key} in {store} is incomplete (the prediction was interrupted); predict again"
    from tasks.store import open_cohort

    predicted, n_bags = predictions[key]["bags/proba"].shape[0], open_cohort(store).n_bags
    if predicted != n_bags:  # bags appended since (a nightly ingest): its tables would not line up with the store's
        return (f"PREDICTION_KEY: {key} predicted {predicted} bags and {store} now holds {n_bags} (bags were added since); "
                "predict again (gpmil predict) for a key of them all")
    made_by = attrs.get("model_key")
    if model_dir is not None and made_by is not None and made_by != Path(model_dir).name:
        return (f"PREDICTION_KEY: {key} was predicted with the model {attrs.get('model_dir', made_by)}, not MODEL_DIR "
                f"{model_dir}; evaluate it with that model")
    made_with = attrs.get("prediction")
    if settings is not None and made_with is not None and made_with != settings:
        def shown(fields: dict[str, Any]) -> str:
            return ", ".join(f"prediction.{name}: {'null' if value is None else value}" for name, value in sorted(fields.items()))

        return (f"PREDICTION_KEY: {key} was predicted with {shown(made_with)}; this configuration has {shown(settings)}: "
                "evaluate it with the configuration that predicted it (or predict again with this one)")
    return None


def _labels_problem(ing: IngestConfig, field: str) -> str | None:
    """The labels file of slides or ``.h5`` files read as their ingest reads it (slides: PANDA's
    layout unless a labels section names the columns; ``.h5``: ``slide_id,label``): a file that
    gives no labels — a workbook, grades read as 0/1, lines without an id — fails now (exit 2), not
    once Prefect and the cluster have started."""
    path = getattr(ing.labels, "file", ing.labels)
    if path is None or ing.kind not in ("wsi", "h5") or not Path(path).is_file():
        return None
    from tasks.ingest.errors import IngestError
    from tasks.ingest.labels import LabelSpec, read_panda_labels

    if isinstance(ing.labels, LabelsConfig) and ing.labels.spec() is None:
        return f"{field}: preset {ing.labels.preset!r} reads CT slice labels (ingest.kind: ct), not {ing.kind}'s"
    try:
        if isinstance(ing.labels, LabelsConfig):
            ing.labels.spec().read()
        elif ing.kind == "h5":
            LabelSpec(str(path)).read()
        else:
            read_panda_labels(path)
    except IngestError as error:
        return f"{field}: {path}: {error.reason}"
    return None


def resolved_model_dir(config: PipelineConfig, model_dir: str | None, stage: Stage) -> str | None:
    """``MODEL_DIR`` as given, or for ``predict``'s ``latest`` the model folder of the newest
    completed ``gpmil run`` of this configuration (its record in ``<output_dir>/runs``). ``evaluate``
    takes the model its prediction was made with, by its folder."""
    if model_dir != LATEST_MODEL:
        return model_dir
    if stage != "predict":
        raise ConfigError(f"MODEL_DIR: {LATEST_MODEL} is for predict; {stage} reads the model its prediction was made with: "
                          "give that model's folder (<output_dir>/models/<key>)")
    newest = newest_model_dir(config.output_dir, config.name)
    if newest is None:
        raise ConfigError(f"MODEL_DIR: {LATEST_MODEL}: no completed `gpmil run` of configuration {config.name!r} is recorded in "
                          f"{Path(config.output_dir) / RUNS} (run the pipeline first, or give a model folder)")
    return str(newest)


def check_inputs(config: PipelineConfig, stage: Stage, *, store: str | None = None, model_dir: str | None = None,
                 source: str | None = None, prediction_key: str | None = None) -> None:
    """Raise :class:`ConfigError` listing every missing input of ``stage`` (``store`` and
    ``model_dir``: the command line's overrides and arguments; ``source``: a new cohort's folder
    that ``predict`` ingests first, whose store need not exist yet; ``prediction_key``:
    ``evaluate``'s, which must name a complete prediction of that store by that model; ``latest``
    as ``model_dir`` of ``predict``: the newest run's model, :func:`resolved_model_dir`)."""
    model_dir = resolved_model_dir(config, model_dir, stage)
    ing = config.ingest
    checks: list[tuple[str, Path | str | None, Literal["file", "dir", "any"]]] = [
        ("dask.config_file", config.dask.config_file, "file")]  # every stage starts or joins a cluster
    ingests = stage == "ingest" or (stage == "run" and ing.kind != "none")
    if ingests:
        if ing.kind == "none":
            raise ConfigError("ingest.kind: is 'none': nothing to ingest (set wsi, ct, features, h5 or npy)")
        checks += [("ingest.source", ing.source, "file" if ing.kind == "features" else "dir"),
                   ("ingest.labels", getattr(ing.labels, "file", ing.labels), "file"),
                   ("ingest.extractor_from", ing.extractor_from, "dir")]
    if stage in ("run", "train") and not ingests:
        checks.append(("--store" if store else "store", store or config.store, "dir"))
    if stage == "run":
        checks.append(("prediction.store", config.prediction.store, "dir"))
    if stage == "predict" and source is not None:
        checks += [("--source", source, "file" if ing.kind == "features" else "dir"), ("MODEL_DIR", model_dir, "dir")]
        if model_dir is not None and Path(model_dir).is_dir():
            checks.append(("MODEL_DIR", Path(model_dir) / "model.json", "file"))
        new_cohort_problems = [_training_store_problem(config.prediction.store, model_dir) or _other_cohort_problem(config.prediction.store, source),
                               _new_cohort_problem(ing, source, model_dir)]
        if ing.kind != "features":
            checks.append(("--labels", getattr(ing.labels, "file", ing.labels), "file"))
        if ing.kind == "features" and ing.labels is not None:
            new_cohort_problems.append("--labels: a feature table carries each bag's label in its label column (-1: unlabelled); "
                                       "--labels applies to slide, CT, h5 and npy folders")
    elif stage in ("predict", "evaluate"):
        target = store or config.prediction.store or config.store
        field = "--store" if store else "prediction.store" if config.prediction.store else "store"
        checks += [("MODEL_DIR", model_dir, "dir"), (field, target, "dir")]
        if model_dir is not None and Path(model_dir).is_dir():
            checks.append(("MODEL_DIR", Path(model_dir) / "model.json", "file"))
    problems = [p for p in (_problem(*check) for check in checks) if p]
    problems.append(_dask_config_problem(config.dask.config_file))
    if not any(problems):
        problems.append(_jobqueue_profile_problem(config.dask))
    if stage == "predict" and source is not None:
        problems += new_cohort_problems
    written = [("output_dir", config.output_dir)] + ([("--store" if store else "store", store or config.store)] if ingests else [])
    problems += [f"{field}: {path} is not a folder" if Path(path).exists() and not Path(path).is_dir() else _unwritable(field, path)
                 for field, path in written if path is not None]  # folders the stage writes into may be new, never a file
    if stage in ("predict", "evaluate"):
        problems.append(_model_dir_problem(model_dir))
    if stage == "evaluate" and prediction_key is not None and not any(problems):
        problems.append(_prediction_problem(store or config.prediction.store or config.store, prediction_key, model_dir,
                                            config.output_dir, config.prediction_settings()))
    if ing.kind == "features" and (ingests or (stage == "predict" and source is not None)):
        problems.append(_table_columns_problem(source if stage == "predict" else ing.source, ing))
    if (ingests or stage == "predict" and source is not None) and not any(problems):
        problems.append(_labels_problem(ing, "--labels" if stage == "predict" else "ingest.labels"))
    if ingests and ing.kind in ("wsi", "ct") and ing.extractor and not any(problems):
        problems.append(_extractor_problem(ing))
    problems = [p for p in problems if p]
    if problems:
        raise ConfigError("; ".join(problems))
