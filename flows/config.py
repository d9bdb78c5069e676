"""The pipeline configuration: YAML → validated pydantic model, before any work starts.

A bad value fails with the dotted field path and the reason (``model.params.n_inducing: …``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

if TYPE_CHECKING:
    from mil_core import RBF

__all__ = ["PipelineConfig", "ConfigError", "load_config", "MODEL_CLASSES", "make_model"]


class ConfigError(ValueError):
    """A configuration that cannot run; the message names the file and the field."""


class _ConfigLoader(yaml.SafeLoader):
    """``yaml.SafeLoader`` that also reads YAML 1.2 floats: PyYAML follows YAML 1.1, where ``1e12``
    and ``1e-6`` (no decimal point) are strings, so ``H: 1e12`` or ``tol: 1e-6`` would reach the
    estimator as text. A key given twice in one mapping is an error (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice in one section",
                                                        key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"), list("-+0123456789."))


def _model_classes() -> dict[str, type]:
    import mil_core

    names = ["VGPMIL", "GVGPMIL", "PsiVGPMIL", "VGPMILPR", "VGPMILPRI", "VWSGP", "AbSMIL", "EmbeddedGPMIL",
             "VGPMILPRGibbs"]
    return {name: getattr(mil_core, name) for name in names if hasattr(mil_core, name)}


class _ModelClasses(Mapping[str, type]):
    """:func:`_model_classes`, imported on first use: a configuration that is wrong elsewhere is
    reported before mil_core's (scikit-learn's, SciPy's) imports."""

    def __init__(self) -> None:
        self._classes: dict[str, type] | None = None

    def _load(self) -> dict[str, type]:
        if self._classes is None:
            self._classes = _model_classes()
        return self._classes

    def __getitem__(self, name: str) -> type:
        return self._load()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


MODEL_CLASSES = _ModelClasses()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class LabelsConfig(_Strict):
    """Bag labels from a CSV/TSV/Parquet file: ``id_column`` names the bag (slide file stem, h5
    stem), the binary target is ``target`` (an expression over the row's columns, e.g.
    ``isup_grade > 0`` or ``diagnosis in ['tumor']``; parsed, never run as Python), else 1 for
    ``label_column`` values in ``positive``, else ``label_column`` must hold 0/1. A cell or a
    ``positive``/``target`` value that spells a number is that number (``01`` is 1: TCGA's sample
    type ``01`` matches ``positive: ["01"]`` and ``target: "sample_type == '01'"``); ``positive``
    reads True/False (and the text ``true``/``false``) as 1/0; a target compares a True/False column
    with ``True``/``False``, 1/0 or the text ``'true'``/``'false'``. ``preset``:
    ``panda`` (image_id, isup_grade > 0) or ``rsna`` (slice rows ``ID_<SOPInstanceUID>_any``)."""

    file: Path
    preset: Literal["panda", "rsna"] | None = None
    id_column: str = "slide_id"
    label_column: str = "label"
    positive: list[Any] | None = None
    target: str | None = None

    @field_validator("target")
    @classmethod
    def _parses(cls, text: str | None) -> str | None:
        from tasks.ingest.labels import TargetExpression

        if text is not None:
            TargetExpression(text)
        return text

    @model_validator(mode="after")
    def _one_rule(self) -> LabelsConfig:
        if self.positive is not None and self.target is not None:
            raise ValueError("give either positive or target, not both")
        given = sorted(f for f in self.model_fields_set - {"file", "preset"}
                       if getattr(self, f) != type(self).model_fields[f].default)
        if self.preset == "panda" and given:
            raise ValueError(f"preset panda reads image_id and isup_grade > 0; {', '.join(given)} would be ignored: drop "
                             "the preset and give id_column: image_id, label_column: isup_grade and your target "
                             "(e.g. \"isup_grade >= 2\")")
        return self

    def spec(self):
        """The :class:`tasks.ingest.labels.LabelSpec` (``None`` for the RSNA preset, read by the CT reader)."""
        from tasks.ingest.labels import LabelSpec

        if self.preset == "rsna":
            return None
        if self.preset == "panda":
            return LabelSpec.preset("panda", self.file)
        return LabelSpec(str(self.file), self.id_column, self.label_column, self.positive, self.target)


class TableColumns(_Strict):
    """Which columns of a Parquet feature table are what (``ingest.columns``; ``kind: features``).
    ``features``: a list of names, a pattern (``feat_*``) or ``None``: every numeric column that
    is not named here; ``coords`` (e.g. ``[x, y]``, integers) are kept as the instances'
    coordinates, not used as features; ``instance_label``: a 0/1/-1 column, optional."""

    bag: str = "bag_id"
    label: str = "label"
    features: list[str] | str | None = None
    coords: list[str] | None = None
    instance_label: str | None = None

    def reader_arguments(self) -> dict[str, Any]:
        """The keyword arguments of :func:`tasks.ingest.tables.read_parquet_table`."""
        return {"bag_column": self.bag, "label_column": self.label, "feature_columns": self.features,
                "coords_columns": self.coords, "instance_label_column": self.instance_label}

    def named(self) -> list[str]:
        """Every column named here (a features pattern is not a column)."""
        features = self.features if isinstance(self.features, list) else []
        return [self.bag, self.label, *features, *(self.coords or []), *([self.instance_label] if self.instance_label else [])]


def new_cohort_store(output_dir: str | Path, source: str | Path) -> Path:
    """Where ``gpmil predict --source`` ingests a new cohort without ``--store``: a store of its own,
    ``<output_dir>/stores/<folder's slug>-<hash>.zarr``."""
    from tasks.paths import safe_filename

    return Path(output_dir) / "stores" / f"{safe_filename(str(Path(source).resolve()))}.zarr"


def new_cohort_labels(labels: Path | LabelsConfig | None, file: str | Path | None) -> Path | LabelsConfig | None:
    """The labels of a new cohort (``predict --source --labels``): ``file`` read as ``labels`` reads
    its own (a section's columns, target or positive), or by the kind's convention."""
    if file is None:
        return None
    return labels.model_copy(update={"file": Path(file)}) if isinstance(labels, LabelsConfig) else Path(file)


class IngestConfig(_Strict):
    """Where the cohort comes from. ``kind``: ``wsi`` (tiled TIFF slides + PANDA-style labels CSV),
    ``ct`` (DICOM series + RSNA-style labels CSV), ``features`` (a MIL feature table) or ``none``
    (the store already exists), ``h5`` (a CLAM/TRIDENT folder of ``<slide>.h5``; ``slides``: the
    slides' folder, optional, for heatmap backgrounds) or ``npy`` (a torchmil folder with
    ``features/``, ``labels/``, optional ``inst_labels/``, ``coords/``). ``labels``: a file (read by
    the kind's convention: PANDA for slides, RSNA for CT, ``slide_id,label`` 0/1 for h5) or a
    :class:`LabelsConfig` section. ``extractor_from``: a cohort store whose fitted feature extractor a
    new store takes (a cohort to be predicted by a model trained on that store needs its features).
    ``nonfinite``: a bag with NaN/inf features is skipped with the rows named (``reject``), or
    loses those instances, counted per bag in the ingest report (``drop``).
    ``original_label_column`` (``features`` only): the table's column whose value the 0/1 target
    came from (an ISUP grade, a class name), kept per bag as its original label; a Parquet column
    name, or a 0-based column position in a MIL CSV (an ``.npz`` has the array ``original_labels``).
    ``columns`` (``features`` from Parquet only): :class:`TableColumns`, which columns are the bag
    id, label, features and coordinates (a MIL CSV and an ``.npz`` fix theirs).

    Slides (``wsi``): any format OpenSlide or tifffile reads, found under ``source`` by ``patterns``
    (default: the usual slide suffixes; in sub-folders when ``recursive``). ``target_mpp`` tiles at a
    physical scale (``tile_size`` pixels of ``target_mpp`` µm each; ``base_mpp`` overrides the
    slides' metadata), else ``magnification`` or ``level`` picks the pyramid level. ``extractor``: a
    registered name, a ``gpmil.extractors`` entry point or an import path ``package.module:Class``
    (``torch`` with ``extractor_params`` model/weights for a local PyTorch model). An extractor a
    store records (resuming an ingest, ``extractor_from``) is rebuilt from installed code (registered
    names, entry points) and from the import paths ``extractor`` names or ``trusted_imports`` lists,
    never from another path the store names: a store is data that others may write."""

    kind: Literal["wsi", "ct", "features", "h5", "npy", "none"] = "none"
    source: Path | None = None
    labels: Path | LabelsConfig | None = None
    slides: Path | None = None
    tile_size: int = Field(256, gt=0)
    level: int = Field(0, ge=0)
    magnification: float | None = Field(None, gt=0)
    target_mpp: float | None = Field(None, gt=0)
    base_mpp: float | None = Field(None, gt=0)
    reader: Literal["auto", "openslide", "tifffile"] = "auto"
    patterns: list[str] | None = None
    recursive: bool = True
    min_tissue_fraction: float = Field(0.5, gt=0, le=1)
    extractor: str | None = None
    extractor_params: dict[str, Any] = Field(default_factory=dict)
    extractor_from: Path | None = None
    trusted_imports: list[str] = Field(default_factory=list)  # import paths a store's recorded extractor may name
    nonfinite: Literal["reject", "drop"] = "reject"  # NaN/inf features: skip the bag, or drop those instances (counted)
    unlabelled: Literal["skip", "keep"] = "skip"  # slides/scans/files the labels do not give: skip, or keep unlabelled
    original_label_column: str | int | None = None  # features tables: the column the 0/1 target came from
    columns: TableColumns | None = None  # Parquet feature tables: bag, label, feature and coordinate columns

    @field_validator("extractor")
    @classmethod
    def _registered(cls, name: str | None) -> str | None:
        from tasks.ingest.features import resolve_extractor

        if name is not None:
            try:
                resolve_extractor(name)
            except KeyError as error:
                raise ValueError(error.args[0]) from None
        return name

    @model_validator(mode="after")
    def _source_needed(self) -> IngestConfig:
        if self.kind != "none" and self.source is None:
            raise ValueError(f"ingest.source is required for ingest.kind={self.kind!r}")
        return self

    @model_validator(mode="after")
    def _labels_apply(self) -> IngestConfig:
        if self.kind == "features" and self.labels is not None:
            raise ValueError("labels applies to ingest.kind wsi, ct, h5 and npy; a feature table ('features') carries each "
                             "row's bag label in its own label column")
        if self.kind != "ct" and isinstance(self.labels, LabelsConfig) and self.labels.preset == "rsna":
            raise ValueError(f"labels: preset rsna reads RSNA CT slice labels (ingest.kind ct), not those of ingest.kind "
                             f"{self.kind!r}: name the file's columns (id_column, label_column) and its rule (positive or target)")
        if self.kind == "ct" and isinstance(self.labels, LabelsConfig) and (
                self.labels.model_fields_set - {"file", "preset"} or self.labels.preset not in (None, "rsna")):
            raise ValueError("labels: ingest.kind ct reads RSNA slice labels (rows ID_<SOPInstanceUID>_<subtype>, Label): "
                             "give the file, or {file: …, preset: rsna}; id_column, label_column, positive, target and "
                             "the panda preset do not apply")
        return self

    @model_validator(mode="after")
    def _original_label_column_fits(self) -> IngestConfig:
        column = self.original_label_column
        if column is None:
            return self
        if self.kind != "features":
            raise ValueError(f"original_label_column applies to ingest.kind 'features' (a feature table), not {self.kind!r}; "
                             "a labels section keeps its label_column as the original label")
        suffix = self.source.suffix.lower()
        if suffix == ".parquet" and not isinstance(column, str):
            raise ValueError(f"original_label_column: a Parquet table's column is named, got {column!r}")
        if suffix == ".csv" and not (isinstance(column, int) and column >= 2):
            raise ValueError(f"original_label_column: the MIL CSV has no header (column 0: bag label, 1: bag id), so give "
                             f"the 0-based position of a later column, got {column!r}")
        if suffix == ".npz":
            raise ValueError("original_label_column: an .npz table gives its original labels as the array 'original_labels'")
        return self

    @model_validator(mode="after")
    def _columns_fit(self) -> IngestConfig:
        if self.columns is not None and (self.kind != "features" or self.source.suffix.lower() != ".parquet"):
            raise ValueError("columns applies to a Parquet feature table (ingest.kind 'features', a .parquet source); a MIL "
                             "CSV is label, bag id, features by position and an .npz names its arrays X, bag_ids, labels, coords")
        return self


class ModelConfig(_Strict):
    """``name``: one of the estimators of :mod:`mil_core`; ``params``: its constructor arguments.

    The default, ``VGPMIL`` (seed 000 with its automatic kernel, H, bag rule and stop), has the
    best mean held-out bag AUC of the GP-MIL defaults over the fourteen sets (CV seeds 0–2) and
    the large bags (nine draws) of ``docs/BENCHMARKS.md``, "The pipeline's default model,
    re-measured (session 28)" (mean of 15: VGPMIL 0.842, GVGPMIL 0.823, VGPMILPR 0.823, VWSGP
    0.785; ``tests/test_default_model.py`` holds these to that table) and gives instance
    probabilities for the heat maps. ``VGPMILPR`` (the default until session 28) localises
    better on large bags and its kernel choice is cheaper (same section).

    ``EmbeddedGPMIL``'s ``gp`` is itself a model section (``{name: GVGPMIL, params: {…}}``);
    left out, it is the package's default GP."""

    name: str = "VGPMIL"
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name not in MODEL_CLASSES:
            raise ValueError(f"unknown model {name!r}; available: {', '.join(sorted(MODEL_CLASSES))}")
        return name

    @model_validator(mode="after")
    def _params_accepted(self) -> ModelConfig:
        if "standardize" in self.params:  # one switch: the pipeline sets the model's from training.standardize
            raise ValueError("standardize is set for the whole cohort in the pipeline: use training.standardize, "
                             "not model.params.standardize")
        defaults = MODEL_CLASSES[self.name]().get_params()
        accepted = set(defaults) - {"standardize"}
        unknown = sorted(set(self.params) - accepted)
        if unknown:
            raise ValueError(f"{self.name} has no parameter(s) {', '.join(unknown)}; valid: {', '.join(sorted(accepted))}")
        if "kernel" in self.params:
            kernel_from_config(self.params["kernel"])
        if self.name == "EmbeddedGPMIL" and self.params.get("gp") is not None:
            gp = self.params["gp"]
            if not isinstance(gp, dict):
                raise ValueError(f"EmbeddedGPMIL's gp must be a model section {{name: ..., params: {{...}}}}, got {gp!r}")
            ModelConfig.model_validate(gp)  # its own fields named; whether it can be a member: _check_params below
        for name, value in self.params.items():
            if isinstance(defaults.get(name), bool) and not isinstance(value, bool):  # "false" is a true value
                raise ValueError(f"{self.name}'s {name} must be true or false, got {value!r}")
            if isinstance(value, str) and (defaults.get(name) is None or isinstance(defaults[name], (int, float))) and _spells_number(value):
                # tol: "0.001" met a comparison with a TypeError that named nothing; random_state: "0" failed at fit
                raise ValueError(f"{self.name}'s {name} must be a number, got the text {value!r} (remove the quotes)")
        try:
            make_model(self)._check_params()  # values too (n_components: 0, hidden: "16"), not after the ingest
        except TypeError as error:
            raise ValueError(f"{self.name}: a parameter of the wrong type ({error}); given {self.params}") from None
        return self


class TrainingConfig(_Strict):
    """``standardize``: learn per-feature mean/std on the training bags and apply them to every
    cohort the model predicts (recommended: handcrafted features differ in scale). ``device``:
    ``gpu`` keeps partition arrays on the workers' GPUs (``auto``: when workers advertise a ``GPU``
    resource: ``dask_cuda.LocalCUDACluster`` with ``cluster_kwargs: {resources: {GPU: 1}}``, ``dask cuda
    worker --resources GPU=1``; dask-cuda advertises none by itself) in
    the array namespace ``gpu_namespace`` (CuPy); ``device_memory_gib`` per GPU decides
    persist/stream when CuPy cannot be asked. ``compute_dtype: float32``: float32 whitened
    features (half the memory; GEMMs twice as fast) with float64 statistics."""

    standardize: bool = True
    partition_mib: float = Field(128, gt=0)
    checkpoint_every: int = Field(5, ge=1)
    mode: Literal["auto", "persist", "stream"] = "auto"
    device: Literal["auto", "cpu", "gpu"] = "auto"
    gpu_namespace: str = "cupy"
    device_memory_gib: float | None = Field(None, gt=0)
    compute_dtype: Literal["float64", "float32"] = "float64"


class PredictionConfig(_Strict):
    """``store``: cohort to predict (default: the training store); the MIL ``rule`` applies to the
    models that score bags by a rule on instance probabilities (the logistic and probit families,
    EmbeddedGPMIL through its GP; another model refuses it when the configuration is read),
    ``method`` to every model whose predictions take one (the logistic family,
    VWSGP's bag probability; :func:`tasks.training.predict.prediction_kwargs`). ``rule: null`` (default) uses the
    estimator's fitted ``bag_rule_`` (its ``bag_rule``, or the rule its kernel choice picked for
    ``"auto"``; :func:`mil_core.bags.bag_score`), so the pipeline scores bags
    exactly as the estimator does in validation and ``predict_bag_proba``."""

    store: Path | None = None
    method: Literal["probit", "mc"] = "probit"
    rule: Literal["top_fraction", "max", "mean", "noisy_or"] | None = None
    threshold: float = Field(0.5, gt=0, lt=1)
    top_k: int = Field(3, ge=1)
    n_uncertain: int = Field(10, ge=0)
    n_heatmaps: int = Field(4, ge=0)


def _local_cluster_parameters() -> set[str]:
    """What ``distributed.LocalCluster(**kwargs)`` accepts: its own parameters and, passed on, its
    workers' (``Nanny``, ``Worker`` and the server under them)."""
    import inspect

    from distributed import LocalCluster, Nanny, Worker
    from distributed.core import Server

    return {name for cls in (LocalCluster, Nanny, Worker, Server) for name, parameter in inspect.signature(cls.__init__).parameters.items()
            if parameter.kind not in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL) and name != "self"}


