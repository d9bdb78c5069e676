"""Shared estimator machinery for the sparse-GP MIL models (scikit-learn conventions)."""

from __future__ import annotations

import copy
import functools
import hashlib
import inspect
import warnings
from abc import abstractmethod
from collections.abc import Callable, MutableMapping
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, clone
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import RepeatedStratifiedKFold, train_test_split
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted

from .._backend import take_rows, to_numpy
from ..bags import BagIndex, split_into_blocks
from ..engine import BagBlock, FitTrace, HeldOutRows, PartitionUpdates, SerialExecutor, SparseGP, optimise
from ..inducing import kmeans_inducing_points
from ..kernels import RBF
from ..metrics import binary_auc
from ..relevance import relevance_weightings
from ..threadpools import concurrent_parts, single_thread_when_small
from ..validation import check_features, check_mil_data, feature_names, standardisation, standardise
from .hyper import HYPER_PARAMETER_FLAGS

__all__ = ["AUTO_BAG_RULES", "BagRuleChoice", "SparseGPMILBase", "best_candidate", "choice_bags", "store_params", "sweep_budget", "take_bags", "uses_coords", "AUTO_VARIANCES"]

AUTO_VARIANCES: tuple[float, ...] = (1.0, 4.0, 16.0, 64.0)
"""Kernel variances tried when ``kernel=None`` (ℓ = √D on standardised features)."""
_SELECTION_MAX_ITER = 50
_SELECTION_EVERY = 5
_SELECTION_MAX_INSTANCES = 20_000
_SELECTION_MIN_BAGS = 8
_SELECTION_REPEATS = 3
AUTO_BAG_RULES: tuple[str, ...] = ("top_fraction", "max", "mean")
"""Rules ``bag_rule="auto"`` chooses from, its default first (noisy-OR is left out: its ranking
follows bag size; so is the probit family's orthant probability)."""
_RULE_SWITCH_SE, _RULE_SWITCH_MARGIN = 2.0, 0.1
"""``bag_rule="auto"`` leaves the default rule only for one better by this many paired standard
errors and by this much held-out AUC (``mean`` where the default is below chance: the errors
alone; :func:`clearly_better_rule`)."""


def best_candidate(scores: dict[Any, np.ndarray], checkpoints: np.ndarray,
                   smaller_within_se: float = 0.0) -> tuple[Any, int] | None:
    """``(candidate, sweeps)`` with the best mean held-out AUC over the splits (``scores[c]``:
    splits × checkpoints; a candidate is a variance, or a tuple that starts with one); ties go to
    fewer sweeps, then the smaller candidate. A checkpoint with a nan (a degenerate split) is out;
    ``None`` when none is left.

    ``smaller_within_se = f > 0``: every point whose shortfall to that best point, paired split by
    split, averages at most ``f`` of its standard error counts as tied with it, and the smallest
    candidate (variance) among those wins (at its best mean; ties: fewer sweeps). The splits are
    the same for every candidate, so the paired difference is what tells them apart."""
    table = [(round(float(np.mean(a[:, i])), 9), int(checkpoints[i]), c, i)
             for c, a in scores.items() for i in range(checkpoints.shape[0]) if np.all(np.isfinite(a[:, i]))]
    if not table:
        return None
    _, sweeps, chosen, column = min(table, key=lambda row: (-row[0], row[1], row[2]))
    if smaller_within_se <= 0:
        return chosen, sweeps
    best = scores[chosen][:, column]
    tied = []
    for mean, s, c, i in table:
        shortfall = best - scores[c][:, i]
        se = shortfall.std(ddof=1) / np.sqrt(shortfall.size) if shortfall.size > 1 else 0.0
        if shortfall.mean() <= smaller_within_se * se + 1e-12:
            tied.append((c, -mean, s))
    c, _, sweeps = min(tied)
    return c, sweeps


def clearly_better_rule(curves: dict[str, np.ndarray], n_se: float = _RULE_SWITCH_SE,
                        margin: float = _RULE_SWITCH_MARGIN) -> str:
    """The bag rule of an automatic choice: the first of ``curves`` (the default rule), unless
    another rule's held-out AUC beats it, paired split by split, by more than ``n_se`` standard
    errors *and* by more than ``margin`` on average. ``curves[rule]``: splits × variances ×
    checkpoints, nan where degenerate; a split's score is its mean over every (variance, sweeps)
    point, steadier than one maximum. Of several such rules, the one with the largest mean
    advantage wins. The margin keeps a rule that ranks the held-out bags from being dropped on
    noise. Where the default ranks them below chance on average (weak witnesses in bags whose
    size is anti-predictive: a top rule ranks by size), the standard errors alone decide for
    ``mean``, whose scores do not grow with bag size (``max`` grows faster than the default)."""
    default, *others = curves
    overall = {rule: np.ma.masked_invalid(c.reshape(c.shape[0], -1)).mean(axis=1).filled(np.nan) for rule, c in curves.items()}
    scored = overall[default][np.isfinite(overall[default])]
    below_chance = bool(scored.size) and scored.mean() < 0.5
    best, best_gain = default, 0.0
    for rule in others:
        gain = overall[rule] - overall[default]
        gain = gain[np.isfinite(gain)]
        if gain.size < 2:
            continue
        se = gain.std(ddof=1) / np.sqrt(gain.size)
        needed = 0.0 if below_chance and rule == "mean" else margin
        if gain.mean() > max(n_se * se, needed, best_gain):
            best, best_gain = rule, float(gain.mean())
    return best


