"""What a fit gathers from the training bags before its first iteration: the feature
standardisation (a map over partitions and a sum) and the instance sample for k-means."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from distributed import Client

from mil_core.validation import constant_columns
from tasks.store import FEATURE_DTYPE, Partition, open_cohort
from tasks.training.blocks import FeatureScaling, float64_rows, grid_coords, load_block, read_features
from tasks.training.executor import sum_statistics
from tasks.training.placement import ArrayPlacement


def _feature_sums(path: str, partition: Partition, exclude_bags: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """``[n, Σ(x − shift), Σ(x − shift)²]`` over the labelled, non-excluded bags of one partition."""
    X = load_block(path, partition, ArrayPlacement(dtype=FEATURE_DTYPE.name), exclude_bags).X  # as stored: no float64 copy
    sums = np.zeros(1 + 2 * X.shape[1])
    sums[0] = X.shape[0]
    for _, chunk in float64_rows(X):
        chunk -= shift
        sums[1 : X.shape[1] + 1] += chunk.sum(axis=0)
        sums[X.shape[1] + 1 :] += np.einsum("ij,ij->j", chunk, chunk)
    return sums


def feature_scaling(client: Client, path: str, partitions: Sequence[Partition], exclude_bags: np.ndarray) -> FeatureScaling:
    """Mean and std of every feature over the training bags, as a map over partitions and a sum
    (:func:`mil_core.validation.standardisation`'s, a column with std < 1e-12 keeping scale 1).
    The sums are of ``x − s``, ``s`` the first row of the bags summed: the variance
    Σ(x − s)²/n − (x̄ − s)² then cancels digits only as far as that row lies from the mean, where
    Σx²/n − x̄² lost those of every feature whose mean is large against its std; a constant column
    comes out exactly 0."""
    cohort = open_cohort(path)
    summed = (np.asarray(cohort.bag_labels) >= 0) & (np.diff(cohort.offsets) > 0)
    summed[exclude_bags] = False
    first = int(np.flatnonzero(summed)[0])
    shift = np.asarray(cohort.read_bags(first, first + 1).features[0], dtype=np.float64)
    sums = client.submit(sum_statistics, *[client.submit(_feature_sums, path, p, exclude_bags, shift, pure=False)
                                           for p in partitions]).result()
    n, D = sums[0], (sums.shape[0] - 1) // 2
    offset = sums[1 : D + 1] / n
    std = np.sqrt(np.maximum(sums[D + 1 :] / n - offset**2, 0.0))
    return FeatureScaling(mean=shift + offset, scale=np.where(constant_columns(shift + offset, std, float(np.finfo(FEATURE_DTYPE).eps)), 1.0, std))


def kmeans_sample(cohort, labels: np.ndarray, training: np.ndarray, cap: int, random_state,
                   scaling: FeatureScaling | None, with_coords: bool = False,
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """Instances (labelled by their bag's label) for k-means and the automatic kernel choice:
    every training instance, in store order, when there are at most ``cap``; else a seeded sample
    of whole training bags. Returns rows, labels, the bags' CSR offsets and, ``with_coords``, the
    rows' grid coordinates (the neighbour graph of a model that reads them; else ``None``)."""
    sizes = np.diff(cohort.offsets)
    chosen = training
    if sizes[training].sum() > cap:
        rng = np.random.default_rng(random_state if isinstance(random_state, (int, np.integer)) else None)
        shuffled = rng.permutation(training)
        chosen = np.sort(shuffled[: max(1, int(np.searchsorted(np.cumsum(sizes[shuffled]), cap)))])
    return read_bags(cohort, labels, chosen, scaling, with_coords)


def read_bags(cohort, labels: np.ndarray, chosen: np.ndarray, scaling: FeatureScaling | None, with_coords: bool = False,
              ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The rows of the bags ``chosen`` (ascending store positions), labelled by their bag's label,
    with the bags' CSR offsets and, ``with_coords``, their grid coordinates."""
    X, y, sizes_taken, coords = [], [], [], []
    for span in _spans(cohort, chosen):  # read only the chunks holding the chosen bags (a 10⁷ store is ~5 GB; the sample ~0.1 GB)
        around = cohort.read_bags(int(span[0][0]), int(span[-1][-1]) + 1)
        for run in span:
            stored = around.select(int(run[0]), int(run[-1]) + 1)
            X.append(read_features(stored, scaling))
            y.append(np.repeat(labels[run], np.diff(stored.offsets)))
            sizes_taken.append(np.diff(stored.offsets))
            if with_coords:
                coords.append(grid_coords(stored, cohort.attrs.get("coords_meaning", "")))
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(sizes_taken))]).astype(np.int64)
    return np.concatenate(X), np.concatenate(y), offsets, np.concatenate(coords) if with_coords else None


SPAN_BYTES = 64 * 2**20
"""Most bytes of instance rows one read of :func:`read_bags` takes to serve several runs of chosen bags."""


def _spans(cohort, chosen: np.ndarray) -> list[list[np.ndarray]]:
    """Runs of consecutive ``chosen`` bags, grouped into spans each read once: the next run joins a
    span while the rows between them are fewer than a chunk's (they share a chunk; reading one run
    at a time read it again for each, 21 of 33 s on 10,000 bags of 100 rows) and the span stays
    within :data:`SPAN_BYTES`."""
    runs = [run for run in np.split(chosen, np.flatnonzero(np.diff(chosen) != 1) + 1) if run.size]
    offsets, chunk = cohort.offsets, int(cohort.attrs.get("chunk_rows") or 1)
    most_rows = max(chunk, SPAN_BYTES // cohort.bytes_per_instance)
    spans: list[list[np.ndarray]] = []
    for run in runs:
        if spans and (offsets[run[0]] - offsets[spans[-1][-1][-1] + 1] < chunk
                      and offsets[run[-1] + 1] - offsets[spans[-1][0][0]] <= most_rows):
            spans[-1].append(run)
        else:
            spans.append([run])
    return spans
