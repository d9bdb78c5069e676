"""Partitions of a cohort store read as engine blocks: feature standardisation, the labelled and
non-held-out bags, instance coordinates, and placement on the device."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from mil_core import persist
from mil_core.engine import BagBlock
from mil_core.models.base import take_bags
from mil_core.validation import standardise
from tasks.grid import grid_positions
from tasks.store import Partition, open_cohort
from tasks.training.placement import ArrayPlacement

DEFAULT_PARTITION_BYTES = 128 * 2**20
FLOAT64_ROWS = 8192  # rows per float64 chunk: 8 MiB at D = 128


@dataclass(frozen=True)
class FeatureScaling:
    """Per-feature standardisation ``(x − mean) / scale`` learnt on a training cohort and applied
    to every cohort the model sees (handcrafted features differ in scale by orders of magnitude;
    an isotropic RBF kernel needs them comparable)."""

    mean: np.ndarray
    scale: np.ndarray

    def __call__(self, X: np.ndarray) -> np.ndarray:
        return standardise(X, self.mean, self.scale)


persist.allow_types(FeatureScaling)  # saved with models and checkpoints


def float64_rows(features: np.ndarray) -> Iterator[tuple[slice, np.ndarray]]:
    """``features`` as float64 copies of :data:`FLOAT64_ROWS` rows at a time, with their row slice.

    Elementwise float64 work on a whole partition allocates temporaries of ~1 GB each, and their
    first-touch page faults cost ten times the arithmetic (docs/BENCHMARKS.md, "The cohort's
    standardisation in row chunks"); a chunk of a few MiB is reused from cache."""
    for start in range(0, features.shape[0], FLOAT64_ROWS):
        rows = slice(start, start + FLOAT64_ROWS)
        yield rows, features[rows].astype(np.float64)


def read_features(stored: Any, scaling: Callable[[np.ndarray], np.ndarray] | None, dtype: str = "float64") -> np.ndarray:
    """Stored features through ``scaling`` — a row-wise map of float64 rows: a
    :class:`FeatureScaling`, or a fit's ``transform`` — applied a chunk of rows at a time, as
    ``dtype``. A float32 fit of unscaled float32 features takes the stored array without a float64
    round trip."""
    features = np.asarray(stored.features)
    if scaling is None:
        return np.asarray(features, dtype=dtype)
    out = None
    for rows, chunk in float64_rows(features):
        mapped = scaling(chunk)
        if out is None:  # the map's width: a transform may change it
            out = np.empty((features.shape[0], *mapped.shape[1:]), dtype=dtype)
        out[rows] = mapped
    return np.asarray(scaling(features.astype(np.float64)), dtype=dtype) if out is None else out


def load_block(path: str, partition: Partition, placement: ArrayPlacement, exclude_bags: np.ndarray | None = None,
               with_coords: bool = False, scaling: Callable[[np.ndarray], np.ndarray] | None = None) -> BagBlock:
    """The labelled bags of ``partition`` as an engine block (in the dtype of ``placement``, placed by it).

    Unlabelled bags (label −1) and the bags in ``exclude_bags`` (global indices, e.g. a validation
    hold-out) are left out. ``with_coords`` adds the instance coordinates (VGPMIL-PR-I's neighbour
    graph); ``scaling`` maps the features (a standardisation, or a fit's transform). ``bag_index`` is each kept bag's position among the
    store's training bags (as in ``model.fit`` on those bags, when the store holds them in id order).
    """
    cohort = open_cohort(path)
    stored = cohort.read_partition(partition)
    training = np.asarray(cohort.bag_labels) >= 0  # every bag of the store, for the bags' positions among the fit's
    if exclude_bags is not None and exclude_bags.size:
        training[exclude_bags] = False
    keep = training[partition.bag_start : partition.bag_stop]
    kept = np.flatnonzero(keep)
    labels = np.asarray(stored.bag_labels)
    offsets = np.asarray(stored.offsets)
    X, new_offsets = take_bags(read_features(stored, scaling, placement.dtype), offsets, kept)
    coords = take_bags(grid_coords(stored, cohort.attrs.get("coords_meaning", "")), offsets, kept)[0] if with_coords else None
    bag_index = np.cumsum(training)[partition.bag_start + kept] - 1
    return BagBlock(X=placement.to_device(X), offsets=new_offsets, labels=labels[kept].astype(np.int8), coords=coords,
                    bag_index=bag_index)


def grid_coords(stored, coords_meaning: str) -> np.ndarray:
    """The neighbour-graph positions of a block's stored instance coordinates: at most the first two
    columns (slide stores keep (tile_row, tile_col) there, the level-0 x, y beside them); level-0
    pixels (``x,y`` of ``.h5`` files and tables) divided by each bag's grid step, so that adjacent
    patches are neighbours (VGPMIL-PR-I had no neighbour at all on them: the plain VGPMIL-PR)."""
    coords = np.asarray(stored.coords)[:, :2]
    if not coords_meaning.startswith("x,y"):
        return coords
    offsets = np.asarray(stored.offsets) - stored.offsets[0]
    return np.concatenate([grid_positions(coords[a:b]) for a, b in zip(offsets[:-1], offsets[1:])] or [coords[:0]])
