"""ABMIL: the gated-attention MIL network of :mod:`mil_core.attention` as an estimator (Ilse et al. 2018)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from sklearn.base import BaseEstimator
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted

from ..attention import (
    NetworkFit,
    _sigmoid,
    attention_weights,
    bag_logits,
    fit_attention_network,
    instance_embedding,
    instance_logits,
    network_arrays,
    validate_training_params,
)
from .._backend import to_numpy
from ..calibration import fit_platt, platt_proba
from ..validation import check_features, check_mil_data, feature_names
from .base import fitted_names, forget_fit, store_params, take_bags

__all__ = ["ABMIL", "AttentionNetworkParams"]


class AttentionNetworkParams:
    """Training and embedding shared by the estimators that own the network (their constructor
    parameters are documented there). ``_states()`` lists the fitted networks: ABMIL's one, an
    ensemble's members."""

    def _check_network_params(self, n_networks: int = 1) -> None:
        """The network's and its training's parameters, before any data."""
        if self.calibration not in ("platt", None):
            raise ValueError(f"calibration must be 'platt' or None, got {self.calibration!r}")
        if isinstance(self.hidden, (str, bytes)) or not np.iterable(self.hidden):  # "16" read as layers 1 and 6
            raise ValueError(f"hidden must be a list of layer widths (positive integers), e.g. [128], got {self.hidden!r}")
        validate_training_params(tuple(self.hidden), self.n_components, self.attention_dim, self.learning_rate,
                                 self.weight_decay, self.max_epochs, self.validation_fraction, self.n_epochs_no_change,
                                 n_networks, self.negative_instances)

    def _network_fit(self, X_sorted: np.ndarray, offsets: np.ndarray, labels: np.ndarray, seed: int,
                     n_networks: int = 1) -> NetworkFit:
        self._check_network_params(n_networks)
        return fit_attention_network(
            X_sorted, offsets, labels, hidden=tuple(self.hidden), n_components=self.n_components,
            attention_dim=self.attention_dim, learning_rate=self.learning_rate, weight_decay=self.weight_decay,
            max_epochs=self.max_epochs, early_stopping=self.early_stopping, validation_fraction=self.validation_fraction,
            n_epochs_no_change=self.n_epochs_no_change, seed=seed, hold_out=self.calibration is not None,
            n_networks=n_networks, negative_instances=self.negative_instances,
        )

    def _store_traces(self, fit: NetworkFit, n_features: int) -> None:
        self.n_features_in_ = n_features
        self.classes_ = np.array([0, 1])
        self.network_train_loss_ = fit.train_loss
        self.network_validation_loss_ = fit.validation_loss
        self.network_validation_auc_ = fit.validation_auc
        self.network_best_epoch_ = fit.best_epoch

    def _fit_calibration(self, scores: Callable[[], np.ndarray], val_labels: np.ndarray) -> None:
        """Platt scaling (``calibration="platt"``) of the held-out bags' ``scores()`` with their
        labels; the identity otherwise."""
        slope, intercept = 1.0, 0.0
        if self.calibration == "platt":
            slope, intercept = fit_platt(scores(), val_labels)
        self.calibration_slope_, self.calibration_intercept_ = slope, intercept

    def _standardised_input(self, X: Any) -> Any:
        """Prediction rows as given: the networks standardise their inputs themselves.
        :class:`~mil_core.EmbeddedGPMIL`'s ``standardize`` (its GPs may see the input features)
        replaces this by :class:`~mil_core.models.base.FeatureStandardisation`'s, earlier in its bases."""
        return X

    def _input_rows(self, X: Any) -> Any:
        """Validated prediction rows in the units the networks were fitted in."""
        check_is_fitted(self, "n_features_in_")
        return self._standardised_input(check_features(X, n_features=self.n_features_in_, names=fitted_names(self)))

    def _embed(self, X: Any, member: int = 0) -> np.ndarray:
        """Instance embeddings ``h = f_emb(x)`` (float64 NumPy) of validated input rows by network ``member``."""
        check_is_fitted(self, "n_features_in_")
        X = to_numpy(check_features(X, n_features=self.n_features_in_, names=fitted_names(self))).astype(np.float64, copy=False)
        return instance_embedding(network_arrays(self._states()[member]), X)

    def predict_attention(self, X: Any, bag_ids: Any) -> np.ndarray:
        """Attention weight ``α_n`` of each row within its bag (rows in input order; sums to 1 per
        bag; an ensemble's is the mean of its members')."""
        X = self._input_rows(X)
        _, bags, _ = check_mil_data(X, bag_ids)
        weights = np.zeros(bags.order.size)
        for member, state in enumerate(self._states()):
            H = self._embed(X, member)
            weights[bags.order] += attention_weights(network_arrays(state), H[bags.order], bags.offsets)
        return weights / len(self._states())


def _seed(random_state: Any) -> int:
    """An integer seed from ``random_state`` (None → fresh entropy, as scikit-learn's)."""
    return int(check_random_state(random_state).randint(2**31 - 1))


