"""Distributed training and prediction over a cohort store, on Dask (DESIGN §4).

One fit iteration is the engine's map → sum → small solve, with the map on the cluster:

1. ``q`` (the current global state) enters the graph once per iteration;
2. ``partition-step`` runs the model's :meth:`partition_step` on every partition of whole bags,
   with that partition's local state (π, ξ, …), which stays on the worker between iterations;
3. ``sum-statistics`` tree-reduces the M×M / M statistics (``split_every`` at a time);
4. the client runs the model's :meth:`global_update` (an M×M Cholesky solve).

The executor only uses the model's :class:`~mil_core.engine.PartitionUpdates`, so every model
whose fit has that form runs unchanged. Partition features are either loaded once and kept on the
workers (``mode="persist"``) or read from Zarr inside every step (``mode="stream"``) when they would
not fit in cluster memory. Tasks are submitted as futures, never as a fused graph, so the ``GPU``
resource annotation of GPU tasks cannot be dropped by graph optimisation.

Fault tolerance: every task is a pure function of its inputs, so a lost worker's results are
recomputed by the scheduler. Every ``checkpoint_every`` iterations the workers write their local
state and the client writes q, the objective trace and the fitted kernel/inducing points to
``<store>/training/<run>/``; a fit started again with the same ``run`` resumes from there.
"""

from __future__ import annotations

import logging
import operator
import pickle
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import reduce
from pathlib import Path
from typing import Any, Literal

import numpy as np
import zarr
from distributed import Client, Future, as_completed, wait

from mil_core.models.base import SparseGPMILBase, take_bags
from mil_core.engine import BagBlock, FitTrace, PartitionUpdates, optimise
from tasks.store import Partition, open_cohort

__all__ = ["DaskExecutor", "TrainingSummary", "fit_cohort", "predict_cohort", "read_predictions"]

log = logging.getLogger("gpmil.training")

Device = Literal["auto", "cpu", "gpu"]
Mode = Literal["auto", "persist", "stream"]
DEFAULT_PARTITION_BYTES = 128 * 2**20


# ------------------------------------------------------------------------------ partition tasks
@dataclass(frozen=True)
class FeatureScaling:
    """Per-feature standardisation ``(x − mean) / scale`` learnt on a training cohort and applied
    to every cohort the model sees (handcrafted features differ in scale by orders of magnitude;
    an isotropic RBF kernel needs them comparable)."""

    mean: np.ndarray
    scale: np.ndarray

    def __call__(self, X: np.ndarray) -> np.ndarray:
        return (X - self.mean) / self.scale


def _read_features(stored: Any, scaling: FeatureScaling | None) -> np.ndarray:
    X = np.asarray(stored.features, dtype=np.float64)
    return X if scaling is None else scaling(X)


def _feature_sums(path: str, partition: Partition, exclude_bags: np.ndarray) -> np.ndarray:
    """``[n, Σx, Σx²]`` over the labelled, non-excluded bags of one partition."""
    X = load_block(path, partition, "cpu", exclude_bags).X
    return np.concatenate([[X.shape[0]], X.sum(axis=0), (X * X).sum(axis=0)])


def feature_scaling(client: Client, path: str, partitions: Sequence[Partition], exclude_bags: np.ndarray) -> FeatureScaling:
    """Mean and std of every feature over the training bags, as a map over partitions and a sum
    (features whose std is 0 keep scale 1)."""
    sums = client.submit(_sum_statistics, *[client.submit(_feature_sums, path, p, exclude_bags, pure=False) for p in partitions]).result()
    n, D = sums[0], (sums.shape[0] - 1) // 2
    mean = sums[1 : D + 1] / n
    std = np.sqrt(np.maximum(sums[D + 1 :] / n - mean**2, 0.0))
    return FeatureScaling(mean=mean, scale=np.where(std > 1e-12 * np.maximum(np.abs(mean), 1.0), std, 1.0))


