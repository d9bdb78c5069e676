"""``fit_cohort_embedded``: :class:`~mil_core.EmbeddedGPMIL` on a cohort store.

The ensemble's attention-MIL networks train on the client (PyTorch, one bag per step: they do not
split into the executor's map → sum form); each member's GP then trains through
:func:`~tasks.training.fit.fit_cohort` on the Dask cluster, every partition embedded on its worker
by that member's stored network (NumPy).

Memory bound: the client holds every labelled training instance once, as float64, while the
networks train (then, for the calibration, each instance's embedding by the member that held its
bag out, ``8 · N_train · n_components`` bytes, and with ``representation="auto"`` the input rows
of the held-out bags, a fifth of the instances at ``n_networks=5``): ``8 · N_train · D`` bytes (PANDA-scale, 10⁷ tiles × 512 features: 41 GB — use a
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
from tasks.training.fit import TrainingSummary, fit_cohort, training_scaling

__all__ = ["EmbeddedFeatures", "fit_cohort_embedded"]


@dataclass(frozen=True)
class EmbeddedFeatures:
    """The features member ``member`` of an :class:`~mil_core.EmbeddedGPMIL`'s GPs sees: the
    cohort's standardisation (when trained with one), then that member network's standardised
    embedding."""

    model: EmbeddedGPMIL
    scaling: FeatureScaling | None = None
    member: int = 0

    def __call__(self, X: np.ndarray) -> np.ndarray:
        return self.model._member_embedding(X if self.scaling is None else self.scaling(X), self.member)


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


def fit_cohort_embedded(model: EmbeddedGPMIL, store: str | Path, client: Client, *, standardize: bool | None = None,
                        run: str = "default", **fit_kwargs: Any) -> TrainingSummary:
    """Fit ``model`` on the labelled bags of ``store``: the member networks on the client (their
    own cross-fitted folds of bags), then each member's clone of ``model.gp`` through
    :func:`fit_cohort` (run ``{run}-member{k}``) on its embedded features, its held-out bags
    excluded, then the calibration on the client from the members' embeddings of their held-out
    bags; with ``representation="auto"``, where those rank the bags no better than chance, also
    each member's clone on the input features (run ``{run}-features{k}``), kept with their own
    calibration when they score higher out of fold
    (:meth:`~mil_core.EmbeddedGPMIL.choose_representation`, on the client). ``fit_kwargs`` go to
    every :func:`fit_cohort`. Nothing resumes: the networks train again, and a member GP of an
    interrupted run (its own seed, its held-out bags) is no start for this one's. ``standardize`` (None: the model's own) standardises the cohort's
    features on the labelled bags first, as ``model.fit`` does, and leaves the scaling on the model
    (``feature_mean_`` / ``feature_scale_``). Sets the fitted attributes of ``model.fit``;
    predictions go through :func:`~tasks.training.predict.predict_cohort`, like any model. The
    summary is the last member GP's of the representation kept."""
    model._check_params()
    standardize = model.standardize if standardize is None else standardize
    store = str(store)
    cohort = open_cohort(store)
    labels = np.asarray(cohort.bag_labels)
    labelled = np.flatnonzero(labels >= 0)
    scaling = training_scaling(client, cohort, labelled, DEFAULT_PARTITION_BYTES) if standardize else None
    network_seed, gp_seed = model._seeds()
    X_sorted, offsets, bag_labels = _training_bags(store, scaling)
    model.fit_embedding(X_sorted, offsets, bag_labels, seed=network_seed)
    held_out = model.held_out_embeddings(X_sorted, offsets)  # D numbers per instance: the rows can go
    held_out_inputs = model.held_out_inputs(X_sorted, offsets) if model.representation == "auto" else None
    del X_sorted
    gps, summaries = [], {}
    for member, validation in enumerate(model.validation_bags_):
        gp = model.gp_clone(member, gp_seed)
        summaries["embedding"] = fit_cohort(gp, store, client, run=f"{run}-member{member}",
                                            transform=EmbeddedFeatures(model, scaling, member), resume=False,
                                            exclude_bags=labelled[validation], **fit_kwargs)
        gps.append(gp)
    model.gps_ = gps
    model.fit_calibration(held_out, bag_labels)
    embedding_auc = model.out_of_fold_auc(held_out, bag_labels)
    features_gps = model.features_gp_candidates(gp_seed, embedding_auc, bag_labels)
    for member, gp in enumerate(features_gps or []):
        summaries["features"] = fit_cohort(gp, store, client, run=f"{run}-features{member}", transform=scaling, resume=False,
                                           exclude_bags=labelled[model.validation_bags_[member]], **fit_kwargs)
    kept = model.choose_representation(features_gps, held_out_inputs, embedding_auc, bag_labels)
    if scaling is not None:  # in model.fit's units: its predict_* standardise as after model.fit
        model.feature_mean_, model.feature_scale_ = scaling.mean, scaling.scale
    # the ensemble's training bags: each member's fit held some out, and the summary counts all it trained on
    return dataclasses.replace(summaries[kept], scaling=scaling, n_bags=int(labelled.size),
                               n_instances=int(np.diff(np.asarray(cohort.offsets))[labelled].sum()))
