"""``fit_cohort``: a model fitted on the labelled bags of a cohort store on a Dask cluster,
checkpointed and resumable (``<store>/training/<run>/``: a fit started again with the same
``run`` resumes from its latest checkpoint)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from distributed import Client

from mil_core.engine import BagBlock, FitTrace, optimise
from mil_core.models.base import SparseGPMILBase, choice_bags, sweep_budget, uses_coords
from tasks.lease import holds_writer_lease
from tasks.store import open_cohort
from tasks.training.blocks import DEFAULT_PARTITION_BYTES, FeatureScaling
from tasks.training.checkpoint import Checkpoint
from tasks.training.early_stopping import DistributedEarlyStopping
from tasks.training.errors import CohortError
from tasks.training.executor import DaskExecutor
from tasks.training.placement import Device, Mode, resolve_mode, resolve_placement
from tasks.training.preprocess import feature_scaling, kmeans_sample, read_bags

log = logging.getLogger("gpmil.training")


def _afresh(checkpoint: str) -> str:
    return f"use a new run name, or delete {checkpoint} to train this model afresh"


@dataclass(frozen=True)
class TrainingSummary:
    """What ran: the store, run name, partitions, persist/stream mode, device, iterations."""

    store: str
    run: str
    n_partitions: int
    n_bags: int
    n_instances: int
    mode: str
    device: str
    n_iter: int
    resumed_from: int | None
    scaling: FeatureScaling | None = None


@holds_writer_lease("training run {run!r} on {store}")
def fit_cohort(
    model: SparseGPMILBase,
    store: str | Path,
    client: Client,
    *,
    run: str = "default",
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
    mode: Mode = "auto",
    device: Device = "auto",
    gpu_namespace: str = "cupy",
    device_memory: int | None = None,
    compute_dtype: Literal["float64", "float32"] = "float64",
    checkpoint_every: int = 5,
    resume: bool = True,
    split_every: int = 8,
    max_kmeans_sample: int = 200_000,
    memory_fraction: float = 0.5,
    standardize: bool | None = None,
    on_iteration: Callable[[int, float], None] | None = None,
    transform: Callable[[np.ndarray], np.ndarray] | None = None,
    exclude_bags: np.ndarray | None = None,
) -> TrainingSummary:
    """Fit ``model`` (any :class:`~mil_core.models.base.SparseGPMILBase` estimator) on the labelled bags
    of a cohort store, with the partition step running on the Dask cluster of ``client``.

    The fitted attributes are those of ``model.fit`` on the same data (equal to 1e-8).
    ``standardize`` (``None``: the model's own ``standardize``, as ``model.fit`` does; ``False``
    with a ``transform``) learns each feature's mean and std on the labelled bags as a map over
    partitions and a sum, trains on the standardised features and leaves them on the model
    (``feature_mean_`` / ``feature_scale_``, so its ``predict_*`` and :func:`predict_cohort` apply
    them; also returned as the summary's :class:`FeatureScaling`). Inducing
    points come from k-means on all training instances when there are at most
    ``max_kmeans_sample`` of them, else on a seeded sample of whole bags. ``mode="auto"`` keeps the
    prepared partitions in worker memory when they take less than ``memory_fraction`` of the
    memory that holds them (device memory on GPU workers: ``device_memory`` bytes per GPU, else
    CuPy's figure), else streams them from Zarr every iteration. ``device="gpu"`` (or ``"auto"``
    with workers advertising a ``GPU`` resource) keeps partition arrays in the array namespace
    ``gpu_namespace`` (:class:`~tasks.training.placement.ArrayPlacement`), every task that holds
    them asking for the GPU resource. ``compute_dtype="float32"``: float32 whitened features with
    float64 statistics (:class:`~tasks.training.placement.ArrayPlacement`). With ``resume`` a run that
    has a checkpoint continues from it (same model parameters and partitions required).
    ``on_iteration(i, objective)`` is called after each iteration (progress reporting).
    ``transform``: a fitted feature map the model trains on in place of the standardisation
    (:mod:`tasks.training.embedded`: a learnt embedding); such a fit does not resume.
    ``exclude_bags``: global bag indices kept out of training as if unlabelled (an embedding's
    inner validation bags).
    Holds the
    store's writer lease (:mod:`tasks.lease`): a concurrent writer of the store fails at once.
    """
    store = str(store)
    cohort = open_cohort(store)
    if uses_coords(model) and cohort.attrs.get("coords_meaning") == "instance_index":
        raise CohortError(f"{type(model).__name__} couples neighbouring instances, and the instances of {store} have no "
                         "positions (a table or .h5 files without coordinates: their order in a bag is no neighbourhood); use "
                         "VGPMILPR, or ingest them with their coordinates (a table's ingest.columns.coords, the .h5 'coords')")
    if standardize is None:
        standardize = transform is None and bool(getattr(model, "standardize", False))
    elif standardize and transform is not None:
        raise ValueError("standardize=True with a transform: the transform is the features' map; standardise inside it")
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    labels = np.asarray(cohort.bag_labels)
    labelled = np.flatnonzero(labels >= 0)
    if exclude_bags is not None:
        labelled = np.setdiff1d(labelled, exclude_bags)
    if np.unique(labels[labelled]).size < 2:
        found = np.unique(labels).tolist()
        hint = " (-1 marks an unlabelled bag in a store: a table labelled -1/+1 needs 0 for its negative bags)" if found == [-1, 1] else ""
        raise CohortError(f"cohort {store} needs labelled bags of both classes to train; bag labels found: {found}{hint}")
    sizes = np.diff(cohort.offsets)
    validation = np.empty(0, dtype=np.int64)
    if getattr(model, "early_stopping", False):  # AbSMIL has no validation hold-out
        _, val_positions = model._split_validation(labels[labelled])
        validation = labelled[val_positions]
    training = np.setdiff1d(labelled, validation)
    held_out = validation if exclude_bags is None else np.union1d(validation, exclude_bags)
    partitions = [p for p in cohort.partitions(partition_bytes) if np.any((training >= p.bag_start) & (training < p.bag_stop))]

    checkpoint = Checkpoint(store, run)
    latest = checkpoint.latest() if resume and transform is None else None
    if latest is not None:
        fitted, scaling = checkpoint.load_model(partitions)
        features = scaling
        restore_fitted_state(model, fitted, f"{store}/training/{run}")
        check_feature_dimension(model, cohort)
        if (scaling is not None) != standardize:
            raise CohortError(f"checkpoint {store}/training/{run} was written with standardize={not standardize}; {_afresh(f'{store}/training/{run}')}")
        try:
            updates = model._make_updates(getattr(model, "gp_", None))
        except AttributeError as error:  # a fitted attribute added since the checkpoint was written
            if error.obj is not model:
                raise
            raise CohortError(f"checkpoint {store}/training/{run} was written by an older gpmil: its {type(model).__name__} "
                              f"has no {error.name!r}, which this version needs to resume; {_afresh(f'{store}/training/{run}')}") from None
        log.info("resuming run %r of %s from iteration %d", run, store, latest)
    else:
        model._check_common_params(int(sizes[training].sum()))
        scaling = training_scaling(client, cohort, labelled, partition_bytes) if standardize else None
        features = scaling if transform is None else transform
        X_sample, sample_labels, sample_offsets, sample_coords = kmeans_sample(
            cohort, labels, training, max_kmeans_sample, model.random_state, features, with_coords=uses_coords(model))
        start = {}
        if getattr(model, "kernel", False) is None and sample_offsets[-1] < sizes[training].sum():  # the sample left bags
            picked = training[choice_bags(sizes[training], labels[training], model.random_state)]  # out: the choice's own, as in fit
            X_choice, choice_labels, choice_offsets, choice_coords = read_bags(cohort, labels, picked, features, uses_coords(model))
            start["choice"] = BagBlock(X=X_choice, offsets=choice_offsets, labels=choice_labels[choice_offsets[:-1]],
                                       coords=choice_coords)
        if getattr(model, "kernel", False) is None and resume and transform is None:  # a restarted run keeps the choice's finished splits
            start["choice_memo"] = memo = checkpoint.choice_memo()
            if len(memo):
                log.info("run %r of %s: the kernel choice resumes, %d of its splits recorded", run, store, len(memo))
        updates = model._start_fit(X_sample, sample_labels, offsets=sample_offsets, coords=sample_coords, **start)  # as model.fit
        checkpoint.save_model(model, partitions, features)

    placement = resolve_placement(client, device, gpu_namespace, compute_dtype)
    device = placement.kind
    mode = resolve_mode(client, cohort, model, mode, memory_fraction, placement, device_memory)
    log.info("training %s on %s: %d partitions, mode=%s, device=%s", type(model).__name__, store, len(partitions), mode, device)
    executor = DaskExecutor(
        client, updates, store, partitions, mode=mode, placement=placement, split_every=split_every, exclude_bags=held_out,
        locals_from=checkpoint if latest is not None else None, locals_iteration=latest, with_coords=uses_coords(model),
        scaling=features,
    )
    trace = checkpoint.load_trace(latest) if latest is not None else FitTrace(glob=updates.init_global())
    early = (DistributedEarlyStopping(client, model, store, cohort, labels, validation, partition_bytes, placement, features)
             if validation.size else None)

    def monitor(iteration: int, glob: Any) -> bool:
        if on_iteration is not None:
            on_iteration(iteration, trace.objective[-1])
        if iteration % checkpoint_every == 0 or trace.converged or iteration == max_iter:
            executor.checkpoint(checkpoint, trace)
        return early(iteration, glob) if early is not None else False

    # kernel=None also chooses the stop; it ends the run as in model.fit (no ConvergenceWarning there,
    # one at a user's max_iter before tol).
    max_iter, stop = sweep_budget(model, monitor)
    optimise(executor.sweep, updates, trace.glob, max_iter=max_iter, tol=model.tol, monitor=stop, resume_from=trace)
    model._finish_fit(trace, early.stopping if early is not None else None)
    if scaling is not None:  # in model.fit's units: its predict_* standardise as after model.fit
        model.feature_mean_, model.feature_scale_ = scaling.mean, scaling.scale
    return TrainingSummary(
        store=store, run=run, n_partitions=len(partitions), n_bags=int(training.size), n_instances=int(sizes[training].sum()),
        mode=mode, device=device, n_iter=trace.n_iter, resumed_from=latest, scaling=scaling,
    )


def training_scaling(client: Client, cohort, bags: np.ndarray, partition_bytes: int) -> FeatureScaling:
    """The standardisation of ``model.fit`` on ``bags`` (global indices of the labelled bags it is
    given): it standardises every row it is given, its validation bags' too."""
    partitions = [p for p in cohort.partitions(partition_bytes) if np.any((bags >= p.bag_start) & (bags < p.bag_stop))]
    return feature_scaling(client, str(cohort.path), partitions, np.setdiff1d(np.arange(cohort.n_bags), bags))


def check_feature_dimension(model: SparseGPMILBase, cohort) -> None:
    if cohort.n_features != model.n_features_in_:
        raise CohortError(
            f"cohort {cohort.path} has {cohort.n_features} features per instance, but the model was trained on "
            f"{model.n_features_in_}; use a store made with the same feature extractor"
        )


def restore_fitted_state(model: SparseGPMILBase, fitted: SparseGPMILBase, where: str) -> None:
    """Take the start state (kernel and inducing points; AbSMIL's random features) from a
    checkpointed estimator of the same configuration."""
    ignore = ("max_iter", "tol")
    mine = {k: repr(v) for k, v in model.get_params().items() if k not in ignore}
    theirs = {k: repr(v) for k, v in fitted.get_params().items() if k not in ignore}
    if type(model) is not type(fitted) or mine != theirs:
        changed = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)) or ["model class"]
        raise CohortError(f"checkpoint {where} was written by another model configuration ({', '.join(changed)} differ); {_afresh(where)}")
    for name, value in vars(fitted).items():  # saved right after _start_fit: its fitted attributes are the start state
        if name.endswith("_") and not name.startswith("_"):
            setattr(model, name, value)
