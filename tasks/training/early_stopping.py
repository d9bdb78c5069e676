"""Validation bag-AUC early stopping of a distributed fit, the hold-out bags scored on the workers."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
from distributed import Client

from mil_core.engine import BagBlock, HeldOutRows
from mil_core.models.base import SparseGPMILBase, uses_coords
from tasks.training.blocks import FeatureScaling, load_block
from tasks.training.executor import identity
from tasks.training.placement import ArrayPlacement


def held_out_scoring(model: SparseGPMILBase, block: BagBlock) -> tuple[HeldOutRows, dict[str, Any]]:
    """What scoring one partition's hold-out block needs at every sweep, prepared once on its
    worker: its rows, whitened once per GP (:class:`~mil_core.engine.HeldOutRows`), and their
    context (the coords; for VGPMIL-PR-I their coupling, ``SparseGPMILBase._held_out_context``)."""
    return HeldOutRows(block.X), model._held_out_context(block.offsets, **({} if block.coords is None else {"coords": block.coords}))


def bag_scores(model: SparseGPMILBase, block: BagBlock, prepared: tuple[HeldOutRows, dict[str, Any]], glob: Any) -> np.ndarray:
    """Validation bag probabilities of one partition's hold-out block under ``glob``."""
    rows, context = prepared
    return model._bag_proba_from_state(model.gp_, glob, rows, block.offsets, **context)



class DistributedEarlyStopping:
    """Validation bag-AUC early stopping (as ``model.fit`` does), the hold-out bags scored on the
    workers where they are kept (with the GPU resource when they live on the device)."""

    def __init__(self, client: Client, model: SparseGPMILBase, store: str, cohort, labels: np.ndarray,
                 validation: np.ndarray, partition_bytes: int, placement: ArrayPlacement, scaling: FeatureScaling | None):
        from mil_core.metrics import binary_auc
        from mil_core.models.base import _EarlyStopping

        self.client, self.resources = client, placement.resources
        self.token = uuid.uuid4().hex[:8]
        self.model = client.submit(identity, model, pure=False, key=f"validation-model-{self.token}")
        self.blocks, order = [], []
        for p in cohort.partitions(partition_bytes):
            held_out = validation[(validation >= p.bag_start) & (validation < p.bag_stop)]
            if held_out.size:
                others = np.setdiff1d(np.arange(p.bag_start, p.bag_stop), held_out)
                block = client.submit(load_block, store, p, placement, others, uses_coords(model), scaling, pure=False,
                                      resources=self.resources, key=f"validation-block-{p.index}-{self.token}")
                prepared = client.submit(held_out_scoring, self.model, block, pure=False, resources=self.resources,
                                         key=f"validation-scoring-{p.index}-{self.token}")
                self.blocks.append((block, prepared))
                order.append(held_out)
        truth = labels[np.concatenate(order)]
        self.stopping = _EarlyStopping(score=lambda glob: binary_auc(truth, self._scores(glob)), patience=model.n_iter_no_change)

    def _scores(self, glob: Any) -> np.ndarray:
        q = self.client.submit(identity, glob, pure=False)
        return np.concatenate(self.client.gather([
            self.client.submit(bag_scores, self.model, block, prepared, q, pure=False, resources=self.resources)
            for block, prepared in self.blocks
        ]))

    def __call__(self, iteration: int, glob: Any) -> bool:
        return self.stopping(iteration, glob)