def load_block(path: str, partition: Partition, device: str, exclude_bags: np.ndarray | None = None,
               with_coords: bool = False, scaling: FeatureScaling | None = None) -> BagBlock:
    """The labelled bags of ``partition`` as an engine block (float64; on the GPU for ``device="gpu"``).

    Unlabelled bags (label −1) and the bags in ``exclude_bags`` (global indices, e.g. a validation
    hold-out) are left out. ``with_coords`` adds the instance coordinates (VGPMIL-PR-I's neighbour
    graph); ``scaling`` standardises the features.
    """
    stored = open_cohort(path).read_partition(partition)
    labels = np.asarray(stored.bag_labels)
    keep = labels >= 0
    if exclude_bags is not None and exclude_bags.size:
        keep &= ~np.isin(np.arange(partition.bag_start, partition.bag_stop), exclude_bags)
    kept = np.flatnonzero(keep)
    offsets = np.asarray(stored.offsets)
    X, new_offsets = take_bags(_read_features(stored, scaling), offsets, kept)
    coords = take_bags(np.asarray(stored.coords), offsets, kept)[0] if with_coords else None
    return BagBlock(X=_to_device(X, device), offsets=new_offsets, labels=labels[kept].astype(np.int8), coords=coords)


def uses_coords(model: SparseGPMILBase) -> bool:
    """Whether the model reads instance coordinates (it overrides the base class's refusal)."""
    return type(model)._check_coords is not SparseGPMILBase._check_coords


def _to_device(X: np.ndarray, device: str) -> Any:
    if device == "gpu":
        import cupy

        return cupy.asarray(X)
    return X


def _prepare(updates: PartitionUpdates, path: str, partition: Partition, device: str, exclude: np.ndarray | None,
             with_coords: bool, scaling: FeatureScaling | None) -> Any:
    return updates.prepare(load_block(path, partition, device, exclude, with_coords, scaling))


def _init_local(updates: PartitionUpdates, block: Any) -> Any:
    return updates.init_local(block)


def _stream_init_local(updates: PartitionUpdates, path: str, partition: Partition, device: str, exclude: np.ndarray | None,
                       with_coords: bool, scaling: FeatureScaling | None) -> Any:
    return updates.init_local(_prepare(updates, path, partition, device, exclude, with_coords, scaling))


def _partition_step(updates: PartitionUpdates, block: Any, local: Any, glob: Any) -> tuple[Any, Any]:
    return updates.partition_step(block, local, glob)


def _stream_partition_step(
    updates: PartitionUpdates, path: str, partition: Partition, device: str, exclude: np.ndarray | None, with_coords: bool,
    scaling: FeatureScaling | None, local: Any, glob: Any,
) -> tuple[Any, Any]:
    return updates.partition_step(_prepare(updates, path, partition, device, exclude, with_coords, scaling), local, glob)


def _sum_statistics(*stats: Any) -> Any:
    return reduce(operator.add, stats)


def _value(x: Any) -> Any:
    return x


def _bag_scores(model: SparseGPMILBase, block: BagBlock, glob: Any) -> np.ndarray:
    """Validation bag probabilities of one partition's hold-out block under ``glob``."""
    coords = {} if block.coords is None else {"coords": block.coords}
    return model._bag_proba_from_state(model.gp_, glob, block.X, block.offsets, **coords)


