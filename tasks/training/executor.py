"""The Dask executor of one fit iteration (DESIGN §4): the engine's map → sum → small solve, with
the map on the cluster.

1. ``q`` (the current global state) enters the graph once per iteration;
2. ``partition-step`` runs the model's :meth:`partition_step` on every partition of whole bags,
   with that partition's local state (π, ξ, …), which stays on the worker between iterations;
3. ``sum-statistics`` tree-reduces the M×M / M statistics (``split_every`` at a time);
4. the client runs the model's :meth:`global_update` (an M×M Cholesky solve).

The executor only uses the model's :class:`~mil_core.engine.PartitionUpdates`, so every model
whose fit has that form runs unchanged. Partition features are either loaded once and kept on the
workers (``mode="persist"``) or read from Zarr inside every step (``mode="stream"``) when they would
not fit in cluster memory (a step the model answers from the local state alone, such as a learnt
prior mean's probe, reads nothing: :func:`mil_core.engine.step_from_local`). Tasks are submitted
as futures, never as a fused graph, so the ``GPU`` resource annotation of GPU tasks cannot be
dropped by graph optimisation.

Fault tolerance: every task is a pure function of its inputs, so a lost worker's results are
recomputed by the scheduler; :meth:`DaskExecutor.checkpoint` writes the local state and cuts
that lineage.
"""

from __future__ import annotations

import operator
import uuid
from collections.abc import Callable, Sequence
from functools import reduce
from typing import Any, Literal

import numpy as np
from distributed import Client, Future, wait

from mil_core.engine import FitTrace, PartitionUpdates, step_from_local
from tasks.store import Partition
from tasks.training.blocks import FeatureScaling, load_block
from tasks.training.checkpoint import Checkpoint, _load_local, _save_local
from tasks.training.placement import ArrayPlacement


def _prepare(updates: PartitionUpdates, path: str, partition: Partition, placement: ArrayPlacement, exclude: np.ndarray | None,
             with_coords: bool, scaling: FeatureScaling | None) -> Any:
    return updates.prepare(load_block(path, partition, placement, exclude, with_coords, scaling))


def _init_local(updates: PartitionUpdates, block: Any) -> Any:
    return updates.init_local(block)


def _stream_init_local(updates: PartitionUpdates, path: str, partition: Partition, placement: ArrayPlacement, exclude: np.ndarray | None,
                       with_coords: bool, scaling: FeatureScaling | None) -> Any:
    return updates.init_local(_prepare(updates, path, partition, placement, exclude, with_coords, scaling))


def _partition_step(updates: PartitionUpdates, block: Any, local: Any, glob: Any) -> tuple[Any, Any]:
    return updates.partition_step(block, local, glob)


def _stream_partition_step(
    updates: PartitionUpdates, path: str, partition: Partition, placement: ArrayPlacement, exclude: np.ndarray | None, with_coords: bool,
    scaling: FeatureScaling | None, local: Any, glob: Any,
) -> tuple[Any, Any]:
    from_local = step_from_local(updates, local, glob)  # e.g. a probe that needs no features: nothing read
    if from_local is not None:
        return from_local
    return updates.partition_step(_prepare(updates, path, partition, placement, exclude, with_coords, scaling), local, glob)


def sum_statistics(*stats: Any) -> Any:
    return reduce(operator.add, stats)