def _not_local_cluster_parameters(cluster_class: str | None, kwargs: dict[str, Any]) -> list[str]:
    """The keys of ``kwargs`` a LocalCluster (the default, or named as ``cluster_class``) would pass
    down until a worker refuses them; other cluster classes, subclasses too (``LocalCUDACluster``),
    have parameters of their own and check them."""
    from distributed import LocalCluster

    from tasks.cluster import import_cluster_class

    if (LocalCluster if cluster_class is None else import_cluster_class(cluster_class)) is not LocalCluster:
        return []
    return sorted(set(kwargs) - _local_cluster_parameters())


# LocalCluster parameters a wrong type breaks late or silently: ``n_workers: two`` failed with a
# traceback from inside its event loop, ``threads_per_worker: "2"`` with "Nanny failed to start",
# and ``processes: "no"`` started processes (any non-empty text is true). None is the class's default.
_LOCAL_CLUSTER_COUNTS = ("n_workers", "threads_per_worker", "nthreads")
_LOCAL_CLUSTER_SWITCHES = ("processes",)


def _mistyped_local_cluster_settings(cluster_class: str | None, kwargs: dict[str, Any], adaptive: bool) -> list[str]:
    """What is wrong with the counts and switches of ``kwargs`` for a LocalCluster (or a subclass,
    which takes the same ones), one phrase per setting; empty for other cluster classes. Zero
    workers only with ``adapt_kwargs`` (``adaptive``: they scale from there)."""
    from distributed import LocalCluster

    from tasks.cluster import import_cluster_class

    if not issubclass(LocalCluster if cluster_class is None else import_cluster_class(cluster_class), LocalCluster):
        return []
    problems = []
    for name in (*_LOCAL_CLUSTER_COUNTS, *_LOCAL_CLUSTER_SWITCHES):
        value = kwargs.get(name)
        if value is None:
            continue
        if name in _LOCAL_CLUSTER_SWITCHES:
            if not isinstance(value, bool):
                problems.append(f"{name}: {value!r} is not true or false")
        elif name == "n_workers" and type(value) is int and value == 0:
            if not adaptive:
                problems.append("n_workers: 0 starts no worker and the run would wait for one (give adapt_kwargs to scale from 0)")
        elif not (type(value) is int and value >= 1):
            problems.append(f"{name}: {value!r} is not a whole number >= 1")
    return problems


