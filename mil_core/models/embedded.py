"""GP-MIL on learned instance embeddings (seed 000, §6.3, Eq. 39).

An attention-MIL network (:mod:`mil_core.attention`) is trained on the bag labels and a GP-MIL
model is fitted on the instance embeddings ``h_n = f_emb(x_n)``, as seed 000 does with AttCNN
features and VGPMIL / G-VGPMIL. The GP gives the instance probabilities and their uncertainty;
the default bag probability averages the network's and the GP's bag evidence and is calibrated
on bags that neither model trained on.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
from scipy.special import expit
from sklearn.base import BaseEstimator, clone
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted

from ..attention import attention_weights, bag_logits, network_arrays
from ..bags import segment_sum
from ..validation import check_mil_data, standardisation
from .attention_mil import AttentionNetworkParams
from .base import store_params, take_bags
from .vgpmil import VGPMIL

__all__ = ["EmbeddedGPMIL", "default_gp"]


_PROBA_FLOOR = 1e-9
"""Pooled GP probabilities are kept in [1e-9, 1 − 1e-9] before their logit (|logit| ≤ 20.7): a
bag evidence of one model cannot outvote the other's by more than that."""


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, _PROBA_FLOOR, 1.0 - _PROBA_FLOOR)
    return np.log(p) - np.log1p(-p)


def default_gp() -> BaseEstimator:
    """The GP-MIL estimator :class:`EmbeddedGPMIL` fits when given ``gp=None``: the package's
    default model, unfitted."""
    return VGPMIL()


