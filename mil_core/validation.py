"""Input validation at the estimator boundary, with messages that name what is wrong."""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.utils.validation import check_array

from ._backend import array_namespace, is_host_array, like, to_numpy
from .bags import BagIndex

__all__ = ["CONSTANT_STD", "check_features", "check_mil_data", "constant_columns", "feature_names", "label_problem",
           "standardise", "standardisation"]

CONSTANT_STD = 1e-12
"""A column whose std is below this is constant (public MIL tables hold columns with std ≈ 1e-17),
and so is one whose std is below this fraction of its mean's magnitude (a constant 1e6 whose float
rounding varies it by 1e-10 would otherwise be scaled to a unit-variance feature of rounding noise)."""


def constant_columns(mean: np.ndarray, std: np.ndarray, eps: float = float(np.finfo(np.float64).eps)) -> np.ndarray:
    """Which columns are constant: their std is kept at 1 when scaling. Constant is a std below
    :data:`CONSTANT_STD`, or one that rounding in the features' precision (machine ``eps``) alone
    gives — at most ``max(CONSTANT_STD, 8·eps)`` of the column's level: a float32 column of 3.0 ± 1 ulp
    (2·10⁻⁸ of its level) was scaled by its rounding noise, and a shift of 10⁻⁵ at prediction time
    put every row thousands of stds from the data (every probability ½)."""
    relative = max(CONSTANT_STD, 8 * eps)
    return (std < CONSTANT_STD) | (std <= relative * np.abs(mean))


def standardisation(X: Any) -> tuple[np.ndarray, np.ndarray]:
    """Mean and scale of each column, on the host (``X`` may live on a device); a constant column
    keeps scale 1, so its z-scores stay finite. A column whose squares (or sum) overflow — values
    beyond ~1e154 — is measured in units of its largest magnitude instead (its std was infinite and
    every z-score 0: the model saw no feature and predicted one constant)."""
    xp = array_namespace(X)
    with np.errstate(over="ignore", invalid="ignore"):
        mean, std = to_numpy(xp.mean(X, axis=0)), to_numpy(xp.std(X, axis=0))
    if not (np.all(np.isfinite(mean)) and np.all(np.isfinite(std))):
        columns = np.flatnonzero(~(np.isfinite(mean) & np.isfinite(std)))
        overflowing = xp.take(X, like(columns, X, dtype=xp.int64), axis=1)
        unit = to_numpy(xp.max(xp.abs(overflowing), axis=0))
        scaled = overflowing / like(unit, X, dtype=X.dtype)
        mean[columns] = to_numpy(xp.mean(scaled, axis=0)) * unit
        std[columns] = to_numpy(xp.std(scaled, axis=0)) * unit
    return mean, np.where(constant_columns(mean, std, float(xp.finfo(X.dtype).eps)), 1.0, std)


def standardise(X: Any, mean: np.ndarray, scale: np.ndarray, *, in_place: bool = False) -> Any:
    """``(X − mean) / scale`` in ``X``'s namespace, device and dtype: a new array, or ``X`` itself
    overwritten with ``in_place`` (a fit's own sorted copy: no second copy of 10⁷ rows)."""
    mean, scale = like(mean, X, dtype=X.dtype), like(scale, X, dtype=X.dtype)
    if not in_place:
        return (X - mean) / scale
    X -= mean
    X /= scale
    return X


def feature_names(X: Any) -> np.ndarray | None:
    """The column names of a DataFrame whose columns are all text (scikit-learn's ``feature_names_in_``), else None."""
    columns = getattr(X, "columns", None)
    if columns is None or not len(columns) or not all(isinstance(c, str) for c in columns):
        return None
    return np.asarray(list(columns), dtype=str)