# --------------------------------------------------------------------------------- checkpoints
class Checkpoint:
    """``<store>/training/<run>/``: ``model`` (the estimator with its kernel and inducing points,
    pickled), ``it<k>/{state, objective, local/<partition>}``; the attribute ``latest`` is
    written last, so a checkpoint is visible only once complete. Pickles are read back only from
    the store the run itself wrote."""

    def __init__(self, store: str, run: str):
        self.store, self.run = store, run

    def _group(self) -> zarr.Group:
        return zarr.open_group(self.store, mode="a").require_group(f"training/{self.run}")

    def latest(self) -> int | None:
        root = zarr.open_group(self.store, mode="r")
        name = f"training/{self.run}"
        return root[name].attrs.get("latest") if name in root else None

    def save_model(self, model: SparseGPMILBase, partitions: Sequence[Partition], scaling: FeatureScaling | None) -> None:
        group = self._group()
        _write_bytes(group, "model", pickle.dumps((model, scaling)))
        group.attrs.update({"partitions": [[p.bag_start, p.bag_stop] for p in partitions], "latest": None})

    def load_model(self, partitions: Sequence[Partition]) -> tuple[SparseGPMILBase, FeatureScaling | None]:
        group = self._group()
        saved = [tuple(b) for b in group.attrs["partitions"]]
        if saved != [(p.bag_start, p.bag_stop) for p in partitions]:
            raise ValueError(
                f"checkpoint {self.store}/training/{self.run} was written with other partitions; "
                "resume with the same partition_bytes or start a new run"
            )
        return pickle.loads(_read_bytes(group, "model"))

    def begin(self, iteration: int) -> None:
        """Client side, before the workers write: create the iteration's groups once."""
        self._group().require_group(f"it{iteration}/local")

    def save_local(self, iteration: int, index: int, local: Any) -> int:
        """Worker side: one partition's local state (distinct arrays per partition: safe in parallel)."""
        group = zarr.open_group(self.store, mode="a")[f"training/{self.run}/it{iteration}/local"]
        _write_bytes(group, str(index), pickle.dumps(local))
        return index

    def load_local(self, iteration: int, index: int) -> Any:
        group = zarr.open_group(self.store, mode="r")[f"training/{self.run}/it{iteration}/local"]
        return pickle.loads(_read_bytes(group, str(index)))

    def commit(self, trace: FitTrace) -> None:
        """Client side: the global state (q, and the learnt kernel when hyper-parameters are learnt)
        and the objective trace, then ``latest`` (the commit), then old iterations go."""
        group = self._group()
        it = group.require_group(f"it{trace.n_iter}")
        _write_bytes(it, "state", pickle.dumps(trace.glob))
        it.create_array("objective", data=np.asarray(trace.objective, dtype=np.float64), overwrite=True)
        it.attrs["converged"] = bool(trace.converged)
        previous = group.attrs.get("latest")
        group.attrs["latest"] = trace.n_iter
        if previous is not None and previous != trace.n_iter:
            del group[f"it{previous}"]

    def load_trace(self, iteration: int) -> FitTrace:
        it = zarr.open_group(self.store, mode="r")[f"training/{self.run}/it{iteration}"]
        return FitTrace(glob=pickle.loads(_read_bytes(it, "state")), objective=list(it["objective"][:]), n_iter=iteration,
                        converged=bool(it.attrs["converged"]))


def _write_bytes(group: zarr.Group, name: str, payload: bytes) -> None:
    group.create_array(name, data=np.frombuffer(payload, dtype=np.uint8), overwrite=True)


def _read_bytes(group: zarr.Group, name: str) -> bytes:
    return group[name][:].tobytes()


def _save_local(checkpoint: Checkpoint, iteration: int, index: int, local: Any) -> int:
    return checkpoint.save_local(iteration, index, local)


def _load_local(checkpoint: Checkpoint, iteration: int, index: int) -> Any:
    return checkpoint.load_local(iteration, index)