def _adapt_parameters(cluster_class: str | None) -> set[str]:
    """What ``cluster.adapt(**kwargs)`` accepts: the keywords of each ``adapt`` up the class's
    ancestry (dask-jobqueue's ``minimum_jobs``, ``SpecCluster``'s ``maximum_memory``) and, where the
    last passes the rest on, ``distributed.Adaptive``'s and those Adaptive hands to the scheduler's
    ``workers_to_close``."""
    from distributed import LocalCluster, Scheduler
    from distributed.deploy.adaptive import Adaptive

    from tasks.cluster import import_cluster_class

    def named(function: Callable) -> tuple[set[str], bool]:
        parameters = inspect.signature(function).parameters.values()
        return ({p.name for p in parameters if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)},
                any(p.kind is p.VAR_KEYWORD for p in parameters))

    accepted: set[str] = set()
    for cls in (LocalCluster if cluster_class is None else import_cluster_class(cluster_class)).__mro__:  # each adapt that passes on
        if "adapt" in vars(cls):
            own, passes_on = named(vars(cls)["adapt"])
            accepted |= own
            if not passes_on:
                break
    else:
        accepted |= named(Adaptive.__init__)[0] | named(Scheduler.workers_to_close)[0] - {"n", "target"}
    return accepted - {"self", "cluster", "Adaptive"}