def check_features(X: Any, *, n_features: int | None = None, bag_ids: Any | None = None,
                   names: np.ndarray | None = None) -> Any:
    """A finite 2-D float array; host input goes through scikit-learn's ``check_array``, an
    array-API array on a device (CuPy, …) stays there (one scalar comes back: all finite?). A
    non-finite value is named by row, column and — given ``bag_ids`` (one per row) — bag. With
    ``names`` (the fit's DataFrame columns), a DataFrame must have those columns in that order:
    reordered columns were read by position and predicted other numbers without a word."""
    given = feature_names(X)
    if names is not None and given is not None and not np.array_equal(given, names):
        missing, extra = sorted(set(names.tolist()) - set(given.tolist())), sorted(set(given.tolist()) - set(names.tolist()))
        detail = (f"missing {missing[:5]}, not fitted on {extra[:5]}" if missing or extra else
                  f"in another order (fitted: {names[:5].tolist()}…, given: {given[:5].tolist()}…)")
        raise ValueError(f"X's columns differ from those the model was fitted on: {detail}; select them as "
                         "X[model.feature_names_in_]")
    if not is_host_array(X):
        if X.ndim != 2:
            raise ValueError(f"X must be 2-D (n_instances, n_features), got shape {X.shape}")
    else:
        # float32 stays float32, and half precision (foundation-model features kept as fp16) widens to
        # it exactly: to float64 a 10⁶ × 512 fp16 prediction took 12× its input in memory
        half = getattr(getattr(X, "dtype", None), "kind", None) == "f" and X.dtype.itemsize < 4
        X = check_array(X, dtype=[np.float32] if half else [np.float64, np.float32], ensure_all_finite=False, input_name="X")
    if n_features is not None and X.shape[1] != n_features:
        raise ValueError(f"X has {X.shape[1]} features, but the model was fitted with {n_features}")
    _check_finite(X, bag_ids)
    return X


def _check_finite(X: Any, bag_ids: Any | None) -> None:
    """Raise naming the first row (and its bag) that holds NaN or infinity; when all is finite
    one pass and one scalar (a sum on the host, as scikit-learn does; ``isfinite`` on a device)."""
    xp = array_namespace(X)
    if is_host_array(X):
        with np.errstate(over="ignore", invalid="ignore"):
            if np.isfinite(np.sum(X)):
                return
    if bool(xp.all(xp.isfinite(X))):
        return
    bad_rows = ~xp.all(xp.isfinite(X), axis=1)
    row = int(xp.argmax(xp.astype(bad_rows, xp.int8)))
    values = to_numpy(X[row, :])
    column = int(np.flatnonzero(~np.isfinite(values))[0])
    key = None if bag_ids is None else np.asarray(bag_ids)[row]
    bag = "" if key is None else f", bag {key.item() if isinstance(key, np.generic) else key!r}"
    kind = "NaN" if np.isnan(values[column]) else "infinity"
    raise ValueError(f"X contains {kind} at row {row}, column {column}{bag} "
                     f"({int(xp.sum(xp.astype(bad_rows, xp.int64)))} row(s) with NaN or infinity)")


def _is_missing_id(value: Any) -> bool:
    """None, NaN, pandas' NA or NaT: no bag id."""
    return value is None or type(value).__name__ in ("NAType", "NaTType") or (
        isinstance(value, (float, np.floating)) and not np.isfinite(value))


def _id_kind(value: Any) -> str:
    """A bag id's kind, NumPy's scalars counted as the Python type they extend (``np.str_`` is text)."""
    for kind, types in (("text", (str, bytes)), ("integer", (int, np.integer)), ("float", (float, np.floating))):
        if isinstance(value, types) and not isinstance(value, (bool, np.bool_)):
            return kind
    return type(value).__name__


def label_problem(labels: Any) -> tuple[int] | tuple[int, int] | None:
    """Where bag labels break the 0/1 (or −1/+1) convention: ``(row,)`` of the first that is no
    such number (2, text, an empty cell: NaN or None), ``(row of −1, row of 0)`` where both
    conventions meet; None where they keep one. Booleans are 0 and 1."""
    labels = np.asarray(labels)
    if labels.dtype.kind in "biuf":
        values = labels.astype(np.float64)
    else:  # a table's cells: numbers, booleans, text, None
        values = np.array([float(v) if isinstance(v, (bool, np.bool_, int, float, np.number)) else np.nan
                           for v in labels.ravel()])
    bad = np.flatnonzero(~np.isin(values, (-1, 0, 1)))
    if bad.size:
        return (int(bad[0]),)
    minus, zero = np.flatnonzero(values == -1), np.flatnonzero(values == 0)
    return (int(minus[0]), int(zero[0])) if minus.size and zero.size else None


