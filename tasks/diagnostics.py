"""Warnings for results that ran without error but are degenerate.

Each check returns a message (or None); the Prefect tasks log it as a warning and put it in the
model's ``model.json`` or the report, so that a run which "worked" but learnt nothing says so.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zarr

from mil_core.validation import constant_columns

__all__ = ["CONSTANT_PREDICTION_SPREAD", "SCALE_RATIO", "constant_predictions", "feature_scale_spread", "sample_features"]

CONSTANT_PREDICTION_SPREAD = 1e-3
SCALE_RATIO = 1e3


def constant_predictions(bag_proba: np.ndarray, *, spread: float = CONSTANT_PREDICTION_SPREAD) -> str | None:
    """All bag probabilities within ``spread`` of each other: the model separates nothing."""
    p = np.asarray(bag_proba, dtype=np.float64)
    p = p[np.isfinite(p)]
    if p.size < 2 or np.ptp(p) > spread:
        return None
    return (f"all {p.size} bag probabilities lie in [{p.min():.4f}, {p.max():.4f}] (spread {np.ptp(p):.1e} <= {spread:g}): "
            "the model does not separate the bags. Check the features (scale: training.standardize), the labels, "
            "and the fit's convergence.")


def one_sided_predictions(bag_proba: np.ndarray, labels: np.ndarray, threshold: float) -> str | None:
    """Labelled bags of both classes, every predicted one on one side of ``threshold``: accuracy and
    F1 at it count one class only, whatever the ranking (a model whose probabilities all lie below ½
    — VGPMIL-PR on wide features — reported F1 0 beside a bag AUC of 1)."""
    p, y = np.asarray(bag_proba, dtype=np.float64), np.asarray(labels)
    known = np.isfinite(p) & np.isin(y, (0, 1))
    if not (np.any(y[known] == 0) and np.any(y[known] == 1)):
        return None
    above = p[known] >= threshold
    if above.any() and not above.all():
        return None
    side = "positive (at or above" if above.all() else "negative (below"
    medians = ", ".join(f"{name} bags' median {np.median(p[known][y[known] == c]):.3g}" for c, name in ((1, "positive"), (0, "negative")))
    return (f"every labelled bag is predicted {side} the threshold {threshold:g}): accuracy and F1 count one class only. "
            f"Probabilities lie in [{p[known].min():.3g}, {p[known].max():.3g}] ({medians}); the ranking (bag AUC) does not "
            "depend on the threshold. Set prediction.threshold from held-out bags of the training cohort, not from this one.")


def sample_features(store: str, max_rows: int = 65536) -> np.ndarray:
    """Up to ``max_rows`` instance rows of a store, from evenly spaced chunks (cheap on any size)."""
    from tasks.store import open_cohort

    n = open_cohort(store).n_instances  # committed rows only
    features = zarr.open_group(store, mode="r", zarr_format=3)["instances/features"]
    if n <= max_rows:
        return np.asarray(features[:n], dtype=np.float64)
    rows_per_chunk = int(features.chunks[0])
    n_chunks = max(1, max_rows // rows_per_chunk)
    starts = np.linspace(0, n - rows_per_chunk, n_chunks).astype(int)
    return np.concatenate([np.asarray(features[s : s + rows_per_chunk], dtype=np.float64) for s in starts])


def feature_scale_spread(X: Any, *, ratio: float = SCALE_RATIO) -> str | None:
    """Non-constant feature columns whose standard deviations differ by more than ``ratio``: an
    isotropic kernel then sees only the largest ones (use ``training.standardize: true``)."""
    dtype = np.dtype(getattr(X, "dtype", np.float64))  # the features' own precision says what rounding alone gives
    eps = float(np.finfo(dtype if dtype.kind == "f" else np.float64).eps)
    X = np.asarray(X, dtype=np.float64)
    std = X.std(axis=0)
    varying = np.flatnonzero(~constant_columns(X.mean(axis=0), std, eps))
    if varying.size < 2:
        return None
    big, small = varying[np.argmax(std[varying])], varying[np.argmin(std[varying])]
    if std[big] <= ratio * std[small]:
        return None
    return (f"feature scales differ by a factor {std[big] / std[small]:.1e} (column {big} has std {std[big]:.3g}, column "
            f"{small} {std[small]:.3g}) and training.standardize is false: the kernel sees only the largest features. "
            "Set training.standardize: true.")
