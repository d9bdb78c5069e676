"""``fit_cohort_embedded``: :class:`~mil_core.EmbeddedGPMIL` on a cohort store.

The attention-MIL network trains on the client (PyTorch, one bag per step: it does not split into
the executor's map → sum form); the GP then trains through :func:`~tasks.training.fit.fit_cohort`
on the Dask cluster, every partition embedded on its worker by the stored network (NumPy).

Memory bound: the client holds every labelled training instance once, as float64, while the
network trains (then the inner validation bags', 20 % by default, for the calibration):
``8 · N_train · D`` bytes (PANDA-scale, 10⁷ tiles × 512 features: 41 GB — use a
feature extractor with fewer dimensions, or a sub-cohort, beyond what the client holds).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from distributed import Client

from mil_core import EmbeddedGPMIL, persist
from mil_core.models.base import take_bags
from tasks.store import open_cohort
from tasks.training.blocks import DEFAULT_PARTITION_BYTES, FeatureScaling, read_features
from tasks.training.fit import TrainingSummary, fit_cohort
from tasks.training.preprocess import feature_scaling

__all__ = ["EmbeddedFeatures", "fit_cohort_embedded"]


@dataclass(frozen=True)
class EmbeddedFeatures:
    """The features an :class:`~mil_core.EmbeddedGPMIL`'s GP sees: the cohort's standardisation
    (when trained with one), then the network's standardised embedding."""

    model: EmbeddedGPMIL
    scaling: FeatureScaling | None = None

    def __call__(self, X: np.ndarray) -> np.ndarray:
        return self.model.transform(X if self.scaling is None else self.scaling(X))


persist.allow_types(EmbeddedFeatures)  # saved in the GP's training checkpoint


def _training_bags(store: str, scaling: FeatureScaling | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every labelled bag of the store as CSR rows on the client: ``X_sorted, offsets, labels``."""
    cohort = open_cohort(store)
    X, offsets, labels = [], [0], []
    for p in cohort.partitions(DEFAULT_PARTITION_BYTES):
        stored = cohort.read_partition(p)
        bag_labels = np.asarray(stored.bag_labels)
        kept = np.flatnonzero(bag_labels >= 0)
        rows, local = take_bags(read_features(stored, scaling), np.asarray(stored.offsets), kept)
        X.append(rows)
        offsets.extend(offsets[-1] + local[1:])
        labels.append(bag_labels[kept])
    return np.concatenate(X), np.asarray(offsets, dtype=np.int64), np.concatenate(labels).astype(np.int64)


def fit_cohort_embedded(model: EmbeddedGPMIL, store: str | Path, client: Client, *, standardize: bool = False,
                        **fit_kwargs: Any) -> TrainingSummary:
    """Fit ``model`` on the labelled bags of ``store``: the network on the client (its own inner
    validation split of bags), then a clone of ``model.gp`` through :func:`fit_cohort` on the
    embedded features of the network's training bags (``fit_kwargs`` go there), then the
    calibration on the client from the inner validation bags. Sets the fitted attributes of ``model.fit``;
    predictions go through :func:`~tasks.training.predict.predict_cohort` with the returned
    summary's ``scaling``, like any model."""
    store = str(store)
    cohort = open_cohort(store)
    labels = np.asarray(cohort.bag_labels)
    labelled = np.flatnonzero(labels >= 0)
    scaling = feature_scaling(client, store, list(cohort.partitions(DEFAULT_PARTITION_BYTES)),
                              np.setdiff1d(np.arange(cohort.n_bags), labelled)) if standardize else None
    network_seed, gp_seed = model._seeds()
    X_sorted, offsets, bag_labels = _training_bags(store, scaling)
    model.fit_embedding(X_sorted, offsets, bag_labels, seed=network_seed)
    validation = model.validation_bags_
    X_val, val_offsets = take_bags(X_sorted, offsets, validation)  # the inner validation bags calibrate
    del X_sorted
    gp = model._gp_clone(gp_seed)
    summary = fit_cohort(gp, store, client, transform=EmbeddedFeatures(model, scaling), exclude_bags=labelled[validation],
                         **fit_kwargs)
    model.gp_ = gp
    model.fit_calibration(X_val, val_offsets, bag_labels[validation])
    return dataclasses.replace(summary, scaling=scaling)