class DaskConfig(_Strict):
    """Where a run's Dask workers come from (one cluster per flow run), the way prefect-dask names it:
    ``cluster_class`` (import path; default ``distributed.LocalCluster`` sized to the machine) built
    with ``cluster_kwargs`` and scaled with ``adapt_kwargs`` (``cluster.adapt``) or ``n_workers``;
    or ``scheduler_address``, a scheduler that is already running. ``config_file``: a Dask
    configuration (e.g. ``infra/slurm.yaml``) set while the cluster is built and lives.
    ``n_workers``, ``threads_per_worker`` and ``processes`` are shortcuts for the LocalCluster;
    ``worker_timeout_s``: how long a run waits for its first worker (batch queues can be slow)."""

    scheduler_address: str | None = None
    cluster_class: str | None = None
    cluster_kwargs: dict[str, Any] = Field(default_factory=dict)
    adapt_kwargs: dict[str, Any] | None = None
    config_file: Path | None = None
    n_workers: int | None = Field(None, ge=1)
    threads_per_worker: int | None = Field(None, ge=1)
    processes: bool | None = None
    worker_timeout_s: float = Field(600, gt=0)

    @field_validator("cluster_class")
    @classmethod
    def _importable(cls, path: str | None) -> str | None:
        from tasks.cluster import import_cluster_class

        if path is not None:
            import_cluster_class(path)  # a typo or a missing package fails now, not at the first run
        return path

    @field_validator("adapt_kwargs")
    @classmethod
    def _bounds(cls, adapt: dict[str, Any] | None) -> dict[str, Any] | None:
        if adapt is None:
            return None
        for unit in ("", "_jobs"):  # workers; dask-jobqueue's jobs, which replace them where given
            if unit and not {f"minimum{unit}", f"maximum{unit}"} & adapt.keys():
                continue
            low = adapt.get(f"minimum{unit}", 1)
            high = adapt.get(f"maximum{unit}", low)
            if not (type(low) is int and type(high) is int and 1 <= low <= high):
                raise ValueError(f"needs integers 1 <= minimum{unit} <= maximum{unit} (got minimum{unit}={low!r}, "
                                 f"maximum{unit}={high!r}): a run waits for its first worker before training, which an "
                                 "adaptive cluster scaled to 0 would not start")
        return {"minimum": adapt.get("minimum", 1), **adapt}

    @model_validator(mode="after")
    def _one_source(self) -> DaskConfig:
        if self.scheduler_address and (self.cluster_class or self.cluster_kwargs or self.adapt_kwargs):
            raise ValueError("give either scheduler_address (a running cluster) or cluster_class/cluster_kwargs/adapt_kwargs, not both")
        if self.scheduler_address and (given := [k for k in ("n_workers", "threads_per_worker", "processes") if getattr(self, k) is not None]):
            raise ValueError(f"{', '.join(given)} size a cluster gpmil starts; with scheduler_address the running cluster "
                             "has its own workers: remove them")
        if self.cluster_kwargs and (unknown := _not_local_cluster_parameters(self.cluster_class, self.cluster_kwargs)):
            from difflib import get_close_matches

            hints = [f"{name} (did you mean {near[0]}?)" if (near := get_close_matches(name, _local_cluster_parameters(), 1)) else name
                     for name in unknown]
            raise ValueError(f"cluster_kwargs: {', '.join(hints)} is no parameter of a LocalCluster or its workers "
                             "(it failed only as the workers started: 'Nanny failed to start')")
        accepted = _adapt_parameters(self.cluster_class) if self.adapt_kwargs else set()
        if self.adapt_kwargs and (unknown := sorted(set(self.adapt_kwargs) - accepted)):
            from difflib import get_close_matches

            hints = [f"{name} (did you mean {near[0]}?)" if (near := get_close_matches(name, accepted, 1))
                     else name for name in unknown]
            raise ValueError(f"adapt_kwargs: {', '.join(hints)} is no parameter of {self.cluster_class or 'LocalCluster'}.adapt "
                             "(a misspelt maximum left the cluster free to grow without bound)")
        if self.cluster_kwargs and (mistyped := _mistyped_local_cluster_settings(self.cluster_class, self.cluster_kwargs,
                                                                                             self.adapt_kwargs is not None)):
            raise ValueError(f"cluster_kwargs: {'; '.join(mistyped)}")
        local = {"threads_per_worker": self.threads_per_worker, "processes": self.processes}
        if self.cluster_class and any(v is not None for v in local.values()):
            from distributed import LocalCluster

            from tasks.cluster import import_cluster_class

            if not issubclass(import_cluster_class(self.cluster_class), LocalCluster):
                raise ValueError(f"threads_per_worker and processes apply to a LocalCluster; for {self.cluster_class} put "
                                 "them in cluster_kwargs")
        return self

    def cluster_spec(self) -> dict[str, Any]:
        """Keyword arguments of :func:`tasks.cluster.start_cluster`."""
        from tasks.cluster import read_dask_config

        kwargs = {k: v for k, v in {"threads_per_worker": self.threads_per_worker, "processes": self.processes}.items() if v is not None}
        return {"cluster_class": self.cluster_class, "cluster_kwargs": kwargs | self.cluster_kwargs,
                "adapt_kwargs": self.adapt_kwargs, "n_workers": self.n_workers,
                "dask_config": read_dask_config(self.config_file) if self.config_file else None}