def check_mil_data(X: Any, bag_ids: Any, y: Any | None = None, *, n_features: int | None = None,
                   names: np.ndarray | None = None) -> tuple[Any, BagIndex, np.ndarray | None]:
    """Validate instances, bag ids and (optionally) per-instance bag labels.

    Returns ``(X, bags, bag_labels)`` where ``bag_labels`` (B,) is in {0, 1}, ordered like
    ``bags.keys``. ``y`` is 0/1 (or booleans) or −1/+1, the MIL benchmarks' other convention; in
    both 1 is the positive bag. Raises ``ValueError`` for NaN/inf, mismatched lengths, other
    labels, a bag whose instances carry different labels, or a single class.
    """
    bag_ids = np.asarray(bag_ids)
    X = check_features(X, n_features=n_features, names=names,
                       bag_ids=bag_ids if bag_ids.ndim == 1 and np.shape(X)[:1] == bag_ids.shape else None)
    if bag_ids.ndim != 1 or bag_ids.shape[0] != X.shape[0]:
        raise ValueError(f"bag_ids must be 1-D with one entry per instance ({X.shape[0]}), got shape {bag_ids.shape}")
    if bag_ids.dtype.kind == "f" and not np.all(np.isfinite(bag_ids)):
        raise ValueError("bag_ids contains NaN or infinity")
    if bag_ids.dtype.kind == "O":
        missing = np.flatnonzero([_is_missing_id(v) for v in bag_ids])
        if missing.size:
            raise ValueError(f"bag_ids has no bag id at row(s) {missing[:5].tolist()} ({bag_ids[missing[0]]!r})")
        kinds = sorted({_id_kind(v) for v in bag_ids})
        if len(kinds) > 1:
            raise ValueError(f"bag_ids mixes types ({', '.join(kinds)}); give every bag id the same type")
    bags = BagIndex.from_ids(bag_ids)
    if y is None:
        return X, bags, None
    y = np.asarray(y)
    if y.dtype.kind == "O" and all(isinstance(v, (bool, int, float, np.number, np.bool_)) for v in y.ravel()):
        y = y.astype(np.float64)  # numbers in an object array (a mixed DataFrame's .values column)
    if y.ndim != 1 or y.shape[0] != X.shape[0]:
        raise ValueError(f"y must be 1-D with one bag label per instance ({X.shape[0]}), got shape {y.shape}")
    if (problem := label_problem(y)) is not None:
        def bag(row: int) -> str:
            key = bag_ids[row]
            return f"bag {key.item() if isinstance(key, np.generic) else key!r}, row {row}"

        if len(problem) == 2:  # -1 beside 0: two conventions, so which is negative?
            raise ValueError(f"bag labels mix -1 ({bag(problem[0])}) and 0 ({bag(problem[1])}): "
                             "give the negative bags 0, or all of them -1")
        found = np.unique(y)
        bad = found[~np.isin(found, (-1, 0, 1))] if y.dtype.kind in "biuf" else found
        raise ValueError(f"bag labels must be 0 or 1 (or -1 and 1; 1 is positive), found "
                         f"{bad[:5].tolist()} (the first: {bag(problem[0])})")
    y_sorted = (y[bags.order] == 1).astype(np.int8)
    lo = np.minimum.reduceat(y_sorted, bags.offsets[:-1])
    hi = np.maximum.reduceat(y_sorted, bags.offsets[:-1])
    mixed = np.flatnonzero(lo != hi)
    if mixed.size:
        raise ValueError(
            f"bag {bags.key(mixed[0])!r} has instances with different bag labels; y must repeat each "
            f"bag's label for all of its instances ({mixed.size} such bag(s))"
        )
    labels = lo.astype(np.int8)
    if np.unique(labels).size < 2:
        raise ValueError(f"need bags of both classes to fit, all {labels.size} bags have label {labels[0]}")
    return X, bags, labels