# ------------------------------------------------------------------------------------ executor
class DaskExecutor:
    """Runs a model's partition step over the partitions of a cohort store on a Dask cluster.

    The counterpart of :class:`mil_core.engine.SerialExecutor`: :meth:`sweep` maps the step
    over partitions, keeps each partition's new local state on the cluster, tree-reduces the
    statistics and returns their sum (NumPy) to the client.
    """

    def __init__(
        self,
        client: Client,
        updates: PartitionUpdates,
        store: str,
        partitions: Sequence[Partition],
        *,
        mode: Literal["persist", "stream"],
        device: Literal["cpu", "gpu"] = "cpu",
        split_every: int = 8,
        exclude_bags: np.ndarray | None = None,
        locals_from: Checkpoint | None = None,
        locals_iteration: int | None = None,
        with_coords: bool = False,
        scaling: FeatureScaling | None = None,
    ):
        if split_every < 2:
            raise ValueError(f"split_every must be >= 2, got {split_every}")
        self.client, self.store, self.partitions = client, store, list(partitions)
        self.mode, self.device, self.split_every = mode, device, split_every
        self.exclude, self.with_coords, self.scaling = exclude_bags, with_coords, scaling
        self.token = uuid.uuid4().hex[:8]
        self.resources = {"GPU": 1} if device == "gpu" else None
        self.iteration = locals_iteration or 0
        self._restore_from: tuple[Checkpoint, int] | None = None
        self.updates = self._submit(_value, updates, key=f"model-updates-{self.token}")
        if mode == "persist":
            self.blocks = [
                self._submit(_prepare, self.updates, store, p, device, self.exclude, with_coords, scaling, key=f"load-partition-{p.index}-{self.token}")
                for p in self.partitions
            ]
        if locals_from is not None:
            self.locals = [self._restore_local(locals_from, locals_iteration, p) for p in self.partitions]
        elif mode == "persist":
            self.locals = [
                self._submit(_init_local, self.updates, b, key=f"init-local-{p.index}-{self.token}")
                for p, b in zip(self.partitions, self.blocks)
            ]
        else:
            self.locals = [
                self._submit(_stream_init_local, self.updates, store, p, device, self.exclude, with_coords, scaling, key=f"init-local-{p.index}-{self.token}")
                for p in self.partitions
            ]

    def _submit(self, fn: Callable, *args: Any, key: str) -> Future:
        return self.client.submit(fn, *args, key=key, pure=False, resources=self.resources)

    def _restore_local(self, checkpoint: Checkpoint, iteration: int, p: Partition) -> Future:
        return self._submit(_load_local, checkpoint, iteration, p.index, key=f"restore-local-{iteration}-{p.index}-{self.token}")

    def sweep(self, glob: Any) -> Any:
        """One map + tree reduction with the global state ``glob``; returns the summed statistics."""
        self.iteration += 1
        it, token = self.iteration, self.token
        if self._restore_from is not None:
            checkpoint, saved = self._restore_from
            self.locals = [self._restore_local(checkpoint, saved, p) for p in self.partitions]
            self._restore_from = None
        q = self.client.submit(_value, glob, key=f"q-{it}-{token}", pure=False)
        results = []
        for i, p in enumerate(self.partitions):
            key = f"partition-step-{it}-{p.index}-{token}"
            if self.mode == "persist":
                results.append(self._submit(_partition_step, self.updates, self.blocks[i], self.locals[i], q, key=key))
            else:
                results.append(
                    self._submit(
                        _stream_partition_step, self.updates, self.store, p, self.device, self.exclude, self.with_coords, self.scaling,
                        self.locals[i], q, key=key,
                    )
                )
        stats = [self.client.submit(operator.getitem, r, 0, key=f"statistics-{it}-{i}-{token}") for i, r in enumerate(results)]
        self.locals = [self.client.submit(operator.getitem, r, 1, key=f"local-{it}-{i}-{token}") for i, r in enumerate(results)]
        level = 0
        while len(stats) > 1:
            level += 1
            stats = [
                self.client.submit(_sum_statistics, *stats[j : j + self.split_every], key=f"sum-statistics-{it}-{level}-{j}-{token}")
                for j in range(0, len(stats), self.split_every)
            ]
        return stats[0].result()

    def checkpoint(self, checkpoint: Checkpoint, trace: FitTrace) -> None:
        """Write every partition's local state (on the workers) and commit q and the trace; then
        continue from the written local state, which cuts the recomputation lineage."""
        it = trace.n_iter
        checkpoint.begin(it)
        saved = [
            self.client.submit(_save_local, checkpoint, it, p.index, local, key=f"checkpoint-{it}-{p.index}-{self.token}", pure=False)
            for p, local in zip(self.partitions, self.locals)
        ]
        wait(saved)
        for future in saved:
            future.result()  # raise a worker's write error here
        checkpoint.commit(trace)
        self._restore_from = (checkpoint, it)


# ----------------------------------------------------------------------------------------- fit
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