class PipelineConfig(_Strict):
    """The whole pipeline: ingest → train → predict → evaluate."""

    name: str = Field("gpmil", pattern=r"^[A-Za-z0-9_.-]+$")
    store: Path
    output_dir: Path
    # Where output_dir is served (an HTTP mirror, a bucket's web URL): the Prefect UI's image and
    # link artifacts point there. Default: file:// URIs, which open on the machine that wrote them.
    output_url: str | None = Field(None, pattern=r"^[A-Za-z][A-Za-z0-9+.-]*://")
    ingest: IngestConfig = IngestConfig()
    model: ModelConfig = Field(default_factory=ModelConfig.model_construct)  # valid as it is; validating it imports mil_core
    training: TrainingConfig = TrainingConfig()
    prediction: PredictionConfig = PredictionConfig()
    dask: DaskConfig = DaskConfig()
    # After each completed `gpmil run`: keep the outputs of this configuration's (by name) newest N distinct results in
    # output_dir (models, report folders, the store's predictions and checkpoints), remove older ones' (tasks.retention).
    # Default: keep everything.
    keep_runs: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _rule_reaches_the_model(self) -> PipelineConfig:
        """A ``prediction.rule`` the model cannot use fails here, before the fit, not after it."""
        refused_by = _rule_refused_by(self.model) if self.prediction.rule is not None and "model" in self.model_fields_set else None
        if refused_by:
            raise ValueError(f"prediction.rule={self.prediction.rule!r}: {refused_by} scores bags by its own rule, "
                             f"not by a rule on instance probabilities; leave prediction.rule out (null)")
        return self

    def model_key(self, cohort_fingerprint: str) -> str:
        """Content key of a trained model: training cohort + model + training settings that change
        the result (partitioning and device do not)."""
        return _digest({"cohort": cohort_fingerprint, "model": self.model.model_dump(mode="json"),
                        "standardize": self.training.standardize})

    def prediction_settings(self) -> dict[str, Any]:
        """The ``prediction`` fields that change a prediction's numbers (the rest change its report)."""
        return self.prediction.model_dump(mode="json", include={"method", "rule"})

    def prediction_key(self, model_key: str, cohort_fingerprint: str) -> str:
        return _digest({"model": model_key, "cohort": cohort_fingerprint, "prediction": self.prediction_settings()})


