"""ABMIL: the gated-attention MIL network of :mod:`mil_core.attention` as an estimator (Ilse et al. 2018)."""

from __future__ import annotations

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
)
from ..validation import check_features, check_mil_data
from .base import store_params

__all__ = ["ABMIL", "AttentionNetworkParams"]


class AttentionNetworkParams:
    """Training and embedding shared by the estimators that own the network (their constructor
    parameters are documented there)."""

    def _network_fit(self, X_sorted: np.ndarray, offsets: np.ndarray, labels: np.ndarray, seed: int) -> NetworkFit:
        return fit_attention_network(
            X_sorted, offsets, labels, hidden=tuple(self.hidden), n_components=self.n_components,
            attention_dim=self.attention_dim, learning_rate=self.learning_rate, weight_decay=self.weight_decay,
            max_epochs=self.max_epochs, early_stopping=self.early_stopping, validation_fraction=self.validation_fraction,
            n_epochs_no_change=self.n_epochs_no_change, seed=seed,
        )

    def _store_network(self, fit: NetworkFit, n_features: int) -> None:
        self.n_features_in_ = n_features
        self.classes_ = np.array([0, 1])
        self.network_state_ = fit.params
        self.network_train_loss_ = fit.train_loss
        self.network_validation_loss_ = fit.validation_loss
        self.network_best_epoch_ = fit.best_epoch

    def _embed(self, X: Any) -> np.ndarray:
        """Instance embeddings ``h = f_emb(x)`` (float64 NumPy) of validated input rows."""
        check_is_fitted(self, "network_state_")
        X = np.asarray(check_features(X, n_features=self.n_features_in_), dtype=np.float64)
        return instance_embedding(network_arrays(self.network_state_), X)

    def predict_attention(self, X: Any, bag_ids: Any) -> np.ndarray:
        """Attention weight ``α_n`` of each row within its bag (rows in input order; sums to 1 per bag)."""
        H = self._embed(X)
        _, bags, _ = check_mil_data(H, bag_ids)
        weights = np.empty(H.shape[0])
        weights[bags.order] = attention_weights(network_arrays(self.network_state_), H[bags.order], bags.offsets)
        return weights


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
        Hold out a stratified fraction of the bags, stop when their loss has not improved for
        ``n_epochs_no_change`` epochs, keep the best epoch's parameters.
    random_state : int, RandomState or None
        Seeds the initial weights, the bag order and the validation split.

    Attributes
    ----------
    network_state_ : dict[str, ndarray]
        The trained parameters (float32) and the input standardisation (``input.mean``,
        ``input.scale``), as plain arrays.
    network_train_loss_, network_validation_loss_ : ndarray
        Mean bag cross-entropy per epoch (validation: only with ``early_stopping``).
    network_best_epoch_ : int
        The epoch whose parameters were kept.
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
        random_state: Any = None,
    ):
        store_params(self, locals())

    def fit(self, X: Any, bag_ids: Any, y: Any) -> ABMIL:
        """Train on instances ``X`` (N, D), their ``bag_ids`` and ``y`` (each instance's bag label)."""
        X, bags, labels = check_mil_data(X, bag_ids, y)
        X = np.asarray(X, dtype=np.float64)
        fit = self._network_fit(X[bags.order], bags.offsets, labels, _seed(self.random_state))
        self._store_network(fit, X.shape[1])
        return self

    def predict_bag_proba(self, X: Any, bag_ids: Any) -> tuple[np.ndarray, np.ndarray]:
        """``keys, p``: ``p(T_b = 1) = σ(cᵀ z_b + c₀)`` for each bag, ``keys = np.unique(bag_ids)``."""
        H = self._embed(X)
        _, bags, _ = check_mil_data(H, bag_ids)
        params = network_arrays(self.network_state_)
        return bags.keys, _sigmoid(np, bag_logits(params, H[bags.order], bags.offsets))

    def predict_instance_proba(self, X: Any) -> np.ndarray:
        """``σ(cᵀ h_n + c₀)``: the probability the network gives a bag made of instance n alone."""
        return _sigmoid(np, instance_logits(network_arrays(self.network_state_), self._embed(X)))