def _digest(*parts: Any) -> str:
    """A hex digest of arrays (their dtype, shape and bytes), ``None`` and values by ``repr``."""
    h = hashlib.blake2b(digest_size=20)
    for part in parts:
        if hasattr(part, "shape") and hasattr(part, "dtype"):  # an array, on the host or a device
            part = to_numpy(part)
            h.update(f"{part.dtype.str}{part.shape}".encode())
            h.update(np.ascontiguousarray(part).data)
        else:
            h.update(repr(part).encode())
        h.update(b"\x00")
    return h.hexdigest()


def _nan_max(a: np.ndarray) -> float:
    """The largest entry of ``a`` that is not nan; nan when all are (every checkpoint degenerate)."""
    return np.nan if np.all(np.isnan(a)) else float(np.nanmax(a))


def choice_bags(sizes: np.ndarray, labels: np.ndarray, random_state: Any, cap: int | None = None) -> np.ndarray:
    """Positions (ascending) of the whole bags the automatic kernel choice fits on: every bag when
    they hold at most ``cap`` instances (default 20,000); else the bags of a seeded permutation,
    in its order, while they fit under ``cap``, topped up to 8 bags per class (or all of a class)
    from the same permutation.

    Whole bags, never rows within bags: a positive bag with one witness among thousands of
    instances would lose it to a row sample and become a mislabelled bag in the choice. The
    sample depends only on the bags' sizes, labels and ``random_state``, so ``model.fit`` and
    the cluster fit (:func:`tasks.training.fit.fit_cohort`, which reads these bags from the store
    whatever its k-means sample) fit the choice on the same bags."""
    sizes, labels = np.asarray(sizes), np.asarray(labels)
    cap = _SELECTION_MAX_INSTANCES if cap is None else cap
    if sizes.sum() <= cap:
        return np.arange(sizes.shape[0])
    seed = random_state.randint(2**31 - 1) if isinstance(random_state, np.random.RandomState) else random_state
    order = np.random.default_rng(seed).permutation(sizes.shape[0])
    taken = np.zeros(sizes.shape[0], dtype=bool)
    taken[order[np.cumsum(sizes[order]) <= cap]] = True
    for label in (0, 1):  # enough bags of each class for the split
        of_class = order[labels[order] == label]
        missing = _SELECTION_MIN_BAGS - np.sum(taken[of_class])
        if missing > 0:
            taken[of_class[~taken[of_class]][:missing]] = True
    return np.flatnonzero(taken)


def sweep_budget(estimator: Any, monitor: Callable[[int, Any], bool] | None) -> tuple[int, Callable[[int, Any], bool] | None]:
    """The sweeps a fit of ``estimator`` runs and the :func:`~mil_core.engine.optimise` monitor that ends it.

    ``auto_max_iter_`` below ``max_iter`` (:meth:`SparseGPMILBase._select_kernel` chose when to
    stop) ends the run through the monitor, as early stopping does: the chosen stop is the intended
    one, not a failure to converge, and raises no ``ConvergenceWarning``. A run that reaches
    ``max_iter`` (the user's) before ``tol`` still warns. ``monitor`` is called every sweep, as
    before. The serial ``fit`` and ``tasks.training.fit_cohort`` both stop this way."""
    chosen = getattr(estimator, "auto_max_iter_", None)
    if chosen is None or chosen >= estimator.max_iter:
        return int(estimator.max_iter), monitor

    def stop_at_chosen(iteration: int, glob: Any) -> bool:
        stop = monitor is not None and monitor(iteration, glob)
        return stop or iteration >= chosen

    return int(chosen), stop_at_chosen


def store_params(estimator: BaseEstimator, init_locals: dict[str, Any]) -> None:
    """scikit-learn convention: ``__init__`` stores its arguments unchanged, nothing else."""
    for name, value in init_locals.items():
        if name not in ("self", "__class__"):
            setattr(estimator, name, value)


def fitted_names(estimator: BaseEstimator) -> np.ndarray | None:
    """The DataFrame columns ``estimator`` was fitted on (``feature_names_in_``), or None."""
    return getattr(estimator, "feature_names_in_", None)


def forget_fit(estimator: BaseEstimator, names: np.ndarray | None) -> None:
    """Drop every fitted attribute (``name_``) before a new fit, as scikit-learn's estimators do: a
    refit without early stopping kept the first fit's ``best_iteration_`` and ``validation_auc_``
    (and a model saved from it, those numbers). ``names``: the DataFrame columns the fit is given
    (:func:`~mil_core.validation.feature_names`), kept as ``feature_names_in_``; predictions check them."""
    for name in [name for name in vars(estimator) if name.endswith("_") and not name.startswith("__")]:
        delattr(estimator, name)
    if names is not None:
        estimator.feature_names_in_ = names


def _setting_kernel(variance: float, setting: dict[str, Any],
                    relevance: Callable[[], dict[str, tuple[float, ...]]]) -> tuple[RBF, dict[str, Any]]:
    """The kernel of a kernel-choice candidate, ``RBF(v, bias=kernel_bias·v)`` (``kernel_bias``:
    0 when the setting does not name it) with ``length_scale=relevance()[form]`` when the setting
    names ``"relevance": form`` (:func:`~mil_core.relevance.relevance_weightings` of the bags the
    candidate trains on, one of :data:`~mil_core.relevance.RELEVANCE_FORMS`; else ℓ = √D), and
    the setting's constructor parameters (the rest)."""
    params = dict(setting)
    ratio = float(params.pop("kernel_bias", 0.0))
    form = params.pop("relevance", None)
    length_scale = None if form is None else relevance()[form]
    return RBF(variance=variance, length_scale=length_scale, bias=ratio * variance), params