def _spells_number(text: str) -> bool:
    """A finite number written as text (YAML's quoted ``"0.001"``; its ``inf`` is text unquoted)."""
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _digest(payload: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _rule_refused_by(section: ModelConfig) -> str | None:
    """The model whose ``predict_bag_proba`` takes no ``rule`` (EmbeddedGPMIL passes its rule to
    its GP, so it may be that section's), or ``None`` when the rule reaches a rule on instance
    probabilities."""
    if "rule" not in inspect.signature(MODEL_CLASSES[section.name].predict_bag_proba).parameters:
        return section.name
    gp = section.params.get("gp")
    return _rule_refused_by(ModelConfig.model_validate(gp)) if isinstance(gp, dict) else None


def kernel_from_config(value: Any) -> RBF | None:
    """``model.params.kernel`` of a configuration: ``null`` (the model's automatic choice) or the
    fields of :class:`mil_core.RBF`, ``{variance: 4, length_scale: ard, bias: 0}`` — ``length_scale`` a
    number, a list with one per feature, ``ard`` (one ``√D`` per feature, for ``learn_kernel``) or
    ``null`` (``√D``); ``bias`` the constant kernel added to it (default 0)."""
    from mil_core import RBF  # noqa: F811  (the configuration's other checks need no mil_core)

    if value is None or isinstance(value, RBF):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"params.kernel must be a mapping {{variance: ..., length_scale: ...}} or null, got {value!r}")
    unknown = sorted(set(value) - {"variance", "length_scale", "bias"})
    if unknown:
        raise ValueError(f"params.kernel has no field(s) {', '.join(map(str, unknown))}; valid: variance, length_scale, bias")
    scale = value.get("length_scale")
    kernel = RBF(variance=value.get("variance", 1.0), length_scale=tuple(scale) if isinstance(scale, list) else scale,
                 bias=value.get("bias", 0.0))
    try:  # the feature count is not known yet: check what can be checked without it
        kernel.resolve(len(kernel.length_scale) if isinstance(kernel.length_scale, tuple) else 1)
    except ValueError as error:
        raise ValueError(f"params.kernel: {error}") from None
    return kernel