def fit_cohort(
    model: SparseGPMILBase,
    store: str | Path,
    client: Client,
    *,
    run: str = "default",
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
    mode: Mode = "auto",
    device: Device = "auto",
    checkpoint_every: int = 5,
    resume: bool = True,
    split_every: int = 8,
    max_kmeans_sample: int = 200_000,
    memory_fraction: float = 0.5,
    standardize: bool = False,
    on_iteration: Callable[[int, float], None] | None = None,
) -> TrainingSummary:
    """Fit ``model`` (any :class:`~mil_core.models.base.SparseGPMILBase` estimator) on the labelled bags
    of a cohort store, with the partition step running on the Dask cluster of ``client``.

    The fitted attributes are those of ``model.fit`` on the same data (equal to 1e-8). Inducing
    points come from k-means on all training instances when there are at most
    ``max_kmeans_sample`` of them, else on a seeded sample of whole bags. ``mode="auto"`` keeps the
    prepared partitions in worker memory when they take less than ``memory_fraction`` of the
    cluster's memory, else streams them from Zarr every iteration. ``standardize`` learns a
    :class:`FeatureScaling` on the training bags (returned in the summary; pass it to
    :func:`predict_cohort`). With ``resume`` a run that
    has a checkpoint continues from it (same model parameters and partitions required).
    ``on_iteration(i, objective)`` is called after each iteration (progress reporting).
    """
    store = str(store)
    cohort = open_cohort(store)
    if checkpoint_every < 1:
        raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every}")
    labels = np.asarray(cohort.bag_labels)
    labelled = np.flatnonzero(labels >= 0)
    if np.unique(labels[labelled]).size < 2:
        raise ValueError(f"cohort {store} needs labelled bags of both classes to train; bag labels found: {np.unique(labels).tolist()}")
    sizes = np.diff(cohort.offsets)
    validation = np.empty(0, dtype=np.int64)
    if model.early_stopping:
        _, val_positions = model._split_validation(labels[labelled])
        validation = labelled[val_positions]
    training = np.setdiff1d(labelled, validation)
    partitions = [p for p in cohort.partitions(partition_bytes) if np.any((training >= p.bag_start) & (training < p.bag_stop))]

    checkpoint = Checkpoint(store, run)
    latest = checkpoint.latest() if resume else None
    if latest is not None:
        fitted, scaling = checkpoint.load_model(partitions)
        _restore_fitted_state(model, fitted, f"{store}/training/{run}")
        _check_feature_dimension(model, cohort)
        if (scaling is not None) != standardize:
            raise ValueError(f"checkpoint {store}/training/{run} was written with standardize={not standardize}; use a new run name")
        updates = model._make_updates(model.gp_)
        log.info("resuming run %r of %s from iteration %d", run, store, latest)
    else:
        model._check_common_params(int(sizes[training].sum()))
        excluded = np.setdiff1d(np.arange(cohort.n_bags), training)
        scaling = feature_scaling(client, store, partitions, excluded) if standardize else None
        X_sample, sample_labels = _kmeans_sample(cohort, labels, training, max_kmeans_sample, model.random_state, scaling)
        updates = model._start_fit(X_sample, sample_labels)
        checkpoint.save_model(model, partitions, scaling)

    device = _resolve_device(client, device)
    mode = _resolve_mode(client, cohort, model, mode, memory_fraction)
    log.info("training %s on %s: %d partitions, mode=%s, device=%s", type(model).__name__, store, len(partitions), mode, device)
    executor = DaskExecutor(
        client, updates, store, partitions, mode=mode, device=device, split_every=split_every, exclude_bags=validation,
        locals_from=checkpoint if latest is not None else None, locals_iteration=latest, with_coords=uses_coords(model),
        scaling=scaling,
    )
    trace = checkpoint.load_trace(latest) if latest is not None else FitTrace(glob=updates.init_global())
    early = (_DistributedEarlyStopping(client, model, store, cohort, labels, validation, partition_bytes, device, scaling)
             if validation.size else None)

    def monitor(iteration: int, glob: Any) -> bool:
        if on_iteration is not None:
            on_iteration(iteration, trace.objective[-1])
        if iteration % checkpoint_every == 0 or trace.converged or iteration == model.max_iter:
            executor.checkpoint(checkpoint, trace)
        return early(iteration, glob) if early is not None else False

    optimise(executor.sweep, updates, trace.glob, max_iter=model.max_iter, tol=model.tol, monitor=monitor, resume_from=trace)
    model._finish_fit(trace, early.stopping if early is not None else None)
    return TrainingSummary(
        store=store, run=run, n_partitions=len(partitions), n_bags=int(training.size), n_instances=int(sizes[training].sum()),
        mode=mode, device=device, n_iter=trace.n_iter, resumed_from=latest, scaling=scaling,
    )


def _check_feature_dimension(model: SparseGPMILBase, cohort) -> None:
    if cohort.n_features != model.n_features_in_:
        raise ValueError(
            f"cohort {cohort.path} has {cohort.n_features} features per instance, but the model was trained on "
            f"{model.n_features_in_}; use a store made with the same feature extractor"
        )


def _restore_fitted_state(model: SparseGPMILBase, fitted: SparseGPMILBase, where: str) -> None:
    """Take kernel and inducing points from a checkpointed estimator of the same configuration."""
    ignore = ("max_iter", "tol")
    mine = {k: repr(v) for k, v in model.get_params().items() if k not in ignore}
    theirs = {k: repr(v) for k, v in fitted.get_params().items() if k not in ignore}
    if type(model) is not type(fitted) or mine != theirs:
        changed = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)) or ["model class"]
        raise ValueError(f"checkpoint {where} was written by another model configuration ({', '.join(changed)} differ); use a new run name")
    for name in ("n_features_in_", "classes_", "kernel_", "gp_"):
        setattr(model, name, getattr(fitted, name))