class ABMIL(AttentionNetworkParams, BaseEstimator):
    """Attention-based deep MIL (Ilse et al. 2018) with gated attention: the network alone.

    The baseline the GP-MIL models are measured against (issue 15); :class:`~mil_core.EmbeddedGPMIL`
    trains the same network and replaces its classifier by a GP on the instance embedding (seed
    000, §6.3). Defaults are the untuned setting of the issue: Adam, learning rate 5·10⁻⁴, weight decay
    5·10⁻⁴, 50 epochs, no early stopping.

    Parameters
    ----------
    n_components : int, default=64
        Width D of the instance embedding ``h_n`` the attention pools.
    hidden : tuple of int, default=(256, 128)
        Widths of the hidden ReLU layers before the embedding layer.
    attention_dim : int, default=64
        Width of the gated attention's V and U.
    learning_rate, weight_decay : float
        Adam's step size and L2 weight decay.
    max_epochs : int, default=50
        Passes over the training bags (one bag per step).
    early_stopping, validation_fraction, n_epochs_no_change
        Hold out a stratified fraction of the bags, stop when their bag AUC (ties: their loss) has
        not improved for ``n_epochs_no_change`` epochs, counted once the training loss has fallen
        to half the constant predictor's, keep the best epoch's parameters
        (:func:`mil_core.attention.fit_attention_network`).
    calibration : {"platt", None}, default=None
        ``"platt"``: hold out the same stratified ``validation_fraction`` of the bags (also
        without early stopping) and fit Platt scaling of the bag logit on them
        (:func:`mil_core.calibration.fit_platt`); ``None``: the network's own sigmoid.
    negative_instances : bool, default=False
        Also train every instance of a negative bag as negative
        (:func:`mil_core.attention.training_loss`); off here, so ``ABMIL()`` stays Ilse et al.'s
        network, the baseline. :class:`~mil_core.EmbeddedGPMIL` turns it on.
    random_state : int, RandomState or None
        Seeds the initial weights, the bag order and the validation split.

    Attributes
    ----------
    network_state_ : dict[str, ndarray]
        The trained parameters (float32) and the input standardisation (``input.mean``,
        ``input.scale``), as plain arrays.
    network_train_loss_, network_validation_loss_, network_validation_auc_ : ndarray
        Mean bag cross-entropy per epoch, and the validation bag AUC (validation: only with
        ``early_stopping``).
    network_best_epoch_ : int
        The epoch whose parameters were kept.
    validation_bags_ : ndarray of int
        The held-out bags (positions in ``np.unique(bag_ids)``; empty when none were held out).
    calibration_slope_, calibration_intercept_ : float
        Platt's ``a`` and ``c`` (1 and 0 without calibration).
    n_features_in_, classes_
    """

    def __init__(
        self,
        *,
        n_components: int = 64,
        hidden: tuple[int, ...] = (256, 128),
        attention_dim: int = 64,
        learning_rate: float = 5e-4,
        weight_decay: float = 5e-4,
        max_epochs: int = 50,
        early_stopping: bool = False,
        validation_fraction: float = 0.2,
        n_epochs_no_change: int = 10,
        calibration: str | None = None,
        negative_instances: bool = False,
        random_state: Any = None,
    ):
        store_params(self, locals())

    def _check_params(self) -> None:
        """The parameters' values, before any data."""
        self._check_network_params()

    def fit(self, X: Any, bag_ids: Any, y: Any) -> ABMIL:
        """Train on instances ``X`` (N, D), their ``bag_ids`` and ``y`` (each instance's bag label)."""
        names = feature_names(X)
        X, bags, labels = check_mil_data(X, bag_ids, y)
        forget_fit(self, names)
        X_sorted = to_numpy(X).astype(np.float64, copy=False)[bags.order]
        fit = self._network_fit(X_sorted, bags.offsets, labels, _seed(self.random_state))
        self._store_traces(fit, X.shape[1])
        self.network_state_, self.validation_bags_ = fit.params[0], fit.validation_bags[0]
        X_val, val_offsets = take_bags(X_sorted, bags.offsets, self.validation_bags_)
        self._fit_calibration(lambda: self._bag_logits(X_val, val_offsets), labels[self.validation_bags_])
        return self

    def _states(self) -> list[dict[str, np.ndarray]]:
        check_is_fitted(self, "network_state_")
        return [self.network_state_]

    def _bag_logits(self, X_sorted: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        return bag_logits(network_arrays(self.network_state_), self._embed(X_sorted), offsets)

    def predict_bag_proba(self, X: Any, bag_ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """``keys, p``: ``p(T_b = 1) = σ(a (cᵀ z_b + c₀) + c)`` for each bag (``a = 1, c = 0``
        without calibration: the network's sigmoid), ``keys = np.unique(bag_ids)``."""
        check_is_fitted(self, "network_state_")
        X, bags, _ = check_mil_data(X, bag_ids, n_features=self.n_features_in_, names=fitted_names(self))
        logits = self._bag_logits(to_numpy(X)[bags.order], bags.offsets)
        return bags.keys, platt_proba(logits, self.calibration_slope_, self.calibration_intercept_)

    def predict_instance_proba(self, X: Any) -> np.ndarray:
        """``σ(cᵀ h_n + c₀)``: the probability the network gives a bag made of instance n alone."""
        return _sigmoid(np, instance_logits(network_arrays(self.network_state_), self._embed(X)))