def make_model(config: ModelConfig):
    """A fresh estimator from the configuration (a nested ``gp`` section built the same way; a
    ``kernel`` mapping becomes :class:`mil_core.RBF`, :func:`kernel_from_config`)."""
    params = dict(config.params)
    if isinstance(params.get("gp"), dict):
        params["gp"] = make_model(ModelConfig.model_validate(params["gp"]))
    if "kernel" in params:
        params["kernel"] = kernel_from_config(params["kernel"])
    return MODEL_CLASSES[config.name](**params)


def load_config(path: str | Path, preflight: Callable[[PipelineConfig], None] | None = None, **overrides: Any) -> PipelineConfig:
    """Read and validate a YAML configuration; relative paths are taken from the file's folder.
    ``preflight`` (e.g. the CLI's input-path checks) gets the configuration validated but for its
    model section, before the model check imports mil_core."""
    path = Path(path)
    try:
        raw = yaml.load(path.read_text(), Loader=_ConfigLoader) or {}
    except FileNotFoundError:
        raise ConfigError(f"{path}: configuration file not found") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: not a readable YAML text file ({type(error).__name__}: {error})") from None
    except yaml.YAMLError as error:
        raise ConfigError(f"{path}: not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    raw |= overrides
    try:
        # First without the model section, whose check imports mil_core: a mistake elsewhere is
        # reported in well under a second.
        without_model = PipelineConfig.model_validate({k: v for k, v in raw.items() if k != "model"})
        if preflight is not None:
            try:
                preflight(_resolve_paths(without_model, path.parent))
            except ConfigError as error:
                raise ConfigError(f"{path}: {error}") from None
        config = PipelineConfig.model_validate(raw)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '<root>'}: {e['msg']}" for e in error.errors())
        raise ConfigError(f"{path}: {problems}") from None
    try:
        return _resolve_paths(config, path.parent)
    except ConfigError as error:
        raise ConfigError(f"{path}: {error}") from None