class _DistributedEarlyStopping:
    """Validation bag-AUC early stopping (as ``model.fit`` does), the hold-out bags scored on the
    workers where they are kept."""

    def __init__(self, client: Client, model: SparseGPMILBase, store: str, cohort, labels: np.ndarray,
                 validation: np.ndarray, partition_bytes: int, device: str, scaling: FeatureScaling | None):
        from sklearn.metrics import roc_auc_score

        from mil_core.models.base import _EarlyStopping

        self.client = client
        self.model = client.submit(_value, model, pure=False)
        self.blocks, order = [], []
        for p in cohort.partitions(partition_bytes):
            held_out = validation[(validation >= p.bag_start) & (validation < p.bag_stop)]
            if held_out.size:
                others = np.setdiff1d(np.arange(p.bag_start, p.bag_stop), held_out)
                self.blocks.append(client.submit(load_block, store, p, device, others, uses_coords(model), scaling, pure=False))
                order.append(held_out)
        truth = labels[np.concatenate(order)]
        self.stopping = _EarlyStopping(score=lambda glob: roc_auc_score(truth, self._scores(glob)), patience=model.n_iter_no_change)

    def _scores(self, glob: Any) -> np.ndarray:
        q = self.client.submit(_value, glob, pure=False)
        return np.concatenate(self.client.gather([self.client.submit(_bag_scores, self.model, b, q, pure=False) for b in self.blocks]))

    def __call__(self, iteration: int, glob: Any) -> bool:
        return self.stopping(iteration, glob)


def _kmeans_sample(cohort, labels: np.ndarray, training: np.ndarray, cap: int, random_state,
                   scaling: FeatureScaling | None) -> tuple[np.ndarray, np.ndarray]:
    """Instances (labelled by their bag's label) for k-means: every training instance, in store
    order, when there are at most ``cap``; else a seeded sample of whole training bags."""
    sizes = np.diff(cohort.offsets)
    chosen = training
    if sizes[training].sum() > cap:
        rng = np.random.default_rng(random_state if isinstance(random_state, (int, np.integer)) else None)
        shuffled = rng.permutation(training)
        chosen = np.sort(shuffled[: max(1, int(np.searchsorted(np.cumsum(sizes[shuffled]), cap)))])
    X, y = [], []
    for p in cohort.partitions(DEFAULT_PARTITION_BYTES):
        local = chosen[(chosen >= p.bag_start) & (chosen < p.bag_stop)] - p.bag_start
        if local.size:
            stored = cohort.read_partition(p)
            rows, offsets = take_bags(_read_features(stored, scaling), np.asarray(stored.offsets), local)
            X.append(rows)
            y.append(np.repeat(labels[local + p.bag_start], np.diff(offsets)))
    return np.concatenate(X), np.concatenate(y)


def _worker_resources(client: Client) -> list[dict[str, float]]:
    return [w.get("resources", {}) for w in client.scheduler_info(n_workers=-1)["workers"].values()]


def _resolve_device(client: Client, device: Device) -> str:
    has_gpu = any(r.get("GPU", 0) > 0 for r in _worker_resources(client))
    if device == "auto":
        return "gpu" if has_gpu else "cpu"
    if device == "gpu" and not has_gpu:
        raise ValueError("device='gpu' but no worker advertises a GPU resource (start workers with --resources GPU=1, see infra/)")
    return device


def _resolve_mode(client: Client, cohort, model: SparseGPMILBase, mode: Mode, memory_fraction: float) -> str:
    if mode != "auto":
        if mode not in ("persist", "stream"):
            raise ValueError(f"mode must be 'auto', 'persist' or 'stream', got {mode!r}")
        return mode
    per_instance = 8 * (model.n_inducing + 4)  # whitened features a'ₙ, FITC residual, local state
    limits = [w.get("memory_limit") or 0 for w in client.scheduler_info(n_workers=-1)["workers"].values()]
    memory = sum(limits) if all(limits) else None
    needed = per_instance * cohort.n_instances
    return "persist" if memory is None or needed <= memory_fraction * memory else "stream"