def take_bags(X_sorted: Any, offsets: np.ndarray, bags: np.ndarray) -> tuple[Any, np.ndarray]:
    """Rows and CSR offsets of the selected bags (indices into ``offsets``), in the given order."""
    sizes = np.diff(offsets)[bags]
    starts = offsets[:-1][bags]
    new_offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    rows = np.repeat(starts - new_offsets[:-1], sizes) + np.arange(new_offsets[-1])
    return take_rows(X_sorted, rows), new_offsets


class FeatureStandardisation:
    """The ``standardize`` parameter (put before ``BaseEstimator`` in the bases). With ``True``
    ``fit`` standardises its rows with their columns' mean and scale (a column with std < 1e-12
    keeps scale 1), kept as ``feature_mean_`` / ``feature_scale_``, and every ``predict_*`` applies
    them, so the kernel's ℓ = √D (seed 000's ``l = D``, a length for unit-variance features; AbSMIL's
    random features: 1/√D), a given ``length_scale`` and ``gp_.Z`` are in units of each feature's
    std. Fitted as given, the raw MUSK files scored bag AUC 0.5 with every default
    (``docs/BENCHMARKS.md``, "Features in their own units"). ``False``: the features as given,
    ``feature_mean_`` None. An executor that trains outside ``fit`` (``tasks.training``)
    standardises the same way and sets both after the fit."""

    def _standardise_training_rows(self, X: Any) -> tuple[Any, tuple[np.ndarray | None, np.ndarray | None]]:
        """``X`` (the fit's own sorted copy of the rows, overwritten) standardised and its
        ``(mean, scale)`` when ``standardize``; else ``X`` and ``(None, None)``."""
        if not self.standardize:
            return X, (None, None)
        mean, scale = standardisation(X)
        return standardise(X, mean, scale, in_place=True), (mean, scale)

    def _check_restored(self) -> None:
        """A model read from disk (:mod:`mil_core.persist`): its width and scaling are what a fit
        writes (a tampered file raises ``ValueError`` here, not a wrong prediction later)."""
        width = getattr(self, "n_features_in_", None)
        if width is None:
            return
        if not (isinstance(width, (int, np.integer)) and not isinstance(width, bool) and width >= 1):
            raise ValueError(f"n_features_in_ is {width!r}, not a positive integer")
        for name in ("feature_mean_", "feature_scale_"):
            value = getattr(self, name, None)
            if value is not None and not (isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.shape == (width,)
                                          and np.all(np.isfinite(value))):
                raise ValueError(f"{name} is not {width} finite floats")
        if (scale := getattr(self, "feature_scale_", None)) is not None and not np.all(scale > 0):
            raise ValueError("feature_scale_ holds a scale <= 0")

    def _standardised_input(self, X: Any) -> Any:
        """Prediction rows in the units the model was fitted in."""
        mean = getattr(self, "feature_mean_", None)  # None also for a model saved before it existed
        return X if mean is None else standardise(X, mean, self.feature_scale_)