def _resolve_paths(config: PipelineConfig, base: Path) -> PipelineConfig:
    """The config's paths relative to ``base`` (its file's folder), ``~`` as the home folder."""
    def resolve(p: Path | None) -> Path | None:  # ~ as a shell and the flows' parameters read it, not a folder named '~'
        if p is None:
            return None
        try:
            expanded = p.expanduser()
        except RuntimeError as error:  # ~nosuchuser, or no home folder at all
            raise ConfigError(f"{str(p)!r}: cannot read its '~': {error}") from None
        return expanded if expanded.is_absolute() else (base / p).resolve()

    labels = config.ingest.labels
    if isinstance(labels, LabelsConfig):
        labels = labels.model_copy(update={"file": resolve(labels.file) or labels.file})
    else:
        labels = resolve(labels) or labels
    extractor_params = dict(config.ingest.extractor_params)
    if config.ingest.extractor == "torch" and isinstance(extractor_params.get("weights"), str):  # a file, like the others
        extractor_params["weights"] = str(resolve(Path(extractor_params["weights"])) or extractor_params["weights"])
    ingest = config.ingest.model_copy(update={"source": resolve(config.ingest.source) or config.ingest.source,
                                              "labels": labels, "slides": resolve(config.ingest.slides) or config.ingest.slides,
                                              "extractor_from": resolve(config.ingest.extractor_from) or config.ingest.extractor_from,
                                              "extractor_params": extractor_params})
    prediction = config.prediction.model_copy(update={"store": resolve(config.prediction.store) or config.prediction.store})
    dask = config.dask.model_copy(update={"config_file": resolve(config.dask.config_file) or config.dask.config_file})
    return config.model_copy(update={"store": resolve(config.store) or config.store, "output_dir": resolve(config.output_dir) or config.output_dir,
                                     "ingest": ingest, "prediction": prediction, "dask": dask})
