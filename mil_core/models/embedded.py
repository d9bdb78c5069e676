"""GP-MIL on learned instance embeddings (seed 000, §6.3, Eq. 39).

An attention-MIL network (:mod:`mil_core.attention`) is trained on the bag labels; its classifier
is then dropped and a GP-MIL model is fitted on the instance embeddings ``h_n = f_emb(x_n)``, as
seed 000 does with AttCNN features and VGPMIL / G-VGPMIL. The network gives the features (and,
by default, the attention weights that pool instance probabilities into a bag probability); the
GP gives the instance probabilities and their uncertainty.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from sklearn.base import BaseEstimator, clone
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted

from ..attention import attention_weights, network_arrays
from ..bags import segment_sum
from ..validation import check_mil_data, standardisation
from .attention_mil import AttentionNetworkParams
from .base import store_params
from .vgpmil import VGPMIL

__all__ = ["EmbeddedGPMIL", "default_gp"]


def default_gp() -> BaseEstimator:
    """The GP-MIL estimator :class:`EmbeddedGPMIL` fits when given ``gp=None``: the package's
    default model, unfitted."""
    return VGPMIL()


class EmbeddedGPMIL(AttentionNetworkParams, BaseEstimator):
    """A GP-MIL model on the instance embedding of a gated-attention MIL network (seed 000, §6.3).

    ``fit`` trains the network of :class:`~mil_core.ABMIL` on the training bags (its own
    stratified inner validation split of bags stops it; the best epoch is kept), standardises the
    D-dimensional embeddings of all training instances and fits a clone of ``gp`` on them.
    Predictions embed the rows with the stored network (NumPy, no PyTorch needed) and return
    the GP's predictions, with the GP's uncertainty.

    Parameters
    ----------
    gp : estimator or None
        A GP-MIL estimator with ``fit(X, bag_ids, y)``, ``predict_bag_proba`` and
        ``predict_instance_proba`` (e.g. :class:`~mil_core.VGPMIL`, :class:`~mil_core.GVGPMIL`);
        ``None`` is :func:`default_gp`. It is cloned; an unset ``random_state`` of the clone is
        seeded from this estimator's.
    n_components : int, default=32
        Embedding width D (seed 000: D ∈ {8, 32, 128}).
    hidden, attention_dim, learning_rate, weight_decay, max_epochs, n_epochs_no_change, validation_fraction
        The network and its training, as for :class:`~mil_core.ABMIL` (Adam, lr 5·10⁻⁴, weight
        decay 5·10⁻⁴), with at most ``max_epochs`` = 100 epochs.
    early_stopping : bool, default=True
        Stop the network on its inner validation bags' loss (patience ``n_epochs_no_change``).
    random_state : int, RandomState or None
        Seeds the network (weights, bag order, validation split) and the GP's clone.

    Attributes
    ----------
    network_state_ : dict[str, ndarray]
        The trained network as plain arrays (see :class:`~mil_core.ABMIL`).
    network_train_loss_, network_validation_loss_, network_best_epoch_
        The network's training trace.
    embedding_mean_, embedding_scale_ : ndarray of shape (n_components,)
        Standardisation of the embeddings (training instances; a dimension with std < 1e-12 is
        left unscaled).
    gp_ : estimator
        The fitted GP-MIL model on the standardised embeddings.
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
        random_state: Any = None,
    ):
        store_params(self, locals())

    def fit(self, X: Any, bag_ids: Any, y: Any) -> EmbeddedGPMIL:
        """Train the network on the bags, then the GP on the embeddings of all training instances."""
        X, bags, labels = check_mil_data(X, bag_ids, y)
        X = np.asarray(X, dtype=np.float64)
        network_seed, gp_seed = self._seeds()
        self.fit_embedding(X[bags.order], bags.offsets, labels, seed=network_seed)
        self.gp_ = self._gp_clone(gp_seed).fit(self.transform(X), bag_ids, y)
        return self

    def fit_embedding(self, X_sorted: np.ndarray, offsets: np.ndarray, labels: np.ndarray, *, seed: int) -> EmbeddedGPMIL:
        """Train the network and the embedding standardisation on bags given as CSR rows (bag ``b``
        is ``X_sorted[offsets[b]:offsets[b+1]]`` with label ``labels[b]``). :meth:`fit`'s first
        half; also the entry point of executors that fit the GP elsewhere (``tasks.training``)."""
        X_sorted = np.asarray(X_sorted, dtype=np.float64)
        fit = self._network_fit(X_sorted, np.asarray(offsets), np.asarray(labels, dtype=np.int64), seed)
        self._store_network(fit, X_sorted.shape[1])
        H = self._embed(X_sorted)
        self.embedding_mean_, self.embedding_scale_ = standardisation(H)
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

    def predict_bag_proba(
        self, X: Any, bag_ids: Any, *, return_std: bool = False, rule: str = "attention", **kwargs: Any
    ) -> tuple[np.ndarray, ...]:
        """``keys, p`` (``keys, p, std`` with ``return_std=True``), ``keys = np.unique(bag_ids)``.

        ``rule="attention"`` (default): the network's attention weights pool the GP's instance
        probabilities, ``p_b = Σ_n α_n p_n`` with ``α = softmax_b(a)`` (Ilse et al. 2018, Eq. 9);
        its std, with the predictive f*ₙ independent (the FITC diagonal, as for the noisy-OR
        std of seed 000 Eq. 37), is ``sqrt(Σ_n α_n² sd_n²)``. Measured against the GP's own
        rules in ``docs/BENCHMARKS.md`` (a GP-MIL rule on these embeddings lost up to 0.2 bag
        AUC on a MUSK1 fold). Any other ``rule`` goes, with the keyword arguments, to
        ``gp_.predict_bag_proba`` on the embeddings.
        """
        check_is_fitted(self, "gp_")
        H = self._embed(X)
        Z = (H - self.embedding_mean_) / self.embedding_scale_
        if rule != "attention":
            return self.gp_.predict_bag_proba(Z, bag_ids, return_std=return_std, rule=rule, **kwargs)
        _, bags, _ = check_mil_data(H, bag_ids)
        p, sd = self.gp_.predict_instance_proba(Z, return_std=True, **kwargs) if return_std else (
            self.gp_.predict_instance_proba(Z, **kwargs), None)
        order, offsets = bags.order, bags.offsets
        alpha = attention_weights(network_arrays(self.network_state_), H[order], offsets)
        p_bag = segment_sum(alpha * p[order], offsets)
        if not return_std:
            return bags.keys, p_bag
        return bags.keys, p_bag, np.sqrt(segment_sum((alpha * sd[order]) ** 2, offsets))