class SparseGPMILBase(FeatureStandardisation, BaseEstimator):
    """Fit loop shared by the sparse-GP MIL estimators.

    Subclasses declare their parameters in ``__init__`` (scikit-learn style: stored only) and
    implement :meth:`_make_updates` (the model's partition step / global update) and
    :meth:`_bag_proba_from_state` (bag probabilities from a fitted global state, used for
    validation-based early stopping and prediction).

    Common parameters: ``n_inducing``, ``kernel`` (:class:`~mil_core.kernels.RBF`; ``None``, the
    default, chooses ``RBF(v, length_scale=√D)`` and the stop by :meth:`_select_kernel`), ``standardize``
    (fit and predict on features standardised with the training instances' mean and scale,
    ``feature_mean_`` / ``feature_scale_``), ``max_iter``, ``tol`` (relative ELBO change),
    ``early_stopping`` / ``validation_fraction`` / ``n_iter_no_change`` (bag-AUC patience on a
    stratified hold-out of bags; the best iterate is kept, as in seed 000 Sec. 6),
    ``block_size`` (instances per partition of whole bags for the serial executor),
    ``random_state``.
    """

    objective_name: str = "ELBO"
    """What the fit's objective trace (``elbo_``) is: named so in the pipeline's progress log,
    ``model.json`` and the report (a sampler reports its log joint)."""

    # ---- hooks -----------------------------------------------------------------------------
    @abstractmethod
    def _make_updates(self, gp: SparseGP) -> PartitionUpdates: ...

    @abstractmethod
    def _bag_proba_from_state(self, gp: SparseGP, glob: Any, X_sorted: Any, offsets: np.ndarray) -> np.ndarray: ...

    # ---- fit ---------------------------------------------------------------------------------
    def _check_params(self) -> None:
        """The parameters' values, before any data: what a pipeline configuration is checked with."""
        self._check_common_params(None)

    def _check_common_params(self, n_instances: int | None) -> None:
        """The parameters as a fit checks them (``n_instances``: its training instances, None when
        not known yet)."""
        if not (isinstance(self.n_inducing, (int, np.integer)) and self.n_inducing >= 2):
            raise ValueError(f"n_inducing must be an integer >= 2, got {self.n_inducing!r}")
        if n_instances is not None and self.n_inducing > n_instances and self.n_inducing != _constructor_default(self, "n_inducing"):
            # the user's own n_inducing is worth a word; the default on a small cohort is the documented exact GP
            warnings.warn(f"n_inducing={self.n_inducing} exceeds the number of training instances ({n_instances}): "
                          f"every training instance is an inducing point (the exact GP)", UserWarning, stacklevel=2)
        counts = {"max_iter": self.max_iter, "n_mc_samples": getattr(self, "n_mc_samples", 1),
                  "n_iter_no_change": self.n_iter_no_change if self.early_stopping else 1}
        for name, value in counts.items():
            if not (isinstance(value, (int, np.integer)) and not isinstance(value, bool) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.kernel is not None and not callable(getattr(self.kernel, "resolve", None)):
            raise ValueError(f"kernel must be None (chosen from the training bags) or a kernel such as RBF(4.0), "
                             f"got {self.kernel!r}")
        if self.tol is not None and self.tol < 0:  # None: a sampler, which runs all its sweeps
            raise ValueError(f"tol must be >= 0, got {self.tol}")
        if self.early_stopping and not 0 < self.validation_fraction < 1:
            raise ValueError(f"validation_fraction must be in (0, 1), got {self.validation_fraction}")

    def _split_validation(self, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        bags = np.arange(labels.shape[0])
        if not self.early_stopping:
            return bags, None
        rng = check_random_state(self.random_state)
        try:
            train, val = train_test_split(
                bags, test_size=self.validation_fraction, stratify=labels, random_state=rng.randint(2**31 - 1)
            )
        except ValueError as error:  # too few bags of a class for a stratified hold-out
            raise ValueError(f"early_stopping holds out validation_fraction={self.validation_fraction} of the "
                             f"{labels.size} bags ({np.bincount(labels, minlength=2).tolist()} negative/positive), and "
                             f"each part needs bags of both classes: give more bags, another validation_fraction, or "
                             f"early_stopping=False ({error})") from None
        return np.sort(train), np.sort(val)

    @single_thread_when_small
    def fit(self, X: Any, bag_ids: Any, y: Any, coords: Any | None = None) -> SparseGPMILBase:
        """Fit on instances ``X`` (N, D), their ``bag_ids`` (N,) and ``y`` (N,), the bag label of
        each instance's bag (constant within a bag). ``coords`` (instance grid positions) only
        for models that use them (see :meth:`_check_coords`)."""
        names = feature_names(X)
        X, bags, labels = check_mil_data(X, bag_ids, y)
        self._check_common_params(X.shape[0])
        coords_sorted = self._check_coords(coords, bags)
        forget_fit(self, names)
        X_sorted, scaling = self._standardise_training_rows(take_rows(X, bags.order))
        train, val = self._split_validation(labels)
        X_train, offsets = take_bags(X_sorted, bags.offsets, train)
        coords_train = None if coords_sorted is None else take_bags(coords_sorted, bags.offsets, train)[0]
        train_labels = labels[train]

        updates = self._start_fit(X_train, np.repeat(train_labels, np.diff(offsets)), offsets=offsets, coords=coords_train)
        blocks = [
            BagBlock(
                X=X_train[offsets[a] : offsets[b], ...],
                offsets=offsets[a : b + 1] - offsets[a],
                labels=train_labels[a:b],
                coords=None if coords_train is None else coords_train[offsets[a] : offsets[b]],
            )
            for a, b in split_into_blocks(offsets, self.block_size)
        ]
        executor = SerialExecutor(updates, blocks)
        monitor = None
        if val is not None:
            X_val, val_offsets = take_bags(X_sorted, bags.offsets, val)
            val_coords = {} if coords_sorted is None else {"coords": take_bags(coords_sorted, bags.offsets, val)[0]}
            val_rows, val_context = HeldOutRows(X_val), self._held_out_context(val_offsets, **val_coords)
            monitor = _EarlyStopping(
                score=lambda glob: binary_auc(
                    labels[val], self._bag_proba_from_state(self.gp_, glob, val_rows, val_offsets, **val_context)
                ),
                patience=self.n_iter_no_change,
            )
        max_iter, stop = sweep_budget(self, monitor)
        trace = optimise(executor.sweep, updates, updates.init_global(), max_iter=max_iter, tol=self.tol, monitor=stop)
        self._finish_fit(trace, monitor)
        self.feature_mean_, self.feature_scale_ = scaling
        return self

    def _check_coords(self, coords: Any | None, bags: BagIndex) -> np.ndarray | None:
        """Instance coordinates in bag order (passed to the blocks and, as ``coords=``, to
        :meth:`_bag_proba_from_state`). Models that use them override this; the others reject them."""
        if coords is not None:
            raise ValueError(f"{type(self).__name__} does not use instance coordinates; fit without coords")
        return None

    def _start_fit(
        self, X_train: Any, instance_labels: np.ndarray, offsets: np.ndarray | None = None, coords: np.ndarray | None = None,
        choice: BagBlock | None = None, inducing: np.ndarray | None = None, choice_memo: MutableMapping[str, Any] | None = None,
    ) -> PartitionUpdates:
        """Set ``n_features_in_``, ``kernel_`` and ``gp_`` (k-means inducing points on
        ``X_train``, labelled by their bag's label, unless ``inducing`` gives them) and return the
        model's updates.

        With ``kernel=None`` and the bags' CSR ``offsets`` (whole bags in ``X_train``; and ``coords``
        for models that read them), the kernel variance is chosen by :meth:`_select_kernel` on the
        bags of :func:`choice_bags`, or on ``choice`` (those bags, read by an executor whose
        ``X_train`` is a sample of the training bags); otherwise it is the middle of
        :meth:`_auto_variances` (the lower of two middles; 4 for most models). ``choice_memo``:
        see :meth:`_choice_scores` (an executor's record of the choice, so a restarted fit does
        not repeat it). Also the entry point of executors that train outside :meth:`fit`
        (``tasks.training``).
        """
        self.n_features_in_ = X_train.shape[1]
        self.classes_ = np.array([0, 1])
        self.feature_mean_ = self.feature_scale_ = None  # an executor's rows come as they are used (fit sets its own)
        kernel, self.auto_max_iter_, self.kernel_selection_, self.setting_selection_ = self.kernel, None, np.empty((0, 2)), []
        X_host = to_numpy(X_train)  # device input: the one copy to the host, for the choice of kernel and k-means
        if kernel is None and offsets is not None and (coords is not None or not self._choice_needs_coords()):
            if choice is None:
                labels = instance_labels[offsets[:-1]]
                picked = choice_bags(np.diff(offsets), labels, self.random_state)
                X_choice, choice_offsets = take_bags(X_host, offsets, picked)
                choice = BagBlock(X=X_choice, offsets=choice_offsets, labels=labels[picked],
                                  coords=None if coords is None else take_bags(coords, offsets, picked)[0])
            kernel = self._select_kernel(to_numpy(choice.X), choice.offsets, np.asarray(choice.labels), choice.coords,
                                         memo=choice_memo)
        grid = self._auto_variances()
        self.kernel_ = (kernel or RBF(variance=grid[(len(grid) - 1) // 2])).resolve(self.n_features_in_)
        if inducing is None:
            inducing = kmeans_inducing_points(X_host, instance_labels, min(self.n_inducing, X_host.shape[0]),
                                              random_state=self.random_state)
        self.gp_ = SparseGP.build(self.kernel_, inducing)
        return self._make_updates(self.gp_)

    def _auto_variances(self) -> tuple[float, ...]:
        """Kernel variances that ``kernel=None`` tries (ascending); models whose likelihood is
        improper for large latent variances override it (G-VGPMIL)."""
        return AUTO_VARIANCES

    def _smaller_variance_within_se(self) -> float:
        """How many standard errors of the paired shortfall to the best (variance, sweeps) point a
        smaller variance may lose and still be chosen (:func:`best_candidate`); 0: the best mean wins."""
        return 0.0

    def _auto_bag_rules(self) -> tuple[str | None, ...]:
        """Bag rules that ``kernel=None`` chooses from with the kernel (each checkpoint is scored by
        every one, :meth:`_bag_probas_from_state`); ``(None,)``: the model's own bag score only."""
        return (None,)

    def _auto_settings(self, bag_sizes: np.ndarray) -> tuple[dict[str, Any], ...]:
        """Constructor parameters that ``kernel=None`` chooses together with the variance, for the
        choice's bags of ``bag_sizes`` instances: each
        setting is a candidate beside every variance (ties: fewer sweeps, the smaller variance,
        then the earlier setting), and the chosen one's values become the fitted ``<name>_``
        attributes (VGPMIL's ``H="auto"``: ``H_``). A setting (here or in
        :meth:`_refined_candidates`) may also name ``"kernel_bias"``: the kernel's constant term
        as a multiple of the variance, and ``"relevance": True``: per-feature length scales from the
        bag labels (:func:`_setting_kernel`).
        ``({},)``: the variance and sweeps only."""
        return ({},)

    def _refined_candidates(self, variance: float, setting: dict[str, Any],
                            settings: tuple[dict[str, Any], ...]) -> tuple[tuple[float, dict[str, Any]], ...]:
        """``(variance, setting)`` candidates that ``kernel=None`` tries in a second stage, given the
        point the first stage chose (its ``variance`` and ``setting``, one of the first stage's
        ``settings``): on the same splits and
        k-means, under the bag rule already chosen; the best point of both stages wins (ties: the
        first stage's). For a setting worth trying near the chosen point only: a few fits per split
        where adding it to :meth:`_auto_settings` costs one per variance (the logistic family's
        constant kernel). ``()``: no second stage."""
        return ()

    def _bag_probas_from_state(self, gp: SparseGP, glob: Any, X_sorted: Any, offsets: np.ndarray,
                               rules: tuple[str | None, ...], **coords: Any) -> dict[str | None, np.ndarray]:
        """Bag scores of a fit state under each of ``rules`` (``None``: the estimator's own), for the
        kernel choice. A model scored by its own rule only (``rules == (None,)``) needs nothing
        more; a family with several rules (:class:`BagRuleChoice`) overrides it."""
        if rules != (None,):
            raise NotImplementedError(f"{type(self).__name__} scores bags by its own rule only, not by {rules}")
        return {None: self._bag_proba_from_state(gp, glob, X_sorted, offsets, **coords)}

    def _held_out_context(self, offsets: np.ndarray, **coords: Any) -> dict[str, Any]:
        """Keyword arguments of :meth:`_bag_proba_from_state` for held-out bags that are scored
        again and again (every checkpoint of the kernel choice, every sweep of early stopping):
        their ``coords``, and what a family can prepare for them once (the probit family: their
        coupling and its per-bag covariances)."""
        return dict(coords)

    def _choice_needs_coords(self) -> bool:
        """Whether :meth:`_select_kernel` needs instance coords: for models that read them (the Gibbs
        reference reads none at λ = 0)."""
        return uses_coords(self)

    @single_thread_when_small
    def _select_kernel(self, X_sorted: np.ndarray, offsets: np.ndarray, labels: np.ndarray, coords: np.ndarray | None,
                       memo: MutableMapping[str, Any] | None = None) -> RBF | None:
        """``kernel=None``: the RBF variance from :meth:`_auto_variances` (ℓ = √D) *and* the number of
        sweeps, by held-out bag AUC (the estimator's bag rule) over 3 repeats of a stratified 2-fold
        split of the training bags (the bags of :func:`choice_bags`). Each candidate runs up to
        ``min(max_iter, 50)`` sweeps and is scored every 5 (a split's candidates share one k-means,
        and its held-out rows are whitened once per candidate); the (variance, sweeps) point with the
        best mean of its 6 held-out AUCs wins (:func:`best_candidate`), or the smallest variance
        within :meth:`_smaller_variance_within_se` standard errors of it (G-VGPMIL). Models with several
        :meth:`_auto_bag_rules` score each checkpoint with each; the rule is chosen first
        (``bag_rule_``: the first rule unless another is clearly better, :func:`clearly_better_rule`),
        then the variance and sweeps under it. A model with several :meth:`_auto_settings` (VGPMIL's
        ``H="auto"``) tries each beside every variance and keeps the best point's. A second stage
        then fits the :meth:`_refined_candidates` of that point (the logistic family's constant
        kernel and relevance length scales) on the same splits, under the rule chosen, and the best
        point of both stages wins (ties: the first stage's). Sets ``kernel_selection_`` (rows:
        variance, its best mean AUC, under the setting the first stage chose),
        ``setting_selection_`` (``[setting, its best mean
        AUC over the variances it was tried at]`` when there are several) and
        ``auto_max_iter_`` (the sweeps the final fit may run). Returns ``None`` (the fallback
        kernel) when a class has fewer than 2 bags, or when every candidate is degenerate: a
        checkpoint whose held-out bag scores are non-finite or all equal (a fit that ran away, its
        probabilities saturated into ties) is never chosen, whatever the AUC of 0.5 its ties give.

        Why: v = 1 keeps instance probabilities near ½, the best v differs by data set, and with a
        large v the held-out AUC of a fit can fall as it runs on (MUSK2: 0.81 after 25 sweeps,
        0.62 after 200), so variance and stopping are chosen together. On small sets one split is
        noisy (a held-out half of MUSK1 has ~18 bags of each class): 3 repeats average that noise
        out, which was worth more than pooling the held-out scores or preferring the simpler of
        near-tied candidates (``docs/MODELS.md``, "Automatic defaults", has the measurement). A
        split of the training bags sees no test bag and needs no proper
        likelihood (G-VGPMIL's is improper).
        """
        self.kernel_selection_, self.auto_max_iter_, self.setting_selection_ = np.empty((0, 2)), None, []
        if np.bincount(labels, minlength=2).min() < 2:
            return None
        rng = check_random_state(self.random_state)
        budget = min(int(self.max_iter), _SELECTION_MAX_ITER)
        checkpoints = np.unique(np.r_[np.arange(_SELECTION_EVERY, budget + 1, _SELECTION_EVERY), budget])
        splits = list(RepeatedStratifiedKFold(n_splits=2, n_repeats=_SELECTION_REPEATS, random_state=rng.randint(2**31 - 1)).split(labels, labels))
        inducing: list[np.ndarray | None] = [None] * len(splits)  # one k-means per split, shared by its candidates
        settings, rules = self._auto_settings(np.diff(offsets)), self._auto_bag_rules()
        candidates = [(v, k) for v in self._auto_variances() for k in range(len(settings))]  # (variance, setting)
        scores = self._choice_scores(X_sorted, offsets, labels, coords, splits, inducing, candidates, settings, rules, checkpoints, memo)
        rule = rules[0]
        if len(rules) > 1:
            rule = self.bag_rule_ = clearly_better_rule({r: np.stack([scores[c, r] for c in candidates], axis=1) for r in rules})
        chosen = best_candidate({c: scores[c, rule] for c in candidates}, checkpoints, self._smaller_variance_within_se())
        first = 0 if chosen is None else chosen[0][1]  # the setting whose variances were compared
        refined = () if chosen is None else self._refined_candidates(chosen[0][0], settings[first], settings)
        for _, setting in refined:
            if setting not in settings:
                settings += (setting,)
        extra = [c for c in ((v, settings.index(setting)) for v, setting in refined) if c not in candidates]
        if extra:  # the second stage: on the same splits and k-means, under the rule already chosen
            scores.update(self._choice_scores(X_sorted, offsets, labels, coords, splits, inducing, extra, settings, (rule,), checkpoints, memo))
            candidates += extra
            chosen = best_candidate({c: scores[c, rule] for c in candidates}, checkpoints, self._smaller_variance_within_se())
        best_mean = {c: _nan_max(scores[c, rule].mean(axis=0)) for c in candidates}
        self.kernel_selection_ = np.array([[v, best_mean[v, j]] for v, j in candidates if j == first])
        if len(settings) > 1:  # each setting's best mean over the variances it was tried at
            self.setting_selection_ = [[dict(setting), _nan_max(np.array([best_mean[v, i] for v, i in candidates if i == j]))]
                                       for j, setting in enumerate(settings)]
        if chosen is None:
            return None
        (v, k), sweeps = chosen
        kernel, params = _setting_kernel(v, settings[k], lambda: relevance_weightings(X_sorted, offsets, labels))
        for name, value in params.items():
            setattr(self, f"{name}_", value)
        self.auto_max_iter_ = sweeps if sweeps < budget else int(self.max_iter)
        return kernel

    def _choice_scores(self, X_sorted: np.ndarray, offsets: np.ndarray, labels: np.ndarray, coords: np.ndarray | None,
                       splits: list[tuple[np.ndarray, np.ndarray]], inducing: list[np.ndarray | None],
                       candidates: list[tuple[float, int]], settings: tuple[dict[str, Any], ...],
                       rules: tuple[str | None, ...], checkpoints: np.ndarray,
                       memo: MutableMapping[str, Any] | None = None) -> dict[tuple[tuple[float, int], str | None], np.ndarray]:
        """Held-out bag AUC (splits × checkpoints, nan where degenerate) of each ``(variance,
        setting)`` candidate under each rule, for :meth:`_select_kernel`: every split fits each
        candidate on its training half for ``checkpoints[-1]`` sweeps and scores its held-out half at
        every checkpoint. ``inducing[i]``: split i's k-means, computed by its first fit and then
        shared (filled in here). The splits run side by side on the native threads a small fit gave
        up when their sweeps are BLAS work enough (:func:`~mil_core.threadpools.concurrent_parts`),
        with the serial loop's results. ``memo`` (a mapping the caller keeps, e.g. on disk) gets each
        split's ``(curves, k-means)`` once computed, under a digest of everything that determines
        them (rows, bags, labels, split, candidates, rules, the estimator's parameters); a split
        found there is not fitted again: a fit killed during the choice (minutes on a large
        cohort) resumes it where it stopped."""
        overrides = {"early_stopping": False, **{k: False for k in HYPER_PARAMETER_FLAGS if k in self.get_params()}}
        budget = int(checkpoints[-1])

        common = None if memo is None else _digest(X_sorted, offsets, labels, coords, candidates, settings, rules, checkpoints,
                                                   sorted((k, repr(v)) for k, v in self.get_params().items()), type(self).__name__)

        def split_curves(i: int) -> tuple[dict[tuple[tuple[float, int], str | None], np.ndarray], np.ndarray]:
            """Split i's held-out curve of every (candidate, rule), and its k-means (from ``memo`` if there)."""
            if memo is None:
                return fitted_split_curves(i)
            key = _digest(common, *splits[i], inducing[i])
            try:
                return memo[key]
            except KeyError:
                memo[key] = found = fitted_split_curves(i)
                return found

        def fitted_split_curves(i: int) -> tuple[dict[tuple[tuple[float, int], str | None], np.ndarray], np.ndarray]:
            train, val = splits[i]
            X_tr, tr_offsets = take_bags(X_sorted, offsets, train)
            X_val, val_offsets = take_bags(X_sorted, offsets, val)
            held_out = HeldOutRows(X_val)  # whitened once per candidate's GP, not at every checkpoint
            y_tr = np.repeat(labels[train], np.diff(tr_offsets))
            part = {} if coords is None else {"coords": take_bags(coords, offsets, train)[0]}
            val_context = self._held_out_context(val_offsets, **({} if coords is None else {"coords": take_bags(coords, offsets, val)[0]}))
            Z, curves, fitted = inducing[i], {}, {}
            # a relevance kernel weighs the features by this split's training half only, both forms computed once per split
            relevance = functools.cache(lambda: relevance_weightings(X_tr, tr_offsets, labels[train]))
            for v, k in candidates:
                kernel, params = _setting_kernel(v, settings[k], relevance)
                same = (kernel, tuple(sorted(params.items())))
                if same in fitted:  # two forms of the relevance weights that coincide on this half: one fit
                    curves.update({((v, k), rule): curves[fitted[same], rule] for rule in rules})
                    continue
                fitted[same] = (v, k)
                model = clone(self).set_params(kernel=kernel, **params, **overrides)
                updates = model._start_fit(X_tr, y_tr, inducing=Z)
                Z = model.gp_.Z
                executor = SerialExecutor(updates, [BagBlock(X=X_tr, offsets=tr_offsets, labels=labels[train], **part)])
                curve: dict[str | None, list[float]] = {r: [] for r in rules}

                def score(iteration: int, glob: Any, model: SparseGPMILBase = model, curve: dict[str | None, list[float]] = curve) -> bool:
                    if iteration in checkpoints:  # one fit, scored by every candidate rule
                        for rule, p in model._bag_probas_from_state(model.gp_, glob, held_out, val_offsets, rules, **val_context).items():
                            degenerate = not np.all(np.isfinite(p)) or np.ptp(p) == 0.0
                            curve[rule].append(np.nan if degenerate else binary_auc(labels[val], p))
                    return False

                optimise(executor.sweep, updates, updates.init_global(), max_iter=budget, tol=self.tol, monitor=score)
                for rule, points in curve.items():  # converged early: it stays
                    points += [points[-1] if points else 0.5] * (checkpoints.shape[0] - len(points))
                    curves[(v, k), rule] = np.asarray(points)
            return curves, Z

        with warnings.catch_warnings():  # stopping at the budget is the point here (the filters are the process's: set them once, here)
            warnings.simplefilter("ignore", ConvergenceWarning)
            per_split = concurrent_parts(split_curves, range(len(splits)), X_sorted.shape[0] // 2, int(self.n_inducing))  # fits on half the rows
        for i, (_, Z) in enumerate(per_split):
            inducing[i] = Z
        return {key: np.stack([split[key] for split, _ in per_split]) for key in per_split[0][0]}

    def _finish_fit(self, trace: FitTrace, monitor: _EarlyStopping | None = None) -> None:
        """Store the fitted state of an :func:`~mil_core.engine.optimise` run."""
        self.q_ = trace.glob if monitor is None else monitor.best_state
        self.elbo_ = np.asarray(trace.objective)
        self.n_iter_ = trace.n_iter
        self.converged_ = trace.converged
        if monitor is not None:
            self.validation_auc_ = np.asarray(monitor.scores)
            self.best_iteration_ = monitor.best_iteration

    # ---- shared prediction helpers -----------------------------------------------------------
    def _check_predict_input(self, X: Any, bag_ids: Any | None = None) -> tuple[Any, BagIndex | None]:
        check_is_fitted(self, "q_")
        if bag_ids is None:
            return self._standardised_input(check_features(X, n_features=self.n_features_in_, names=fitted_names(self))), None
        X, bags, _ = check_mil_data(X, bag_ids, n_features=self.n_features_in_, names=fitted_names(self))
        return self._standardised_input(X), bags

    def _check_restored(self) -> None:
        """As :meth:`FeatureStandardisation._check_restored`, and q(u) and the inducing points agree:
        M inducing points of the model's width, an M-vector mean and M × M matrices, all floats."""
        super()._check_restored()
        gp, q = getattr(self, "gp_", None), getattr(self, "q_", None)
        if gp is None or q is None:
            return
        M = np.shape(gp.Z)[0]
        expected = {"gp_.Z": (gp.Z, (M, self.n_features_in_)), "gp_.chol": (gp.chol, (M, M)),
                    "q_.mean": (q.mean, (M,)), "q_.cov": (q.cov, (M, M))}
        for name, (value, shape) in expected.items():
            if not (isinstance(value, np.ndarray) and value.dtype.kind == "f" and value.shape[:len(shape)] == shape):
                raise ValueError(f"{name} is {getattr(value, 'dtype', type(value).__name__)} {np.shape(value)}, "
                                 f"not floats of shape {shape}")

    def predict_latent(self, X: Any) -> tuple[np.ndarray, np.ndarray]:
        """Mean and variance of the latent f* at each row (Eq. 30, FITC diagonal)."""
        X, _ = self._check_predict_input(X)
        return self.gp_.whiten(X).latent_moments(self.q_)


class BagRuleChoice:
    """The ``bag_rule`` parameter of a family that scores bags by a rule on its instance
    probabilities (:func:`mil_core.bags.bag_score`; put before :class:`SparseGPMILBase` in the
    bases). ``bag_rule="auto"`` is the guard of :func:`clearly_better_rule`: ``top_fraction``
    unless the kernel choice finds ``mean`` or ``max`` clearly better; with a fixed kernel
    (no choice) ``top_fraction``. The rule in use is the fitted ``bag_rule_``: predictions,
    validation and the pipeline read it, never ``bag_rule``."""

    bag_rules: tuple[str, ...] = ()
    """The rules ``bag_rule`` may name besides ``"auto"``."""

    def _start_fit(self, X_train: Any, instance_labels: np.ndarray, offsets: np.ndarray | None = None,
                   coords: np.ndarray | None = None, choice: BagBlock | None = None,
                   inducing: np.ndarray | None = None, choice_memo: MutableMapping[str, Any] | None = None) -> PartitionUpdates:
        """``bag_rule_`` = the estimator's rule (``"auto"``: ``top_fraction`` until the kernel choice
        says otherwise), then the model's start."""
        if self.bag_rule != "auto" and self.bag_rule not in self.bag_rules:
            raise ValueError(f"bag_rule must be 'auto' or one of {', '.join(self.bag_rules)}, got {self.bag_rule!r}")
        self.bag_rule_ = AUTO_BAG_RULES[0] if self.bag_rule == "auto" else self.bag_rule
        return super()._start_fit(X_train, instance_labels, offsets=offsets, coords=coords, choice=choice, inducing=inducing,
                                  choice_memo=choice_memo)

    def _auto_bag_rules(self) -> tuple[str | None, ...]:
        return AUTO_BAG_RULES if self.bag_rule == "auto" else (None,)


class _EarlyStopping:
    """Monitor for :func:`~mil_core.engine.optimise`: validation bag AUC with patience; keeps the
    best global state."""

    def __init__(self, score: Callable[[Any], float], patience: int):
        self.score, self.patience = score, patience
        self.scores: list[float] = []
        self.best_state, self.best_iteration = None, 0

    def __call__(self, iteration: int, glob: Any) -> bool:
        s = float(self.score(glob))
        self.scores.append(s)
        if self.best_state is None or s > max(self.scores[:-1]):
            self.best_state, self.best_iteration = copy.deepcopy(glob), iteration
        return iteration - self.best_iteration >= self.patience


def _constructor_default(estimator: BaseEstimator, name: str) -> Any:
    """The default of ``name`` in the estimator class's ``__init__``."""
    return inspect.signature(type(estimator).__init__).parameters[name].default


def uses_coords(model: Any) -> bool:
    """Whether the model reads instance coordinates (it overrides the base class's refusal)."""
    return getattr(type(model), "_check_coords", SparseGPMILBase._check_coords) is not SparseGPMILBase._check_coords
