"""Validation bag-AUC early stopping of a distributed fit, the hold-out bags scored on the workers."""

from __future__ import annotations

from typing import Any

import numpy as np
from distributed import Client

from mil_core.engine import BagBlock
from mil_core.models.base import SparseGPMILBase
from tasks.training.blocks import FeatureScaling, load_block, uses_coords
from tasks.training.executor import identity


def bag_scores(model: SparseGPMILBase, block: BagBlock, glob: Any) -> np.ndarray:
    """Validation bag probabilities of one partition's hold-out block under ``glob``."""
    coords = {} if block.coords is None else {"coords": block.coords}
    return model._bag_proba_from_state(model.gp_, glob, block.X, block.offsets, **coords)



class DistributedEarlyStopping:
    """Validation bag-AUC early stopping (as ``model.fit`` does), the hold-out bags scored on the
    workers where they are kept."""

    def __init__(self, client: Client, model: SparseGPMILBase, store: str, cohort, labels: np.ndarray,
                 validation: np.ndarray, partition_bytes: int, device: str, scaling: FeatureScaling | None):
        from sklearn.metrics import roc_auc_score

        from mil_core.models.base import _EarlyStopping

        self.client = client
        self.model = client.submit(identity, model, pure=False)
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
        q = self.client.submit(identity, glob, pure=False)
        return np.concatenate(self.client.gather([self.client.submit(bag_scores, self.model, b, q, pure=False) for b in self.blocks]))

    def __call__(self, iteration: int, glob: Any) -> bool:
        return self.stopping(iteration, glob)
