"""GP-MIL on learned instance embeddings (seed 000, §6.3, Eq. 39).

An attention-MIL network (:mod:`mil_core.attention`) is trained on the bag labels and a GP-MIL
model is fitted on the instance embeddings ``h_n = f_emb(x_n)``, as seed 000 does with AttCNN
features and VGPMIL / G-VGPMIL. The GP gives the instance probabilities and their uncertainty;
the default bag probability averages the network's and the GP's bag evidence. A small
cross-fitted ensemble of such (network, GP) pairs cuts the variance of small data sets and gives
every training bag an out-of-fold score, on which the bag probability is calibrated. Where the
networks find less in the bags than the GP finds in the input features, the fit keeps the same
cross-fitted ensemble of GPs on the input features instead (``representation="auto"``).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
from scipy.special import expit
from sklearn.base import BaseEstimator, clone
from sklearn.utils import check_random_state
from sklearn.utils.validation import check_is_fitted

from .._backend import to_numpy
from ..attention import attention_weights, bag_logits, instance_logits, network_arrays
from ..bags import segment_sum
from ..calibration import platt_proba
from ..metrics import binary_auc, chance_auc_std
from ..validation import check_mil_data, feature_names, standardisation
from .attention_mil import AttentionNetworkParams
from .base import FeatureStandardisation, forget_fit, store_params, take_bags
from .vgpmil import VGPMIL

__all__ = ["EmbeddedGPMIL", "REPRESENTATIONS", "check_member_gp", "default_gp"]

REPRESENTATIONS = ("auto", "embedding")
"""``EmbeddedGPMIL(representation=…)``: choose between the embedding and the input features per
fit, or always use the embedding."""

_CHANCE_SE = 2.0
"""``representation="auto"`` looks at the input features only when the ensemble's out-of-fold AUC
on the embeddings is within this many of its chance standard deviations of ½
(:func:`mil_core.metrics.chance_auc_std`)."""


_PROBA_FLOOR = 1e-9
"""Pooled GP probabilities are kept in [1e-9, 1 − 1e-9] before their logit (|logit| ≤ 20.7): a
bag evidence of one model cannot outvote the other's by more than that."""


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, _PROBA_FLOOR, 1.0 - _PROBA_FLOOR)
    return np.log(p) - np.log1p(-p)


def default_gp() -> BaseEstimator:
    """The GP-MIL estimator :class:`EmbeddedGPMIL` fits when given ``gp=None``, unfitted:
    ``VGPMIL()`` with its automatic kernel choice, the pipeline's default model. (``VGPMILPR()``
    measured level on these embeddings and no faster: ``docs/BENCHMARKS.md``, "Session 12".)"""
    return VGPMIL()


def _bag_ids(offsets: np.ndarray) -> np.ndarray:
    """Bag ``0 … B−1`` of each row of bags in CSR form."""
    return np.repeat(np.arange(offsets.size - 1), np.diff(offsets))