# ---------------------------------------------------------------------------------- prediction
def _predict_partition(model: SparseGPMILBase, store: str, partition: Partition, device: str, scaling: FeatureScaling | None,
                       instance_kwargs: dict, bag_kwargs: dict):
    stored = open_cohort(store).read_partition(partition)
    X = _to_device(_read_features(stored, scaling), device)
    bag_of_row = np.repeat(np.arange(partition.bag_start, partition.bag_stop), np.diff(np.asarray(stored.offsets)))
    coords = {"coords": np.asarray(stored.coords)} if uses_coords(model) else {}
    instance_scores = getattr(model, "predict_instance_proba", None) or model.predict_instance_evidence
    p_inst, sd_inst = instance_scores(X, return_std=True, **instance_kwargs)
    _, p_bag, sd_bag = model.predict_bag_proba(X, bag_of_row, return_std=True, **bag_kwargs, **coords)
    return partition, p_inst, sd_inst, p_bag, sd_bag


def predict_cohort(
    model: SparseGPMILBase,
    store: str | Path,
    client: Client,
    *,
    run: str = "default",
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
    device: Device = "auto",
    scaling: FeatureScaling | None = None,
    instance_kwargs: dict | None = None,
    bag_kwargs: dict | None = None,
) -> str:
    """Predict every bag of the store on the cluster and write ``predictions/<run>/`` (instance
    and bag probability and std; the ``complete`` attribute is set last). Returns the group path.

    Models without instance probabilities (VWSGP, whose per-instance evidences are not instance
    labels, seed 001 §3) write ``instances/evidence`` instead of ``instances/proba``.

    Each partition is predicted by one task; the client writes the results (one writer, so
    partitions that share a Zarr chunk cannot race). ``scaling``: the training cohort's
    :class:`FeatureScaling` when the model was trained with ``standardize=True``.
    """
    store = str(store)
    cohort = open_cohort(store)
    _check_feature_dimension(model, cohort)
    device = _resolve_device(client, device)
    root = zarr.open_group(store, mode="a")
    name = f"predictions/{run}"
    if name in root:
        del root[name]
    group = root.require_group(name)
    group.attrs.update({"complete": False, "model": type(model).__name__, "params": _jsonable(model.get_params())})
    instance_name = "instances/proba" if hasattr(model, "predict_instance_proba") else "instances/evidence"
    group.attrs["instance_scores"] = instance_name.split("/")[1]
    arrays = {
        instance_name: cohort.n_instances,
        "instances/std": cohort.n_instances,
        "bags/proba": cohort.n_bags,
        "bags/std": cohort.n_bags,
    }
    out = {
        k: group.create_array(k, shape=(n,), dtype=np.float64, chunks=(min(max(n, 1), 1 << 20),), fill_value=np.nan)
        for k, n in arrays.items()
    }
    model_future = client.submit(_value, model, pure=False)
    futures = [
        client.submit(
            _predict_partition, model_future, store, p, device, scaling, instance_kwargs or {}, bag_kwargs or {},
            key=f"predict-partition-{p.index}-{uuid.uuid4().hex[:8]}", resources={"GPU": 1} if device == "gpu" else None,
        )
        for p in cohort.partitions(partition_bytes)
    ]
    for future in as_completed(futures):
        p, p_inst, sd_inst, p_bag, sd_bag = future.result()
        rows, bags = slice(p.row_start, p.row_stop), slice(p.bag_start, p.bag_stop)
        out[instance_name][rows], out["instances/std"][rows] = p_inst, sd_inst
        out["bags/proba"][bags], out["bags/std"][bags] = p_bag, sd_bag
    group.attrs["complete"] = True
    return f"{store}/{name}"


def read_predictions(store: str | Path, run: str = "default") -> dict[str, np.ndarray]:
    """The predictions of ``run`` as arrays (``instances/proba`` or ``instances/evidence``,
    ``instances/std``, ``bags/proba``, ``bags/std``); raises if that prediction did not complete."""
    group = zarr.open_group(str(store), mode="r")[f"predictions/{run}"]
    if not group.attrs.get("complete"):
        raise RuntimeError(f"predictions/{run} in {store} is incomplete (the prediction was interrupted); predict again")
    names = ("instances/proba", "instances/evidence", "instances/std", "bags/proba", "bags/std")
    return {k: group[k][:] for k in names if k in group}


def _jsonable(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v) for k, v in params.items()}
