"""GP-MIL on learned instance embeddings (seed 000, §6.3, Eq. 39).

An attention-MIL network (:mod:`mil_core.attention`) is trained on the bag labels and a GP-MIL
model is fitted on the instance embeddings ``h_n = f_emb(x_n)``, as seed 000 does with AttCNN
features and VGPMIL / G-VGPMIL. The GP gives the instance probabilities and their uncertainty;
the default bag probability averages the network's and the GP's bag evidence. A small
cross-fitted ensemble of such (network, GP) pairs cuts the variance of small data sets and gives
every training bag an out-of-fold score, on which the bag probability is calibrated.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.special import expit
from sklearn.base import BaseEstimator, clone
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted

from .._backend import to_numpy
from ..attention import attention_weights, bag_logits, instance_logits, network_arrays
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
    """The GP-MIL estimator :class:`EmbeddedGPMIL` fits when given ``gp=None``, unfitted:
    ``VGPMIL()`` with its automatic kernel choice. (The pipeline's default model, ``VGPMILPR()``,
    measured level on these embeddings and no faster: ``docs/BENCHMARKS.md``, "Session 12".)"""
    return VGPMIL()


class EmbeddedGPMIL(AttentionNetworkParams, BaseEstimator):
    """GP-MIL models on the instance embeddings of gated-attention MIL networks (seed 000, §6.3),
    as a small cross-fitted ensemble.

    ``fit`` splits the training bags into ``n_networks`` stratified folds. Member ``k`` trains the
    network of :class:`~mil_core.ABMIL` on the other folds, standardises its D-dimensional
    embeddings of the training instances and fits a clone of ``gp`` on the embeddings of its
    training bags; fold ``k`` (its *held-out bags*) is seen by neither of member ``k``'s models. The
    members train in lockstep and stop together on the pooled held-out bags' AUC, ties broken by
    their loss, once they fit their training bags (:func:`mil_core.attention.fit_attention_network`).
    Each training bag thus has one out-of-fold score, and Platt scaling is fitted on all of them.
    ``n_networks=1`` is one network holding out a stratified ``validation_fraction``. Predictions
    embed the rows with the stored networks (NumPy, no PyTorch needed).

    Member ``k``'s bag evidence averages two logits, ``s_b^k = ½ (ℓ_b^k + logit p̄_b^k)``: the
    network's bag logit ``ℓ_b^k = cᵀ z_b + c₀`` (Ilse et al. 2018) and its GP's instance
    probabilities pooled by the network's attention, ``p̄_b^k = Σ_n α_n p_n`` (Ilse et al. 2018,
    Eq. 9; seed 000 Eq. 31 for ``p_n``). The default bag probability (``rule="ensemble"``) is
    ``p_b = σ(a s_b + c)`` with ``s_b`` the members' mean of ``s_b^k`` and Platt's ``(a, c)``
    (:func:`mil_core.calibration.fit_platt`) fitted on the out-of-fold scores ``s_b^{k(b)}``.

    Why an ensemble, measured in ``docs/BENCHMARKS.md`` (identical 5-fold splits): one network
    stopped on the AUC of 15–20 held-out bags stops by noise and is calibrated on those few bags;
    the cross-fitted members are stopped on all training bags' out-of-fold scores, calibrated on
    all of them, and their average varies less with seed and split. Against one network
    (``n_networks=1``) bag AUC rose on text 0.752 → 0.908, a large-bag draw 0.660 → 0.820 and
    MUSK2 0.893 → 0.908, fell on MUSK1 0.962 → 0.934 and digits 0.864 → 0.835, and the digits
    instance AUC rose 0.921 → 0.950; it costs five networks and five GPs (2.4–5.8× ABMIL's fit).
    Why the average of two evidences: it beats the networks alone on MUSK1, MUSK2, digits and the
    large-bag draw.

    Parameters
    ----------
    gp : estimator or None
        A GP-MIL estimator with ``fit(X, bag_ids, y)``, ``predict_bag_proba`` and
        ``predict_instance_proba(X, return_std=…)`` (e.g. :class:`~mil_core.VGPMIL`,
        :class:`~mil_core.GVGPMIL`); ``None`` is :func:`default_gp`. It is cloned once per member;
        an unset ``random_state`` of a clone is seeded from this estimator's.
    n_components : int, default=32
        Embedding width D (seed 000: D ∈ {8, 32, 128}).
    n_networks : int, default=5
        Members of the cross-fitted ensemble, at most the smaller class's training bag count.
    hidden, attention_dim, learning_rate, weight_decay, max_epochs, n_epochs_no_change
        The network and its training, as for :class:`~mil_core.ABMIL` (Adam, lr 5·10⁻⁴, weight
        decay 5·10⁻⁴), with at most ``max_epochs`` = 100 epochs.
    validation_fraction : float, default=0.2
        The held-out fraction of a single network (``n_networks=1``).
    early_stopping : bool, default=True
        Stop the members on their pooled held-out bags' AUC, then loss (patience ``n_epochs_no_change``),
        among the epochs once their training loss has fallen to half the constant predictor's.
    calibration : {"platt", None}, default="platt"
        Platt scaling of the ensemble bag score on the out-of-fold scores; ``None``: ``σ(s_b)``.
        Without early stopping and calibration no bags are held out: one network, and its GP
        trains on all bags.
    negative_instances : bool, default=True
        Each negative training bag's step also trains its instances as negative (the MIL
        assumption, seed 000 §2.1; :func:`mil_core.attention.training_loss`): without it, the bag
        loss reaches an instance only through its attention weight, and on bags of 10³–10⁴
        instances the networks did not learn at all (``docs/BENCHMARKS.md``).
    random_state : int, RandomState or None
        Seeds the networks (weights, bag order, folds) and the GPs' clones.

    Attributes
    ----------
    network_states_ : list of dict[str, ndarray]
        The trained networks as plain arrays, one per member (see :class:`~mil_core.ABMIL`).
    network_train_loss_, network_validation_loss_, network_validation_auc_, network_best_epoch_
        The ensemble's training trace (validation: pooled over the members' held-out bags).
    validation_bags_ : list of ndarray of int
        Each member's held-out bags (positions in ``np.unique(bag_ids)``).
    embedding_mean_, embedding_scale_ : ndarray of shape (n_members, n_components)
        Standardisation of each member's embeddings (training instances; a dimension with std <
        1e-12 is left unscaled).
    gps_ : list of estimators
        Each member's fitted GP-MIL model on the standardised embeddings of its training bags.
    calibration_slope_, calibration_intercept_ : float
        Platt's ``a`` and ``c`` (1 and 0 without calibration).
    n_features_in_, classes_
    """

    def __init__(
        self,
        gp: BaseEstimator | None = None,
        n_components: int = 32,
        *,
        n_networks: int = 5,
        hidden: tuple[int, ...] = (256, 128),
        attention_dim: int = 64,
        learning_rate: float = 5e-4,
        weight_decay: float = 5e-4,
        max_epochs: int = 100,
        early_stopping: bool = True,
        validation_fraction: float = 0.2,
        n_epochs_no_change: int = 10,
        calibration: str | None = "platt",
        negative_instances: bool = True,
        random_state: Any = None,
    ):
        store_params(self, locals())

    def fit(self, X: Any, bag_ids: Any, y: Any) -> EmbeddedGPMIL:
        """Train the members' networks, each member's GP on the embeddings of its training bags,
        then the calibration on the out-of-fold scores."""
        X, bags, labels = check_mil_data(X, bag_ids, y)
        X_sorted = to_numpy(X).astype(np.float64, copy=False)[bags.order]
        network_seed, gp_seed = self._seeds()
        self.fit_embedding(X_sorted, bags.offsets, labels, seed=network_seed)
        held_out = self.held_out_embeddings(X_sorted, bags.offsets)
        gps = []
        for member in range(len(self.network_states_)):
            training = self.gp_training_bags(member, labels.size)
            X_train, train_offsets = take_bags(X_sorted, bags.offsets, training)
            sizes = np.diff(train_offsets)
            gps.append(self.gp_clone(member, gp_seed).fit(self.member_transform(X_train, member),
                                                          np.repeat(np.arange(training.size), sizes),
                                                          np.repeat(labels[training], sizes)))
        self.gps_ = gps
        self.fit_calibration(held_out, labels)
        return self

    def fit_embedding(self, X_sorted: np.ndarray, offsets: np.ndarray, labels: np.ndarray, *, seed: int) -> EmbeddedGPMIL:
        """Train the networks and the embedding standardisations on bags given as CSR rows (bag
        ``b`` is ``X_sorted[offsets[b]:offsets[b+1]]`` with label ``labels[b]``). :meth:`fit`'s first
        step; also the entry point of executors that fit the GPs elsewhere (``tasks.training``)."""
        X_sorted = np.asarray(X_sorted, dtype=np.float64)
        fit = self._network_fit(X_sorted, np.asarray(offsets), np.asarray(labels, dtype=np.int64), seed,
                                n_networks=self.n_networks)
        self._store_traces(fit, X_sorted.shape[1])
        self.network_states_, self.validation_bags_ = fit.params, fit.validation_bags
        scalings = [standardisation(self._embed(X_sorted, member)) for member in range(len(fit.params))]
        self.embedding_mean_ = np.stack([mean for mean, _ in scalings])
        self.embedding_scale_ = np.stack([scale for _, scale in scalings])
        return self

    def held_out_embeddings(self, X_sorted: np.ndarray, offsets: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each member's embedding of its held-out bags, ``(H, offsets)`` in CSR form, for
        :meth:`fit_calibration` (``n_components`` numbers per instance, so the executor need not
        keep the input rows while the GPs train)."""
        check_is_fitted(self, "validation_bags_")
        held_out = []
        for member, bags in enumerate(self.validation_bags_):
            rows, local = take_bags(np.asarray(X_sorted, dtype=np.float64), np.asarray(offsets), bags)
            held_out.append((self._embed(rows, member), local))
        return held_out

    def gp_training_bags(self, member: int, n_bags: int) -> np.ndarray:
        """The bags (of the ``n_bags`` given to :meth:`fit_embedding`) member ``member``'s GP trains
        on: all but its held-out bags."""
        check_is_fitted(self, "validation_bags_")
        return np.setdiff1d(np.arange(n_bags), self.validation_bags_[member])

    def gp_clone(self, member: int, seed: int) -> BaseEstimator:
        """Member ``member``'s unfitted GP: a clone of ``gp`` (or :func:`default_gp`), an unset
        ``random_state`` set to ``seed + member``."""
        gp = clone(self.gp) if self.gp is not None else default_gp()
        if "random_state" in gp.get_params(deep=False) and gp.get_params(deep=False)["random_state"] is None:
            gp.set_params(random_state=(seed + member) % (2**31 - 1))
        return gp

    def fit_calibration(self, held_out: list[tuple[np.ndarray, np.ndarray]], labels: np.ndarray) -> EmbeddedGPMIL:
        """Platt scaling of the out-of-fold ensemble scores: each member's score
        ``s^k`` on its held-out bags (``held_out`` from :meth:`held_out_embeddings`; ``labels`` of
        all bags given to :meth:`fit_embedding`). :meth:`fit`'s last step, after ``gps_`` is fitted."""
        check_is_fitted(self, "gps_")
        truth = np.asarray(labels)[np.concatenate(self.validation_bags_)]
        self._fit_calibration(lambda: np.concatenate([self._member_score(member, H, offsets)
                                                      for member, (H, offsets) in enumerate(held_out)]), truth)
        return self

    def _seeds(self) -> tuple[int, int]:
        """The networks' and the GPs' seeds, both from ``random_state`` (also used by the cluster fit)."""
        network_seed, gp_seed = check_random_state(self.random_state).randint(2**31 - 1, size=2)
        return int(network_seed), int(gp_seed)

    def _states(self) -> list[dict[str, np.ndarray]]:
        check_is_fitted(self, "network_states_")
        return self.network_states_

    def _standardised(self, H: np.ndarray, member: int) -> np.ndarray:
        return (H - self.embedding_mean_[member]) / self.embedding_scale_[member]

    def member_transform(self, X: Any, member: int) -> np.ndarray:
        """Member ``member``'s standardised instance embedding, (N, n_components): what its GP sees."""
        check_is_fitted(self, "embedding_mean_")
        return self._standardised(self._embed(X, member), member)

    def transform(self, X: Any) -> np.ndarray:
        """The members' standardised instance embeddings side by side, (N, n_members · n_components)."""
        return np.hstack([self.member_transform(X, member) for member in range(len(self._states()))])

    def predict_instance_proba(self, X: Any, *, return_std: bool = False, rule: str = "ensemble",
                               **kwargs: Any) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
        """Each row's probability of being a positive instance.

        ``rule="ensemble"`` (default): the equal mixture of the members' 2K instance predictions,
        each network's ``σ(ℓ_n^k)`` (``ℓ_n^k = cᵀh_n + c₀``, whose attention-weighted mean is its
        bag logit; a point estimate) and each GP's ``p_n^k`` (seed 000 Eq. 31): ``p̄_n`` their
        mean, with ``return_std`` the mixture's std ``sqrt(mean(sd² + p²) − p̄²)`` (the GPs' stds and
        the experts' disagreement). Why the mixture: neither expert localises best on every data
        set, and the mixture stays near the better of the two (held-out instance AUC,
        ``docs/BENCHMARKS.md``, "Session 12": on the sparse ``text`` set, three seeds, networks
        0.918, GPs 0.871, mixture 0.914; on three large-bag draws GPs 0.907, networks 0.868,
        mixture 0.906 at model seed 0, and 0.889, 0.904, 0.897 at seed 1); the logit average the
        bag score uses followed the networks' wider logits.

        ``rule="gp"``: the mixture of the members' GPs alone (the default until session 12);
        ``rule="network"``: ``σ(mean_k ℓ_n^k)`` (no std; :meth:`ABMIL.predict_instance_proba` of
        the networks trained here). Keyword arguments go to each ``gps_[k].predict_instance_proba``
        (default its closed form).
        """
        check_is_fitted(self, "gps_")
        if rule not in ("ensemble", "gp", "network"):
            raise ValueError(f"rule must be 'ensemble', 'gp' or 'network', got {rule!r}")
        if rule == "network" and (return_std or kwargs):
            raise ValueError("rule='network' is the networks' own point estimate: no std, no keyword arguments")
        H = [self._embed(X, k) for k in range(len(self.gps_))]  # once per member, for both experts
        logits = [] if rule == "gp" else [instance_logits(network_arrays(self.network_states_[k]), h)
                                          for k, h in enumerate(H)]
        if rule == "network":
            return expit(np.mean(logits, axis=0))
        gps = [gp.predict_instance_proba(self._standardised(H[k], k), return_std=return_std, **kwargs)
               for k, gp in enumerate(self.gps_)]
        networks = [expit(logit) for logit in logits]
        if not return_std:
            return np.mean(gps + networks, axis=0)
        p = np.array([q for q, _ in gps] + networks)
        sd = np.array([s for _, s in gps] + [np.zeros_like(q) for q in networks])
        mean = p.mean(axis=0)
        return mean, np.sqrt(np.maximum(np.mean(sd**2 + p**2, axis=0) - mean**2, 0.0))

    def _pooled(self, member: int, H: np.ndarray, offsets: np.ndarray, return_std: bool, **kwargs: Any):
        """Member ``member``'s attention-pooled GP probabilities ``p̄_b = Σ α_n p_n`` of its raw
        embeddings ``H`` (and their std ``sqrt(Σ α_n² sd_n²)`` with independent f*ₙ, the FITC
        diagonal, as for the noisy-OR std of seed 000 Eq. 37); ``kwargs`` go to the GP's
        ``predict_instance_proba``, whose default is deterministic (the logistic family's closed
        form), so a cohort predicted partition by partition gets the numbers of one call."""
        gp, Z = self.gps_[member], self._standardised(H, member)
        alpha = attention_weights(network_arrays(self.network_states_[member]), H, offsets)
        if not return_std:
            return segment_sum(alpha * gp.predict_instance_proba(Z, **kwargs), offsets), None
        p, sd = gp.predict_instance_proba(Z, return_std=True, **kwargs)
        return segment_sum(alpha * p, offsets), np.sqrt(segment_sum((alpha * sd) ** 2, offsets))

    def _member_score(self, member: int, H: np.ndarray, offsets: np.ndarray, pooled: np.ndarray | None = None) -> np.ndarray:
        """``s_b^k = ½ (ℓ_b^k + logit p̄_b^k)`` of member ``k`` on its raw embeddings of bags in CSR
        form (``pooled``: ``p̄^k`` when already computed)."""
        if pooled is None:
            pooled, _ = self._pooled(member, H, offsets, False)
        return 0.5 * (bag_logits(network_arrays(self.network_states_[member]), H, offsets) + _logit(pooled))

    def predict_bag_proba(
        self, X: Any, bag_ids: Any, *, return_std: bool = False, rule: str = "ensemble", **kwargs: Any
    ) -> tuple[np.ndarray, ...]:
        """``keys, p`` (``keys, p, std`` with ``return_std=True``), ``keys = np.unique(bag_ids)``.

        ``rule="ensemble"`` (default): ``p_b = σ(a s_b + c)``, ``s_b`` the members' mean of
        ``s_b^k = ½ (ℓ_b^k + logit p̄_b^k)`` (class docstring). Its std propagates the GPs': the std
        ``sd̄_b^k`` of each ``p̄_b^k`` (below) through the map to ``p`` to first order (the delta
        method), summed over the members as if fully correlated (an upper bound on the std of
        their sum), ``p_b (1 − p_b) (a / 2K) Σ_k sd̄_b^k / (p̄_b^k (1 − p̄_b^k))``, capped at
        ``sqrt(p_b (1 − p_b))``, the largest std of a probability with mean ``p_b``
        (Bhatia–Davis); the networks are point estimates. ``p̄_b^k`` uses the GPs' closed-form
        instance probabilities (``method="probit"`` for the logistic family), as the calibration
        did; ``kwargs`` are refused.

        ``rule="attention"``: the members' mean of ``p̄_b^k = Σ_n α_n p_n`` (their GP's instance
        probabilities pooled by their attention; uncalibrated; ``kwargs``, default the closed form,
        go to the GPs' ``predict_instance_proba``), std the mean of ``sqrt(Σ_n α_n² sd_n²)``
        (independent f*ₙ, the FITC diagonal, as for the noisy-OR std of seed 000 Eq. 37). Any
        other ``rule`` goes, with the keyword arguments, to each member GP's ``predict_bag_proba``
        on its embedding, and the members' probabilities (and stds) are averaged.

        ``rule="network"``: the networks' own bag probability ``σ(mean_k ℓ_b^k)`` (no std; the
        ABMIL estimate of the networks trained here), for comparison.
        """
        check_is_fitted(self, "gps_")
        X, bags, _ = check_mil_data(X, bag_ids)
        X_sorted = to_numpy(X)[bags.order]
        members = range(len(self.gps_))
        if rule == "network":
            if return_std or kwargs:
                raise ValueError("rule='network' is the networks' own point estimate: no std, no keyword arguments")
            logits = [bag_logits(network_arrays(self.network_states_[k]), self._embed(X_sorted, k), bags.offsets)
                      for k in members]
            return bags.keys, expit(np.mean(logits, axis=0))
        if rule not in ("ensemble", "attention"):
            per_member = [gp.predict_bag_proba(self.member_transform(X, k), bag_ids, return_std=return_std, rule=rule,
                                               **kwargs)[1:] for k, gp in enumerate(self.gps_)]
            return (bags.keys, *np.mean(per_member, axis=0))
        if rule == "ensemble" and kwargs:
            raise ValueError(f"rule='ensemble' uses the GPs' closed-form probabilities it was calibrated with; "
                             f"got keyword arguments {sorted(kwargs)}")
        H = [self._embed(X_sorted, k) for k in members]
        pooled = [self._pooled(k, H[k], bags.offsets, return_std, **kwargs) for k in members]
        if rule == "attention":
            mean = np.mean([p for p, _ in pooled], axis=0)
            return (bags.keys, mean, np.mean([sd for _, sd in pooled], axis=0)) if return_std else (bags.keys, mean)
        score = np.mean([self._member_score(k, H[k], bags.offsets, pooled[k][0]) for k in members], axis=0)
        p = expit(self.calibration_slope_ * score + self.calibration_intercept_)
        if not return_std:
            return bags.keys, p
        sensitivity = np.mean([sd / (q * (1.0 - q)) for q, sd in ((np.clip(q, _PROBA_FLOOR, 1.0 - _PROBA_FLOOR), sd)
                                                                   for q, sd in pooled)], axis=0)
        delta = p * (1.0 - p) * 0.5 * abs(self.calibration_slope_) * sensitivity
        return bags.keys, p, np.minimum(delta, np.sqrt(p * (1.0 - p)))
