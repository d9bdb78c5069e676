"""Prediction of every bag of a cohort store on the cluster, written to ``predictions/<run>/``."""

from __future__ import annotations

import copy
import inspect
import logging
import uuid
from pathlib import Path
from typing import Any, Literal

import numpy as np
import zarr
from distributed import Client, as_completed

from mil_core.models import AbSMIL
from mil_core.models.base import SparseGPMILBase, uses_coords
from tasks.lease import ensure_still_held, holds_writer_lease
from tasks.store import Partition, open_cohort
from tasks.training.blocks import (
    DEFAULT_PARTITION_BYTES,
    FeatureScaling,
    grid_coords,
    read_features,
)
from tasks.training.executor import identity
from tasks.training.fit import check_feature_dimension
from tasks.training.placement import ArrayPlacement, Device, resolve_placement

log = logging.getLogger("gpmil.training")


def _predict_partition(model: SparseGPMILBase, store: str, partition: Partition, placement: ArrayPlacement, scaling: FeatureScaling | None,
                       instance_kwargs: dict, bag_kwargs: dict):
    """One partition's predictions. Bags with NaN/inf features (a store written by another tool)
    are left out — NaN in every output, listed in ``bad`` with the reason — so that they do not
    fail the prediction of the good bags."""
    cohort = open_cohort(store)
    stored = cohort.read_partition(partition)
    X = read_features(stored, scaling)
    bag_of_row = np.repeat(np.arange(partition.bag_start, partition.bag_stop), np.diff(np.asarray(stored.offsets)))
    finite = np.isfinite(X).all(axis=1)
    bad = {int(b): f"NaN or infinite features in {int(np.sum(~finite[bag_of_row == b]))} instance row(s), e.g. store row "
                   f"{partition.row_start + int(np.flatnonzero(~finite & (bag_of_row == b))[0])}"
           for b in np.unique(bag_of_row[~finite])}
    good = ~np.isin(bag_of_row, list(bad))
    n_rows, n_bags = X.shape[0], partition.bag_stop - partition.bag_start
    p_inst, sd_inst, p_bag, sd_bag = (np.full(n, np.nan) for n in (n_rows, n_rows, n_bags, n_bags))
    if good.any():
        Xg = placement.to_device(X[good])
        coords = {"coords": grid_coords(stored, cohort.attrs.get("coords_meaning", ""))[good]} if uses_coords(model) else {}
        instance_scores = getattr(model, "predict_instance_proba", None) or model.predict_instance_evidence
        if is_point_estimate(model):  # no predictive std: it stays NaN
            p_inst[good] = instance_scores(Xg, **instance_kwargs)
            keys, p_good = model.predict_bag_proba(Xg, bag_of_row[good], **bag_kwargs, **coords)
        else:
            p_inst[good], sd_inst[good] = instance_scores(Xg, return_std=True, **instance_kwargs)
            keys, p_good, sd_good = model.predict_bag_proba(Xg, bag_of_row[good], return_std=True, **bag_kwargs, **coords)
            sd_bag[np.asarray(keys) - partition.bag_start] = sd_good
        p_bag[np.asarray(keys) - partition.bag_start] = p_good
    return partition, p_inst, sd_inst, p_bag, sd_bag, bad


def prediction_kwargs(model: Any, method: str, rule: str | None) -> tuple[dict, dict]:
    """``instance_kwargs, bag_kwargs`` of :func:`predict_cohort` for the pipeline's ``prediction``
    settings: ``method`` goes to every predict method that names a ``method`` parameter (the
    logistic family, and VWSGP's bag probability: the closed form the kernel choice and early
    stopping score with, ``"mc"`` its Monte Carlo estimate), and to
    EmbeddedGPMIL's instance probabilities, which pass it to their GPs; ``rule``, when set, to
    every bag probability that takes a ``rule`` (the logistic and probit families; EmbeddedGPMIL
    passes it to its GPs), and a model that scores bags otherwise refuses it (VWSGP, AbSMIL):
    ignored, it would leave the user's setting silently unused. ``rule=None`` leaves the
    estimator's fitted ``bag_rule_``, so the pipeline scores bags as the estimator's validation
    and ``predict_bag_proba`` do."""
    def takes(name: str, parameter: str, forwarded: bool = False) -> bool:
        function = getattr(model, name, None)
        if function is None:
            return False
        parameters = inspect.signature(function).parameters
        members = getattr(model, "gps_", None)  # EmbeddedGPMIL passes its keyword arguments to its members' GPs
        if forwarded and members and any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
            function = getattr(members[0], name, None)
            parameters = {} if function is None else inspect.signature(function).parameters
        return parameter in parameters

    instance_name = "predict_instance_proba" if hasattr(model, "predict_instance_proba") else "predict_instance_evidence"
    instance_kwargs = {"method": method} if takes(instance_name, "method", forwarded=True) else {}
    bag_kwargs = {"method": method} if takes("predict_bag_proba", "method") else {}
    if rule is not None:
        if not takes("predict_bag_proba", "rule", forwarded=True):
            raise ValueError(f"prediction.rule={rule!r}: {type(model).__name__} scores bags by its own rule, not by a rule "
                             f"on instance probabilities; set prediction.rule to null")
        bag_kwargs["rule"] = rule
    return instance_kwargs, bag_kwargs


def is_point_estimate(model: Any) -> bool:
    """Models without a posterior, hence without a predictive std (AbSMIL: a point estimate of W)."""
    return isinstance(model, AbSMIL)


