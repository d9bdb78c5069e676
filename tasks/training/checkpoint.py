"""Checkpoints of a distributed fit in ``<store>/training/<run>/``: the kernel choice's finished
splits, the fitted estimator and feature scaling, every partition's local state, q and the
objective trace.

The only module that serialises training state: arrays + JSON (:mod:`mil_core.persist`, an
allowlist of types, format version recorded), never a pickle — a store shared between teams must
not be able to run code in the next fit that resumes from it."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping, Sequence
from typing import Any

import numpy as np
import zarr

from mil_core import persist
from mil_core.engine import FitTrace
from mil_core.models.base import SparseGPMILBase
from tasks.lease import ensure_still_held
from tasks.store import Partition
from tasks.training.errors import CohortError
from tasks.training.blocks import FeatureScaling


class Checkpoint:
    """``<store>/training/<run>/``: ``model`` (the estimator with its kernel and inducing points),
    ``it<k>/{state, objective, local/<partition>}``, each a :mod:`mil_core.persist` archive in a
    uint8 array; the attribute ``latest`` is written last, so a checkpoint is visible only once
    complete. Anything else found there (an old pickle, a crafted file) is refused, not run."""

    def __init__(self, store: str, run: str):
        self.store, self.run = store, run

    def _group(self) -> zarr.Group:
        return zarr.open_group(self.store, mode="a", zarr_format=3).require_group(f"training/{self.run}")

    def latest(self) -> int | None:
        root = zarr.open_group(self.store, mode="r", zarr_format=3)
        name = f"training/{self.run}"
        return root[name].attrs.get("latest") if name in root else None

    def choice_memo(self) -> ChoiceMemo:
        """Where the automatic kernel choice records its finished splits, until the first :meth:`commit`."""
        return ChoiceMemo(self.store, f"training/{self.run}/choice")

    def save_model(self, model: SparseGPMILBase, partitions: Sequence[Partition], scaling: FeatureScaling | None) -> None:
        group = self._group()
        _write_bytes(group, "model", persist.dumps((model, scaling)))
        group.update_attributes({"partitions": [[p.bag_start, p.bag_stop] for p in partitions], "latest": None})

    def load_model(self, partitions: Sequence[Partition]) -> tuple[SparseGPMILBase, FeatureScaling | None]:
        group = self._group()
        saved = [tuple(b) for b in group.attrs["partitions"]]
        if saved != [(p.bag_start, p.bag_stop) for p in partitions]:
            raise CohortError(
                f"checkpoint {self.store}/training/{self.run} was written with other partitions ({len(saved)} of them, "
                f"{len(partitions)} now): resume with the partition size it was written with (training.partition_mib, "
                f"fit_cohort's partition_bytes), or delete {self.store}/training/{self.run} to train this model afresh"
            )
        return _read(group, "model")

    def begin(self, iteration: int) -> None:
        """Client side, before the workers write: create the iteration's groups once."""
        self._group().require_group(f"it{iteration}/local")

    def save_local(self, iteration: int, index: int, local: Any) -> int:
        """Worker side: one partition's local state (distinct arrays per partition: safe in parallel)."""
        group = zarr.open_group(self.store, mode="a", zarr_format=3)[f"training/{self.run}/it{iteration}/local"]
        _write_bytes(group, str(index), persist.dumps(local))
        return index

    def load_local(self, iteration: int, index: int) -> Any:
        group = zarr.open_group(self.store, mode="r", zarr_format=3)[f"training/{self.run}/it{iteration}/local"]
        return _read(group, str(index))

    def commit(self, trace: FitTrace) -> None:
        """Client side: the global state (q, and the learnt kernel when hyper-parameters are learnt)
        and the objective trace, then ``latest`` (the commit), then old iterations (and the kernel
        choice's record: the model holds the choice) go."""
        ensure_still_held(self.store)  # never commit beside a writer that took the store's lease over
        group = self._group()
        it = group.require_group(f"it{trace.n_iter}")
        _write_bytes(it, "state", persist.dumps(trace.glob))
        it.create_array("objective", data=np.asarray(trace.objective, dtype=np.float64), overwrite=True)
        it.attrs["converged"] = bool(trace.converged)
        previous = group.attrs.get("latest")
        group.attrs["latest"] = trace.n_iter
        if previous is not None and previous != trace.n_iter:
            del group[f"it{previous}"]
        if "choice" in group:
            del group["choice"]

    def load_trace(self, iteration: int) -> FitTrace:
        it = zarr.open_group(self.store, mode="r", zarr_format=3)[f"training/{self.run}/it{iteration}"]
        return FitTrace(glob=_read(it, "state"), objective=list(it["objective"][:]), n_iter=iteration,
                        converged=bool(it.attrs["converged"]))


class ChoiceMemo(MutableMapping[str, Any]):
    """The ``memo`` of :meth:`~mil_core.models.base.SparseGPMILBase._choice_scores` in a store
    group: each finished split of the kernel choice (its held-out AUC curves and k-means) under
    its digest, so a run killed during the choice (minutes to tens of minutes on a large cohort)
    fits only the splits it had not finished when it is started again. Written as
    :mod:`mil_core.persist` archives, each split its own array (the splits may finish side by
    side in threads), after checking the store's writer lease. A record that does not read back
    whole (a kill between an array's metadata and its data) is fitted again."""

    def __init__(self, store: str, path: str):
        self.store, self.path = store, path
        ensure_still_held(store)
        zarr.open_group(store, mode="a", zarr_format=3).require_group(path)

    def _group(self) -> zarr.Group:
        return zarr.open_group(self.store, mode="a", zarr_format=3)[self.path]

    def __getitem__(self, key: str) -> Any:
        group = self._group()
        if key not in group:
            raise KeyError(key)
        try:
            return _read(group, key)
        except Exception:  # half-written (or not ours): a cache entry, so fitted again and written anew
            del group[key]
            raise KeyError(key) from None

    def __setitem__(self, key: str, value: Any) -> None:
        ensure_still_held(self.store)
        _write_bytes(self._group(), key, persist.dumps(value))

    def __delitem__(self, key: str) -> None:
        del self._group()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._group().array_keys()))

    def __len__(self) -> int:
        return sum(1 for _ in self._group().array_keys())


def _write_bytes(group: zarr.Group, name: str, payload: bytes) -> None:
    group.create_array(name, data=np.frombuffer(payload, dtype=np.uint8), overwrite=True)


def _read(group: zarr.Group, name: str) -> Any:
    """An object written by :func:`_write_bytes` of :func:`mil_core.persist.dumps`; refuses anything else."""
    return persist.loads(group[name][:].tobytes(), source=f"checkpoint {group.store}/{group.path}/{name}")


def _save_local(checkpoint: Checkpoint, iteration: int, index: int, local: Any) -> int:
    return checkpoint.save_local(iteration, index, local)


def _load_local(checkpoint: Checkpoint, iteration: int, index: int) -> Any:
    return checkpoint.load_local(iteration, index)