def _features_score(gp: BaseEstimator, X: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """A member GP on the input features: its bag evidence ``logit p_b`` (its own bag rule, its
    default, closed-form probabilities) of bags in CSR form."""
    return _logit(gp.predict_bag_proba(X, _bag_ids(offsets))[1])


def check_member_gp(gp: Any) -> None:
    """Raise ``ValueError`` unless ``gp`` can be an :class:`EmbeddedGPMIL`'s member GP: a GP-MIL
    estimator (not itself an ensemble) whose ``predict_instance_proba`` and ``predict_bag_proba``
    give a std (``return_std``), which the ensemble pools (seed 000 §6.3)."""
    def gives_std(name: str) -> bool:
        method = getattr(gp, name, None)
        return callable(method) and "return_std" in inspect.signature(method).parameters

    if isinstance(gp, EmbeddedGPMIL) or not (gives_std("predict_instance_proba") and gives_std("predict_bag_proba")):
        raise ValueError(f"EmbeddedGPMIL's gp must be a GP-MIL model with instance probabilities and their std "
                         f"(predict_instance_proba(X, return_std=True): VGPMIL, GVGPMIL, VGPMILPR, …), not {type(gp).__name__}")


class EmbeddedGPMIL(FeatureStandardisation, AttentionNetworkParams, BaseEstimator):
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

    The representation (``representation="auto"``): when the ensemble's out-of-fold scores
    ``s_b^{k(b)}`` (those the calibration is fitted on) rank the training bags no better than
    chance can — their AUC within two chance standard deviations of ½
    (:func:`mil_core.metrics.chance_auc_std`: 0.61 with 60 bags per class) — member ``k`` also fits a
    clone of ``gp`` on the *input features* of its training bags, and these GPs replace those on
    the embeddings if their pooled out-of-fold AUC (each bag scored ``s_b^k = logit p_b^k`` by the
    GP that did not train on it) is higher; Platt's ``(a, c)`` is then fitted on their scores.
    Why: where the witness differs from the negatives in a way the networks do not learn from bag
    labels (``hastie``: only the norm of the features), the ensemble on the embeddings fell below
    chance while ``VGPMIL()`` on the features did not (``docs/BENCHMARKS.md``, "GP-MIL on learned
    embeddings"). Why only then: comparing the two on every fit picked the features on near ties
    (out-of-fold AUC 0.936 against 0.935 on a MUSK1 fold) and lost on the test bags (MUSK1 bag AUC
    −0.038 on one model seed); where the embedding clearly works it is kept and no GP on the input
    features is fitted. Nothing is compared when the networks held out no bags or the GP makes no
    kernel choice (a fixed ``kernel``).

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
    representation : {"auto", "embedding"}, default="auto"
        ``"auto"``: the GPs on the embeddings, or on the input features where the embeddings rank
        the bags no better than chance out of fold and the features do better (above);
        ``"embedding"``: always on the embeddings.
    standardize : bool, default=True
        ``fit`` standardises the input features on the training instances (``feature_mean_`` /
        ``feature_scale_``; a column with std < 1e-12 keeps scale 1), and every ``predict_*``,
        :meth:`transform` and :meth:`predict_attention` applies them, as the GP models do. The
        networks standardise their inputs anyway; the GPs on the input features
        (``representation="auto"``) would otherwise see each feature in its own units. The member
        GPs' own ``standardize`` is turned off: they see rows standardised once.
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
    representation_ : {"embedding", "features"}
        What the member GPs see: the standardised embeddings, or the input features.
    representation_auc_ : dict[str, float]
        The out-of-fold bag AUCs (``"embedding"``: the ensemble's on the embeddings;
        ``"features"``: the GPs' on the input features, NaN where they were not fitted).
    gps_ : list of estimators
        Each member's fitted GP-MIL model on its training bags, on the representation kept.
    calibration_slope_, calibration_intercept_ : float
        Platt's ``a`` and ``c`` (1 and 0 without calibration).
    feature_mean_, feature_scale_ : ndarray of shape (n_features,) or None
        The input standardisation (``standardize``); None without it.
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
        representation: str = "auto",
        standardize: bool = True,
        random_state: Any = None,
    ):
        store_params(self, locals())

    def fit(self, X: Any, bag_ids: Any, y: Any) -> EmbeddedGPMIL:
        """Train the members' networks, each member's GP on the embeddings of its training bags and
        the calibration on the out-of-fold scores; with ``representation="auto"`` also each
        member's GP on the input features of its training bags, kept instead (with their own
        calibration) when they score higher out of fold."""
        self._check_params()
        names = feature_names(X)
        X, bags, labels = check_mil_data(X, bag_ids, y)
        forget_fit(self, names)
        X_sorted, scaling = self._standardise_training_rows(to_numpy(X).astype(np.float64, copy=False)[bags.order])
        network_seed, gp_seed = self._seeds()
        self.fit_embedding(X_sorted, bags.offsets, labels, seed=network_seed)
        held_out = self.held_out_embeddings(X_sorted, bags.offsets)
        gps = []
        for member in range(len(self.network_states_)):
            X_train, train_ids, y_train = self._member_training_data(X_sorted, bags.offsets, labels, member)
            gps.append(self.gp_clone(member, gp_seed).fit(self._member_embedding(X_train, member), train_ids, y_train))
        self.gps_ = gps
        self.fit_calibration(held_out, labels)
        embedding_auc = self.out_of_fold_auc(held_out, labels)
        features_gps = self.features_gp_candidates(gp_seed, embedding_auc, labels)
        for member, gp in enumerate(features_gps or []):
            gp.fit(*self._member_training_data(X_sorted, bags.offsets, labels, member))
        held_out_inputs = None if features_gps is None else self.held_out_inputs(X_sorted, bags.offsets)
        self.choose_representation(features_gps, held_out_inputs, embedding_auc, labels)
        self.feature_mean_, self.feature_scale_ = scaling
        return self

    def fit_embedding(self, X_sorted: np.ndarray, offsets: np.ndarray, labels: np.ndarray, *, seed: int) -> EmbeddedGPMIL:
        """Train the networks and the embedding standardisations on bags given as CSR rows (bag
        ``b`` is ``X_sorted[offsets[b]:offsets[b+1]]`` with label ``labels[b]``). :meth:`fit`'s first
        step; also the entry point of executors that fit the GPs elsewhere (``tasks.training``), whose
        rows come in the units they are used in (``fit`` and the executor set ``feature_mean_`` after)."""
        self.feature_mean_ = self.feature_scale_ = None
        X_sorted = np.asarray(X_sorted, dtype=np.float64)
        fit = self._network_fit(X_sorted, np.asarray(offsets), np.asarray(labels, dtype=np.int64), seed,
                                n_networks=self.n_networks)
        self._store_traces(fit, X_sorted.shape[1])
        self.network_states_, self.validation_bags_ = fit.params, fit.validation_bags
        scalings = [standardisation(self._embed(X_sorted, member)) for member in range(len(fit.params))]
        self.embedding_mean_ = np.stack([mean for mean, _ in scalings])
        self.embedding_scale_ = np.stack([scale for _, scale in scalings])
        return self

    def held_out_inputs(self, X_sorted: np.ndarray, offsets: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each member's held-out bags, ``(rows, offsets)`` in CSR form (input features)."""
        check_is_fitted(self, "validation_bags_")
        return [take_bags(np.asarray(X_sorted, dtype=np.float64), np.asarray(offsets), bags) for bags in self.validation_bags_]

    def held_out_embeddings(self, X_sorted: np.ndarray, offsets: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """Each member's embedding of its held-out bags, ``(H, offsets)`` in CSR form, for
        :meth:`fit_calibration` (``n_components`` numbers per instance, so the executor need not
        keep the input rows while the GPs train); none without early stopping and calibration."""
        return [(self._embed(rows, member) if rows.shape[0] else np.empty((0, self.n_components)), local)
                for member, (rows, local) in enumerate(self.held_out_inputs(X_sorted, offsets))]

    def _member_training_data(self, X_sorted: np.ndarray, offsets: np.ndarray, labels: np.ndarray,
                              member: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``X, bag_ids, y`` of member ``member``'s training bags (input features), for a GP's ``fit``."""
        training = self.gp_training_bags(member, labels.size)
        X_train, train_offsets = take_bags(X_sorted, offsets, training)
        return X_train, _bag_ids(train_offsets), np.repeat(labels[training], np.diff(train_offsets))

    def gp_training_bags(self, member: int, n_bags: int) -> np.ndarray:
        """The bags (of the ``n_bags`` given to :meth:`fit_embedding`) member ``member``'s GP trains
        on: all but its held-out bags."""
        check_is_fitted(self, "validation_bags_")
        return np.setdiff1d(np.arange(n_bags), self.validation_bags_[member])

    def _gp_template(self) -> BaseEstimator:
        """``gp``, or :func:`default_gp` when it is ``None`` (unfitted; clone it before fitting)."""
        return self.gp if self.gp is not None else default_gp()

    def gp_clone(self, member: int, seed: int) -> BaseEstimator:
        """Member ``member``'s unfitted GP: a clone of ``gp`` (or :func:`default_gp`), an unset
        ``random_state`` set to ``seed + member``, its own ``standardize`` off (it sees the
        embedding standardised on all training instances, or the input features standardised once
        on them by :meth:`fit` or the cluster's fit, so that both train the same GPs)."""
        gp = clone(self._gp_template())
        params = gp.get_params(deep=False)
        if "random_state" in params and params["random_state"] is None:
            gp.set_params(random_state=(seed + member) % (2**31 - 1))
        if params.get("standardize"):
            gp.set_params(standardize=False)
        return gp

    def out_of_fold_auc(self, held_out: list[tuple[np.ndarray, np.ndarray]], labels: np.ndarray) -> float:
        """The bag AUC of the ensemble's out-of-fold scores ``s_b^{k(b)}`` on ``held_out``
        (:meth:`held_out_embeddings`; ``labels`` of all bags given to :meth:`fit_embedding`), the
        scores the calibration is fitted on; NaN without held-out bags of both classes."""
        check_is_fitted(self, "gps_")
        truth = self._held_out_labels(labels)
        if np.unique(truth).size < 2:
            return float("nan")
        return binary_auc(truth, np.concatenate([self._member_score(k, H, offsets) for k, (H, offsets) in enumerate(held_out)]))

    def features_gp_candidates(self, seed: int, embedding_auc: float, labels: np.ndarray) -> list[BaseEstimator] | None:
        """The members' unfitted GPs on the input features for ``representation="auto"``: clones of
        ``gp``, member ``k``'s seeded ``seed + n_members + k`` (after the GPs on the embeddings),
        each to be fitted on its member's training bags (:meth:`gp_training_bags`). ``None`` when
        nothing is compared: ``representation="embedding"``, an ``embedding_auc``
        (:meth:`out_of_fold_auc`; NaN without held-out bags) more than two chance standard
        deviations above ½ (class docstring), or a GP that makes no kernel choice (a fixed ``kernel``)."""
        check_is_fitted(self, "validation_bags_")
        gp = self._gp_template()
        if (self.representation != "auto" or not np.isfinite(embedding_auc)
                or embedding_auc > 0.5 + _CHANCE_SE * chance_auc_std(self._held_out_labels(labels))
                or gp.get_params(deep=False).get("kernel", "fixed") is not None):
            return None
        n_members = len(self.validation_bags_)
        return [self.gp_clone(n_members + member, seed) for member in range(n_members)]

    def _held_out_labels(self, labels: np.ndarray) -> np.ndarray:
        """The labels of the members' held-out bags, in the order of their out-of-fold scores."""
        return np.asarray(labels)[np.concatenate(self.validation_bags_)]

    def choose_representation(self, features_gps: list[BaseEstimator] | None,
                              held_out_inputs: list[tuple[np.ndarray, np.ndarray]] | None,
                              embedding_auc: float, labels: np.ndarray) -> str:
        """Keep ``features_gps`` (from :meth:`features_gp_candidates`, member ``k``'s fitted on the
        input features of its training bags; ``None``: nothing to compare) instead of ``gps_`` when
        their pooled out-of-fold bag AUC on ``held_out_inputs`` (:meth:`held_out_inputs`; ``labels``
        of all bags given to :meth:`fit_embedding`) exceeds ``embedding_auc``
        (:meth:`out_of_fold_auc`). Sets ``representation_`` and ``representation_auc_``, and with
        ``"features"`` replaces ``gps_`` and the calibration (fitted on the features' out-of-fold
        scores). Returns ``representation_``. :meth:`fit`'s last step; also the cluster fit's."""
        check_is_fitted(self, "gps_")
        truth = self._held_out_labels(labels)
        features, scores = float("nan"), None
        if features_gps is not None:
            scores = np.concatenate([_features_score(gp, rows, offsets)
                                     for gp, (rows, offsets) in zip(features_gps, held_out_inputs, strict=True)])
            features = binary_auc(truth, scores)
        self.representation_auc_ = {"embedding": float(embedding_auc), "features": features}
        self.representation_ = "features" if features > embedding_auc else "embedding"  # False with a NaN: the embedding
        if self.representation_ == "features":
            self.gps_ = list(features_gps)
            self._fit_calibration(lambda: scores, truth)
        return self.representation_

    def _check_params(self) -> None:
        """The parameters' values, ``representation`` and ``gp`` before the networks train (a GP that
        cannot serve failed after them)."""
        if self.representation not in REPRESENTATIONS:
            raise ValueError(f"representation must be one of {REPRESENTATIONS}, got {self.representation!r}")
        self._check_network_params(self.n_networks)
        gp = self._gp_template()
        check_member_gp(gp)
        if callable(check := getattr(gp, "_check_params", None)):  # a gpmil model's values; another estimator checks its own
            check()

    def _on_features(self) -> bool:
        """Whether the member GPs are on the input features (a model saved before
        ``representation`` existed has no ``representation_``: on the embeddings)."""
        return getattr(self, "representation_", "embedding") == "features"

    def _gp_input(self, X: Any, member: int) -> Any:
        """What member ``member``'s GP sees of the rows ``X``: the input features or its embedding."""
        return X if self._on_features() else self._member_embedding(X, member)

    def fit_calibration(self, held_out: list[tuple[np.ndarray, np.ndarray]], labels: np.ndarray) -> EmbeddedGPMIL:
        """Platt scaling of the out-of-fold ensemble scores: each member's score
        ``s^k`` on its held-out bags (``held_out`` from :meth:`held_out_embeddings`; ``labels`` of
        all bags given to :meth:`fit_embedding`). :meth:`fit`'s last step, after ``gps_`` is fitted."""
        check_is_fitted(self, "gps_")
        truth = self._held_out_labels(labels)
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

    def _member_embedding(self, X: Any, member: int) -> np.ndarray:
        """Member ``member``'s standardised embedding of rows in the fit's units."""
        return self._standardised(self._embed(X, member), member)

    def member_transform(self, X: Any, member: int) -> np.ndarray:
        """Member ``member``'s standardised instance embedding, (N, n_components): what its GP sees."""
        check_is_fitted(self, "embedding_mean_")
        return self._member_embedding(self._input_rows(X), member)

    def transform(self, X: Any) -> np.ndarray:
        """The members' standardised instance embeddings side by side, (N, n_members · n_components)."""
        X = self._input_rows(X)
        return np.hstack([self._member_embedding(X, member) for member in range(len(self._states()))])

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
        (default its closed form). With ``representation_ == "features"`` the networks found less
        than the GPs on the input features, and ``"ensemble"`` is ``"gp"``: the mixture of those GPs.
        """
        check_is_fitted(self, "gps_")
        if rule not in ("ensemble", "gp", "network"):
            raise ValueError(f"rule must be 'ensemble', 'gp' or 'network', got {rule!r}")
        if rule == "network" and (return_std or kwargs):
            raise ValueError("rule='network' is the networks' own point estimate: no std, no keyword arguments")
        X = self._input_rows(X)
        features = self._on_features() and rule != "network"
        H = None if features else [self._embed(X, k) for k in range(len(self.network_states_))]  # once per member
        logits = [] if rule == "gp" or features else [instance_logits(network_arrays(self.network_states_[k]), h)
                                                      for k, h in enumerate(H)]
        if rule == "network":
            return expit(np.mean(logits, axis=0))
        gps = [gp.predict_instance_proba(X if features else self._standardised(H[k], k), return_std=return_std, **kwargs)
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
        on what it sees (its embedding, or the input features), and the members' probabilities (and
        stds) are averaged.

        ``rule="network"``: the networks' own bag probability ``σ(mean_k ℓ_b^k)`` (no std; the
        ABMIL estimate of the networks trained here), for comparison.

        With ``representation_ == "features"`` the member GPs see the input features: ``"ensemble"``
        is ``p_b = σ(a s_b + c)`` with ``s_b`` the members' mean of ``logit p_b^k``, each member GP's
        own (closed-form) bag probability, as calibrated; its std by the same delta method with
        ``a / K`` for ``a / 2K``. ``"attention"`` needs the embeddings and is refused.
        """
        check_is_fitted(self, "gps_")
        X, bags, _ = check_mil_data(self._input_rows(X), bag_ids)
        X_sorted = to_numpy(X)[bags.order]
        if rule == "network":
            if return_std or kwargs:
                raise ValueError("rule='network' is the networks' own point estimate: no std, no keyword arguments")
            logits = [bag_logits(network_arrays(state), self._embed(X_sorted, k), bags.offsets)
                      for k, state in enumerate(self.network_states_)]
            return bags.keys, expit(np.mean(logits, axis=0))
        if rule not in ("ensemble", "attention"):
            per_member = [gp.predict_bag_proba(self._gp_input(X, k), bag_ids, return_std=return_std, rule=rule,
                                               **kwargs)[1:] for k, gp in enumerate(self.gps_)]
            return (bags.keys, *np.mean(per_member, axis=0))
        if rule == "ensemble" and kwargs:
            raise ValueError(f"rule='ensemble' uses the GPs' closed-form probabilities it was calibrated with; "
                             f"got keyword arguments {sorted(kwargs)}")
        members = range(len(self.gps_))
        if self._on_features():
            if rule == "attention":
                raise ValueError("rule='attention' pools GPs on the embeddings by the networks' attention; this fit kept "
                                 "the GPs on the input features (representation_='features')")
            outputs = [gp.predict_bag_proba(X_sorted, _bag_ids(bags.offsets), return_std=return_std) for gp in self.gps_]
            pooled = [(out[1], out[2] if return_std else None) for out in outputs]
            score, weight = np.mean([_logit(q) for q, _ in pooled], axis=0), 1.0
        else:
            H = [self._embed(X_sorted, k) for k in members]
            pooled = [self._pooled(k, H[k], bags.offsets, return_std, **kwargs) for k in members]
            if rule == "attention":
                mean = np.mean([p for p, _ in pooled], axis=0)
                return (bags.keys, mean, np.mean([sd for _, sd in pooled], axis=0)) if return_std else (bags.keys, mean)
            score, weight = np.mean([self._member_score(k, H[k], bags.offsets, pooled[k][0]) for k in members], axis=0), 0.5
        p = platt_proba(score, self.calibration_slope_, self.calibration_intercept_)
        if not return_std:
            return bags.keys, p
        sensitivity = np.mean([sd / (q * (1.0 - q)) for q, sd in ((np.clip(q, _PROBA_FLOOR, 1.0 - _PROBA_FLOOR), sd)
                                                                   for q, sd in pooled)], axis=0)
        delta = p * (1.0 - p) * weight * abs(self.calibration_slope_) * sensitivity
        return bags.keys, p, np.minimum(delta, np.sqrt(p * (1.0 - p)))