@holds_writer_lease("predictions {run!r} on {store}")
def predict_cohort(
    model: SparseGPMILBase,
    store: str | Path,
    client: Client,
    *,
    run: str = "default",
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
    device: Device = "auto",
    gpu_namespace: str = "cupy",
    compute_dtype: Literal["float64", "float32"] = "float64",
    scaling: FeatureScaling | None = None,
    instance_kwargs: dict | None = None,
    bag_kwargs: dict | None = None,
    provenance: dict[str, Any] | None = None,
) -> str:
    """Predict every bag of the store on the cluster and write ``predictions/<run>/`` (instance
    and bag probability and std; the ``complete`` attribute is set last). Returns the group path.
    ``provenance``: JSON attributes the group keeps beside the model's class and parameters (the
    pipeline's model key and folder, which ``gpmil evaluate`` checks).

    Models without instance probabilities (VWSGP, whose per-instance evidences are not instance
    labels, seed 001 §3) write ``instances/evidence`` instead of ``instances/proba``; point
    estimates (AbSMIL) write NaN std. ``device``/``gpu_namespace`` as for :func:`fit_cohort`.

    Each partition is predicted by one task; the client writes the results (one writer, so
    partitions that share a Zarr chunk cannot race). A bag with NaN/inf features gets NaN
    outputs and is listed with the reason in the ``not_predicted`` attribute; every other bag is
    predicted. A model that carries its standardisation (``feature_mean_``: fitted with
    ``standardize``, by :func:`fit_cohort` or ``model.fit``) has it applied as the partitions are
    read; ``scaling`` is for a model without one (an ``EmbeddedGPMIL``'s cohort standardisation,
    a model trained before models carried theirs). Holds the store's writer lease
    (:mod:`tasks.lease`).
    """
    store = str(store)
    cohort = open_cohort(store)
    check_feature_dimension(model, cohort)
    model, scaling = _scaling_on_read(model, scaling)
    placement = resolve_placement(client, device, gpu_namespace, compute_dtype)
    root = zarr.open_group(store, mode="a", zarr_format=3)
    name = f"predictions/{run}"
    ensure_still_held(store)  # never remove or write a group beside a writer that took the lease over
    if name in root:
        del root[name]
    group = root.require_group(name)
    instance_name = "instances/proba" if hasattr(model, "predict_instance_proba") else "instances/evidence"
    group.update_attributes({"complete": False, "model": type(model).__name__, "params": _jsonable(model.get_params()),
                             "instance_scores": instance_name.split("/")[1], **(provenance or {})})
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
    model_future = client.submit(identity, model, pure=False)
    futures = [
        client.submit(
            _predict_partition, model_future, store, p, placement, scaling, instance_kwargs or {}, bag_kwargs or {},
            key=f"predict-partition-{p.index}-{uuid.uuid4().hex[:8]}", resources=placement.resources,
        )
        for p in cohort.partitions(partition_bytes)
    ]
    not_predicted: dict[str, str] = {}
    for future in as_completed(futures):
        p, p_inst, sd_inst, p_bag, sd_bag, bad = future.result()
        not_predicted |= {str(cohort.bag_ids[b]): reason for b, reason in bad.items()}
        rows, bags = slice(p.row_start, p.row_stop), slice(p.bag_start, p.bag_stop)
        ensure_still_held(store)  # each write: a run frozen meanwhile must not write into the new holder's group
        out[instance_name][rows], out["instances/std"][rows] = p_inst, sd_inst
        out["bags/proba"][bags], out["bags/std"][bags] = p_bag, sd_bag
    if not_predicted:
        log.warning("%d bag(s) of %s not predicted (NaN in their outputs): %s", len(not_predicted), store,
                    "; ".join(f"{b}: {r}" for b, r in list(not_predicted.items())[:5]))
    ensure_still_held(store)  # an attribute write rewrites the group's whole zarr.json: one write
    group.update_attributes({"not_predicted": not_predicted, "complete": True})
    return f"{store}/{name}"


def _scaling_on_read(model: SparseGPMILBase, scaling: FeatureScaling | None) -> tuple[SparseGPMILBase, FeatureScaling | None]:
    """The model's own standardisation moved to the reader (float64 on the host, once): a shallow
    copy of ``model`` without it, and it as a :class:`FeatureScaling`. A different ``scaling``
    as well would standardise twice: an error."""
    mean = getattr(model, "feature_mean_", None)
    if mean is None:
        return model, scaling
    own = FeatureScaling(mean=np.asarray(mean), scale=np.asarray(model.feature_scale_))
    if scaling is not None and not (np.array_equal(scaling.mean, own.mean) and np.array_equal(scaling.scale, own.scale)):
        raise ValueError(f"this {type(model).__name__} carries its own feature standardisation (feature_mean_, fitted with "
                         "standardize=True) and a different scaling was given: the features would be standardised twice; "
                         "leave scaling out")
    reader = copy.copy(model)
    reader.feature_mean_ = reader.feature_scale_ = None
    return reader, own


def read_predictions(store: str | Path, run: str = "default") -> dict[str, np.ndarray]:
    """The predictions of ``run`` as arrays (``instances/proba`` or ``instances/evidence``,
    ``instances/std``, ``bags/proba``, ``bags/std``); raises if that prediction did not complete."""
    group = zarr.open_group(str(store), mode="r", zarr_format=3)[f"predictions/{run}"]
    if not group.attrs.get("complete"):
        raise RuntimeError(f"predictions/{run} in {store} is incomplete (the prediction was interrupted); predict again")
    names = ("instances/proba", "instances/evidence", "instances/std", "bags/proba", "bags/std")
    return {k: group[k][:] for k in names if k in group}


def _jsonable(params: dict[str, Any]) -> dict[str, Any]:
    return {k: v if isinstance(v, (int, float, str, bool, type(None))) else repr(v) for k, v in params.items()}