def identity(x: Any) -> Any:
    return x



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
        placement: ArrayPlacement | None = None,
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
        self.placement = placement or ArrayPlacement()
        self.mode, self.split_every = mode, split_every
        self.exclude, self.with_coords, self.scaling = exclude_bags, with_coords, scaling
        self.token = uuid.uuid4().hex[:8]
        self.resources = self.placement.resources
        self.homes = self._homes()
        self.iteration = locals_iteration or 0
        self._restore_from: tuple[Checkpoint, int] | None = None
        self.updates = self._submit(identity, updates, key=f"model-updates-{self.token}")
        if mode == "persist":
            self.blocks = [
                self._submit(_prepare, self.updates, store, p, self.placement, self.exclude, with_coords, scaling, key=f"load-partition-{p.index}-{self.token}",
                             home=i)
                for i, p in enumerate(self.partitions)
            ]
        if locals_from is not None:
            self.locals = [self._restore_local(locals_from, locals_iteration, i) for i in range(len(self.partitions))]
        elif mode == "persist":
            self.locals = [
                self._submit(_init_local, self.updates, b, key=f"init-local-{p.index}-{self.token}", home=i)
                for i, (p, b) in enumerate(zip(self.partitions, self.blocks))
            ]
        else:
            self.locals = [
                self._submit(_stream_init_local, self.updates, store, p, self.placement, self.exclude, with_coords, scaling,
                             key=f"init-local-{p.index}-{self.token}", home=i)
                for i, p in enumerate(self.partitions)
            ]

    def _homes(self) -> list[str | None]:
        """The worker each partition is placed on: round-robin over the workers that can run its
        tasks (those with the placement's resources), in partition order. A scheduler left to
        itself may load 5 partitions on one worker and 3 on the other (8 partitions, 2 workers:
        1.6× instead of 2×); a partition's load, local state and steps all go to its home, which
        is only a preference (``allow_other_workers``): a lost worker's partitions are recomputed
        elsewhere, and workers that join later get work by stealing."""
        workers = self.client.scheduler_info(n_workers=-1)["workers"]
        eligible = sorted(address for address, w in workers.items()
                          if all(w.get("resources", {}).get(name, 0) >= amount for name, amount in (self.resources or {}).items()))
        return [eligible[i % len(eligible)] if eligible else None for i in range(len(self.partitions))]

    def _submit(self, fn: Callable, *args: Any, key: str, home: int | None = None) -> Future:
        where = {} if home is None or self.homes[home] is None else {"workers": [self.homes[home]], "allow_other_workers": True}
        return self.client.submit(fn, *args, key=key, pure=False, resources=self.resources, **where)

    def _restore_local(self, checkpoint: Checkpoint, iteration: int, i: int) -> Future:
        p = self.partitions[i]
        return self._submit(_load_local, checkpoint, iteration, p.index, key=f"restore-local-{iteration}-{p.index}-{self.token}", home=i)

    def sweep(self, glob: Any) -> Any:
        """One map + tree reduction with the global state ``glob``; returns the summed statistics."""
        self.iteration += 1
        it, token = self.iteration, self.token
        if self._restore_from is not None:
            checkpoint, saved = self._restore_from
            self.locals = [self._restore_local(checkpoint, saved, i) for i in range(len(self.partitions))]
            self._restore_from = None
        q = self.client.submit(identity, glob, key=f"q-{it}-{token}", pure=False)
        results = []
        for i, p in enumerate(self.partitions):
            key = f"partition-step-{it}-{p.index}-{token}"
            if self.mode == "persist":
                results.append(self._submit(_partition_step, self.updates, self.blocks[i], self.locals[i], q, key=key, home=i))
            else:
                results.append(
                    self._submit(
                        _stream_partition_step, self.updates, self.store, p, self.placement, self.exclude, self.with_coords, self.scaling,
                        self.locals[i], q, key=key, home=i,
                    )
                )
        stats = [self.client.submit(operator.getitem, r, 0, key=f"statistics-{it}-{i}-{token}") for i, r in enumerate(results)]
        self.locals = [self.client.submit(operator.getitem, r, 1, key=f"local-{it}-{i}-{token}") for i, r in enumerate(results)]
        level = 0
        while len(stats) > 1:
            level += 1
            stats = [
                self.client.submit(sum_statistics, *stats[j : j + self.split_every], key=f"sum-statistics-{it}-{level}-{j}-{token}")
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