class EmbeddedGPMIL(AttentionNetworkParams, BaseEstimator):
    """A GP-MIL model on the instance embedding of a gated-attention MIL network (seed 000, §6.3).

    ``fit`` holds out a stratified ``validation_fraction`` of the training bags (the *inner
    validation bags*), trains the network of :class:`~mil_core.ABMIL` on the rest (stopped on the
    held-out bags' AUC, ties broken by their loss; the best epoch is kept), standardises the D-dimensional embeddings of the
    training instances and fits a clone of ``gp`` on the embeddings of the network's training
    bags. The held-out bags then calibrate the bag probability (Platt scaling). Predictions embed
    the rows with the stored network (NumPy, no PyTorch needed).

    The default bag probability (``rule="ensemble"``) averages two bag evidences in logit space,
    ``s_b = ½ (ℓ_b + logit p̄_b)``: the network's bag logit ``ℓ_b = cᵀ z_b + c₀`` (Ilse et al. 2018)
    and the GP's instance probabilities pooled by the network's attention,
    ``p̄_b = Σ_n α_n p_n`` (Ilse et al. 2018, Eq. 9; seed 000 Eq. 31 for ``p_n``), then
    ``p_b = σ(a s_b + c)`` with Platt's ``(a, c)`` fitted on the inner validation bags
    (:func:`mil_core.calibration.fit_platt`). Measured in ``docs/BENCHMARKS.md``: the average
    beats either evidence alone on MUSK1 and MUSK2 and is within 0.004 of the better on digits bags.

    Parameters
    ----------
    gp : estimator or None
        A GP-MIL estimator with ``fit(X, bag_ids, y)``, ``predict_bag_proba`` and
        ``predict_instance_proba(X, return_std=…)`` (e.g. :class:`~mil_core.VGPMIL`,
        :class:`~mil_core.GVGPMIL`); ``None`` is :func:`default_gp`. It is cloned; an unset
        ``random_state`` of the clone is seeded from this estimator's.
    n_components : int, default=32
        Embedding width D (seed 000: D ∈ {8, 32, 128}).
    hidden, attention_dim, learning_rate, weight_decay, max_epochs, n_epochs_no_change, validation_fraction
        The network and its training, as for :class:`~mil_core.ABMIL` (Adam, lr 5·10⁻⁴, weight
        decay 5·10⁻⁴), with at most ``max_epochs`` = 100 epochs.
    early_stopping : bool, default=True
        Stop the network on its inner validation bags' AUC, then loss (patience ``n_epochs_no_change``).
    calibration : {"platt", None}, default="platt"
        Platt scaling of the ensemble bag score on the inner validation bags; ``None``: ``σ(s_b)``.
        Without early stopping and calibration no bags are held out and the GP trains on all.
    random_state : int, RandomState or None
        Seeds the network (weights, bag order, validation split) and the GP's clone.

    Attributes
    ----------
    network_state_ : dict[str, ndarray]
        The trained network as plain arrays (see :class:`~mil_core.ABMIL`).
    network_train_loss_, network_validation_loss_, network_validation_auc_, network_best_epoch_
        The network's training trace.
    validation_bags_ : ndarray of int
        The inner validation bags (positions in ``np.unique(bag_ids)``).
    embedding_mean_, embedding_scale_ : ndarray of shape (n_components,)
        Standardisation of the embeddings (training instances; a dimension with std < 1e-12 is
        left unscaled).
    gp_ : estimator
        The fitted GP-MIL model on the standardised embeddings of the network's training bags.
    calibration_slope_, calibration_intercept_ : float
        Platt's ``a`` and ``c`` (1 and 0 without calibration).
    n_features_in_, classes_
    """

    def __init__(
        self,
        gp: BaseEstimator | None = None,
        n_components: int = 32,
        *,
        hidden: tuple[int, ...] = (256, 128),
        attention_dim: int = 64,
        learning_rate: float = 5e-4,
        weight_decay: float = 5e-4,
        max_epochs: int = 100,
        early_stopping: bool = True,
        validation_fraction: float = 0.2,
        n_epochs_no_change: int = 10,
        calibration: str | None = "platt",
        random_state: Any = None,
    ):
        store_params(self, locals())

    def fit(self, X: Any, bag_ids: Any, y: Any) -> EmbeddedGPMIL:
        """Train the network on the bags, the GP on the embeddings of the network's training bags,
        then the calibration on the inner validation bags."""
        X, bags, labels = check_mil_data(X, bag_ids, y)
        X_sorted = np.asarray(X, dtype=np.float64)[bags.order]
        network_seed, gp_seed = self._seeds()
        self.fit_embedding(X_sorted, bags.offsets, labels, seed=network_seed)
        training = self.gp_training_bags(labels.size)
        X_train, train_offsets = take_bags(X_sorted, bags.offsets, training)
        sizes = np.diff(train_offsets)
        self.gp_ = self._gp_clone(gp_seed).fit(self.transform(X_train), np.repeat(np.arange(training.size), sizes),
                                               np.repeat(labels[training], sizes))
        X_val, val_offsets = take_bags(X_sorted, bags.offsets, self.validation_bags_)
        self.fit_calibration(X_val, val_offsets, labels[self.validation_bags_])
        return self

    def fit_embedding(self, X_sorted: np.ndarray, offsets: np.ndarray, labels: np.ndarray, *, seed: int) -> EmbeddedGPMIL:
        """Train the network and the embedding standardisation on bags given as CSR rows (bag ``b``
        is ``X_sorted[offsets[b]:offsets[b+1]]`` with label ``labels[b]``). :meth:`fit`'s first
        step; also the entry point of executors that fit the GP elsewhere (``tasks.training``)."""
        X_sorted = np.asarray(X_sorted, dtype=np.float64)
        fit = self._network_fit(X_sorted, np.asarray(offsets), np.asarray(labels, dtype=np.int64), seed)
        self._store_network(fit, X_sorted.shape[1])
        H = self._embed(X_sorted)
        self.embedding_mean_, self.embedding_scale_ = standardisation(H)
        return self

    def gp_training_bags(self, n_bags: int) -> np.ndarray:
        """The bags (of the ``n_bags`` given to :meth:`fit_embedding`) the GP trains on: all but the
        inner validation bags."""
        check_is_fitted(self, "validation_bags_")
        return np.setdiff1d(np.arange(n_bags), self.validation_bags_)

    def fit_calibration(self, X_val: np.ndarray, val_offsets: np.ndarray, val_labels: np.ndarray) -> EmbeddedGPMIL:
        """Platt scaling of the ensemble score on the inner validation bags (``validation_bags_``,
        given as CSR rows with their labels): :meth:`fit`'s last step, after ``gp_`` is fitted."""
        check_is_fitted(self, "gp_")
        self._fit_calibration(self._ensemble_score, np.asarray(X_val, dtype=np.float64), np.asarray(val_offsets),
                              np.asarray(val_labels))
        return self

    def _seeds(self) -> tuple[int, int]:
        """The network's and the GP's seeds, both from ``random_state`` (also used by the cluster fit)."""
        network_seed, gp_seed = check_random_state(self.random_state).randint(2**31 - 1, size=2)
        return int(network_seed), int(gp_seed)

    def _gp_clone(self, seed: int) -> BaseEstimator:
        gp = clone(self.gp) if self.gp is not None else default_gp()
        params = gp.get_params(deep=False)
        if "random_state" in params and params["random_state"] is None:
            gp.set_params(random_state=seed)
        return gp

    def transform(self, X: Any) -> np.ndarray:
        """The standardised instance embeddings the GP sees, (N, n_components)."""
        check_is_fitted(self, "embedding_mean_")
        return (self._embed(X) - self.embedding_mean_) / self.embedding_scale_

    def predict_instance_proba(self, X: Any, **kwargs: Any) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """The GP's instance probabilities on the embeddings (``return_std=True`` adds the std);
        other keyword arguments go to ``gp_.predict_instance_proba``."""
        check_is_fitted(self, "gp_")
        return self.gp_.predict_instance_proba(self.transform(X), **kwargs)

    def _closed_form(self) -> dict[str, str]:
        """Keyword arguments that make the GP's instance probabilities its closed form where it
        offers a choice (the logistic family's ``method="probit"``, Eq. 31 with the probit
        approximation): deterministic, so a cohort predicted partition by partition gets the
        numbers of one call."""
        return {"method": "probit"} if "method" in inspect.signature(self.gp_.predict_instance_proba).parameters else {}

    def _pooled(self, H_sorted: np.ndarray, offsets: np.ndarray, return_std: bool, **kwargs: Any):
        """Attention-pooled GP probabilities ``p̄_b = Σ α_n p_n`` (and their std ``sqrt(Σ α_n² sd_n²)``
        with independent f*ₙ, the FITC diagonal, as for the noisy-OR std of seed 000 Eq. 37);
        ``kwargs`` (default: the closed form) go to ``gp_.predict_instance_proba``."""
        kwargs = kwargs or self._closed_form()
        Z = (H_sorted - self.embedding_mean_) / self.embedding_scale_
        alpha = attention_weights(network_arrays(self.network_state_), H_sorted, offsets)
        if not return_std:
            return segment_sum(alpha * self.gp_.predict_instance_proba(Z, **kwargs), offsets), None
        p, sd = self.gp_.predict_instance_proba(Z, return_std=True, **kwargs)
        return segment_sum(alpha * p, offsets), np.sqrt(segment_sum((alpha * sd) ** 2, offsets))

    def _ensemble_score(self, X_sorted: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """``s_b = ½ (ℓ_b + logit p̄_b)`` of bags given as CSR rows (the score Platt scaling maps)."""
        H = self._embed(X_sorted)
        pooled, _ = self._pooled(H, offsets, False)
        return 0.5 * (bag_logits(network_arrays(self.network_state_), H, offsets) + _logit(pooled))

    def predict_bag_proba(
        self, X: Any, bag_ids: Any, *, return_std: bool = False, rule: str = "ensemble", **kwargs: Any
    ) -> tuple[np.ndarray, ...]:
        """``keys, p`` (``keys, p, std`` with ``return_std=True``), ``keys = np.unique(bag_ids)``.

        ``rule="ensemble"`` (default): the calibrated average of the network's and the GP's bag
        evidence, ``p_b = σ(a s_b + c)`` (class docstring). Its std propagates the GP's: the std
        ``sd̄_b`` of ``p̄_b`` (below) through the map ``p̄ ↦ p`` to first order (the delta method),
        ``|∂p/∂p̄| sd̄_b = p_b (1 − p_b) (a/2) sd̄_b / (p̄_b (1 − p̄_b))``, bounded by
        ``sqrt(p_b (1 − p_b))``, the largest std of a probability with mean ``p_b`` (Bhatia–Davis);
        the network is a point estimate. ``p̄_b`` uses the GP's closed-form instance probabilities
        (``method="probit"`` for the logistic family), as the calibration did; ``kwargs`` are refused.

        ``rule="attention"``: the GP's instance probabilities pooled by the network's attention,
        ``p̄_b = Σ_n α_n p_n`` (uncalibrated; ``kwargs``, default the closed form, go to
        ``gp_.predict_instance_proba``), std ``sqrt(Σ_n α_n² sd_n²)`` (independent f*ₙ, the FITC
        diagonal, as for the noisy-OR std of seed 000 Eq. 37). Any other ``rule`` goes, with the
        keyword arguments, to ``gp_.predict_bag_proba`` on the embeddings.

        ``rule="network"``: the network's own bag probability ``σ(ℓ_b)`` (no std; the ABMIL
        estimate of the network trained here), for comparison.
        """
        check_is_fitted(self, "gp_")
        X, bags, _ = check_mil_data(X, bag_ids)
        if rule == "network":
            if return_std or kwargs:
                raise ValueError("rule='network' is the network's own point estimate: no std, no keyword arguments")
            H = self._embed(np.asarray(X)[bags.order])
            return bags.keys, expit(bag_logits(network_arrays(self.network_state_), H, bags.offsets))
        if rule not in ("ensemble", "attention"):
            return self.gp_.predict_bag_proba(self.transform(X), bag_ids, return_std=return_std, rule=rule, **kwargs)
        if rule == "ensemble" and kwargs:
            raise ValueError(f"rule='ensemble' uses the GP's closed-form probabilities it was calibrated with; "
                             f"got keyword arguments {sorted(kwargs)}")
        H = self._embed(np.asarray(X)[bags.order])
        pooled, pooled_sd = self._pooled(H, bags.offsets, return_std, **kwargs)
        if rule == "attention":
            return (bags.keys, pooled, pooled_sd) if return_std else (bags.keys, pooled)
        score = 0.5 * (bag_logits(network_arrays(self.network_state_), H, bags.offsets) + _logit(pooled))
        p = expit(self.calibration_slope_ * score + self.calibration_intercept_)
        if not return_std:
            return bags.keys, p
        q = np.clip(pooled, _PROBA_FLOOR, 1.0 - _PROBA_FLOOR)
        delta = p * (1.0 - p) * 0.5 * abs(self.calibration_slope_) * pooled_sd / (q * (1.0 - q))
        return bags.keys, p, np.minimum(delta, np.sqrt(p * (1.0 - p)))
