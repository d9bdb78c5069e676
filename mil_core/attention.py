"""Gated-attention MIL network (Ilse, Tomczak & Welling 2018): its formulas and its training.

The network is seed 000's AttCNN (§6.3, Eq. 39) for feature vectors, ``f_c ∘ f_Att ∘ f_emb``:

* ``f_emb``: an MLP with ReLU, ``x_n ↦ h_n ∈ R^D`` (D = ``n_components``; seed 000 uses D ∈ {8, 32, 128});
* ``f_Att``: gated attention pooling (Ilse et al. 2018, Eq. 9),
  ``a_n = wᵀ(tanh(V h_n) ⊙ sigm(U h_n))``, ``α = softmax_b(a)``, ``z_b = Σ_n α_n h_n``;
* ``f_c``: a linear classifier with a sigmoid output, ``p(T_b = 1) = σ(cᵀ z_b + c₀)``,

trained on the bag labels by cross-entropy. The parameters live as a ``dict[str, ndarray]``
(``network_state_`` of the estimators), so a fitted network is plain arrays: it saves without
pickles and predicts without PyTorch (the estimators are :class:`mil_core.ABMIL` and
:class:`mil_core.EmbeddedGPMIL`). Each formula below is written once against the array-API
namespace of its input: PyTorch tensors during training (autograd), NumPy/CuPy arrays at
prediction. PyTorch is needed only to train (optional extra ``torch``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
from sklearn.metrics import roc_auc_score
from sklearn.model_selection import StratifiedKFold, train_test_split

from ._backend import array_namespace
from .bags import segment_logsumexp, segment_sum
from .validation import standardisation

__all__ = [
    "TORCH_MISSING",
    "NetworkFit",
    "attention_logits",
    "attention_weights",
    "bag_logits",
    "fit_attention_network",
    "instance_embedding",
    "instance_logits",
    "network_arrays",
    "training_loss",
    "validate_training_params",
    "validation_splits",
]

TORCH_MISSING = (
    "training the attention-MIL network needs PyTorch, an optional dependency of gpmil: "
    'install it with  pip install -e ".[torch]"  (torch==2.13.0)'
)
Params = dict[str, Any]

FITTED_LOSS_FRACTION = 0.5
"""Early stopping considers an epoch only once the networks' mean training cross-entropy has
fallen to this fraction of the constant predictor's, ``H(π) = −π log π − (1 − π) log(1 − π)`` with
``π`` the positive fraction of the bags: before, the held-out bags are ranked by noise
(:func:`fit_attention_network`)."""


def _import_torch():
    try:
        import torch
    except ImportError as error:
        raise ImportError(TORCH_MISSING) from error
    return torch


# --------------------------------------------------------------------------------- formulas
def _sigmoid(xp: Any, x: Any) -> Any:
    """``σ(x) = (1 + tanh(x/2))/2``: no overflow for large |x|."""
    return 0.5 * (1.0 + xp.tanh(0.5 * x))


def _linear(params: Params, name: str, h: Any) -> Any:
    return h @ params[f"{name}.weight"].T + params[f"{name}.bias"]


def _n_embedding_layers(params: Params) -> int:
    return sum(1 for k in params if k.startswith("embed.") and k.endswith(".weight"))


def instance_embedding(params: Params, X: Any) -> Any:
    """``h_n = f_emb(x_n)``: standardise with the training statistics, then Linear + ReLU layers."""
    h = (X - params["input.mean"]) / params["input.scale"]
    for i in range(_n_embedding_layers(params)):
        h = _linear(params, f"embed.{i}", h)
        h = h * (h > 0)
    return h


def attention_logits(params: Params, H: Any) -> Any:
    """Gated attention scores ``a_n = wᵀ(tanh(V h_n) ⊙ sigm(U h_n)) + w₀`` (Ilse et al. 2018, Eq. 9)."""
    xp = array_namespace(H)
    gate = xp.tanh(_linear(params, "attention.V", H)) * _sigmoid(xp, _linear(params, "attention.U", H))
    return _linear(params, "attention.w", gate)[:, 0]


def instance_logits(params: Params, H: Any) -> Any:
    """``cᵀ h_n + c₀``: the bag classifier applied to each instance alone (a bag of one instance
    has ``z = h_n``), the network's instance score."""
    return _linear(params, "classifier", H)[:, 0]


def _single_bag_logit(params: Params, H: Any) -> Any:
    """``cᵀ z + c₀`` of one bag (training: one bag per step, as in Ilse et al.)."""
    xp = array_namespace(H)
    a = attention_logits(params, H)
    alpha = xp.exp(a - xp.max(a))
    z = (alpha / xp.sum(alpha)) @ H
    return xp.sum(params["classifier.weight"][0] * z) + params["classifier.bias"][0]


def training_loss(params: Params, H: Any, label: int, cross_entropy: Any,
                  negative_instances: bool) -> tuple[Any, Any]:
    """``(loss, bag loss)`` of one training bag with embedded rows ``H``: the bag loss is the
    cross-entropy of its bag logit (Ilse et al. 2018); the loss adds, for a negative bag with
    ``negative_instances``, the mean cross-entropy of its instance logits ``cᵀh_n + c₀`` against 0.
    Why: a bag is negative only if all its instances are (seed 000 §2.1), so a negative bag's
    instances are labelled; the bag logit ``Σ_n α_n (cᵀh_n + c₀)`` reaches each of them only
    through its attention weight, which a bag of 10³–10⁴ instances dilutes. A positive bag can then
    score high only by attending to instances unlike the negative ones. ``cross_entropy(logits,
    targets)`` is the mean binary cross-entropy on logits of the caller's array library."""
    xp = array_namespace(H)
    bag_logit = _single_bag_logit(params, H)
    bag_loss = cross_entropy(bag_logit, xp.full_like(bag_logit, float(label)))
    if not negative_instances or label == 1:
        return bag_loss, bag_loss
    logits = instance_logits(params, H)
    return bag_loss + cross_entropy(logits, xp.zeros_like(logits)), bag_loss


def attention_weights(params: Params, H: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Softmax of the attention scores within each bag (host arrays, bags as CSR ``offsets``)."""
    a = attention_logits(params, H)
    return np.exp(a - np.repeat(segment_logsumexp(a, offsets), np.diff(offsets)))


def bag_logits(params: Params, H: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``cᵀ z_b + c₀`` for every bag of the embedded rows ``H`` (bags as CSR ``offsets``)."""
    z = segment_sum(attention_weights(params, H, offsets)[:, None] * H, offsets)
    return _linear(params, "classifier", z)[:, 0]


# ---------------------------------------------------------------------------------- training
@dataclass(frozen=True)
class NetworkFit:
    """Trained networks, one per member of a cross-fitted ensemble (one member: a single network):
    each member's parameters (NumPy float32) and its held-out bags (indices into the bags given;
    empty when none were held out), and the traces of the whole ensemble — mean training loss per
    epoch, the pooled out-of-fold validation loss and AUC per epoch — and the kept epoch."""

    params: list[dict[str, np.ndarray]]
    validation_bags: list[np.ndarray]
    train_loss: np.ndarray
    validation_loss: np.ndarray
    validation_auc: np.ndarray
    best_epoch: int


def _init_params(n_features: int, hidden: tuple[int, ...], n_components: int, attention_dim: int,
                 rng: np.random.Generator) -> dict[str, np.ndarray]:
    """PyTorch's default ``nn.Linear`` initialisation, ``U(±1/√fan_in)``, drawn from a seeded NumPy
    generator (so a fit does not depend on PyTorch's global random state)."""
    shapes = {}
    widths = [n_features, *hidden, n_components]
    for i in range(len(widths) - 1):
        shapes[f"embed.{i}"] = (widths[i + 1], widths[i])
    shapes |= {"attention.V": (attention_dim, n_components), "attention.U": (attention_dim, n_components),
               "attention.w": (1, attention_dim), "classifier": (1, n_components)}
    params = {}
    for name, (fan_out, fan_in) in shapes.items():
        bound = 1.0 / np.sqrt(fan_in)
        params[f"{name}.weight"] = rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32)
        params[f"{name}.bias"] = rng.uniform(-bound, bound, fan_out).astype(np.float32)
    return params


def _input_scaling(X: np.ndarray) -> dict[str, np.ndarray]:
    """Training mean and scale of each feature (:func:`~mil_core.validation.standardisation`)."""
    mean, scale = standardisation(X)
    return {"input.mean": mean.astype(np.float32), "input.scale": scale.astype(np.float32)}


@contextlib.contextmanager
def _single_thread(torch: Any) -> Iterator[None]:
    """One intra-op thread while training: float32 reductions then sum in one fixed order."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def validate_training_params(hidden: tuple[int, ...], n_components: int, attention_dim: int, learning_rate: float,
                              weight_decay: float, max_epochs: int, validation_fraction: float, patience: int,
                              n_networks: int, negative_instances: bool) -> None:
    for name, value in (("n_components", n_components), ("attention_dim", attention_dim), ("max_epochs", max_epochs),
                        ("n_epochs_no_change", patience), ("n_networks", n_networks), *((f"hidden[{i}]", h) for i, h in enumerate(hidden))):
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    if not 0 < validation_fraction < 1:
        raise ValueError(f"validation_fraction must be in (0, 1), got {validation_fraction!r}")
    if not isinstance(negative_instances, (bool, np.bool_)):
        raise ValueError(f"negative_instances must be True or False, got {negative_instances!r}")


def _label_entropy(labels: np.ndarray) -> float:
    """``H(π)``, the bag cross-entropy of the constant prediction ``π`` = the positive fraction."""
    pi = float(np.mean(labels))
    return float(-(pi * np.log(pi) + (1.0 - pi) * np.log1p(-pi))) if 0.0 < pi < 1.0 else 0.0


def validation_splits(labels: np.ndarray, n_networks: int, validation_fraction: float,
                      rng: np.random.Generator) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(training bags, held-out bags)`` of each member: one network holds out a stratified
    ``validation_fraction``; ``n_networks`` > 1 cross-fit, member ``k`` holding out fold ``k`` of a
    stratified ``n_networks``-fold split, so every bag is held out by exactly one member (the
    folds are capped at the smaller class's bag count)."""
    counts = np.bincount(labels, minlength=2)
    if counts.min() < 2:
        raise ValueError("the inner validation split (early stopping, calibration) needs at least 2 training bags "
                         f"of each class; got {counts.tolist()} (negative, positive)")
    bags = np.arange(labels.shape[0])
    seed = int(rng.integers(2**31 - 1))
    if n_networks == 1:
        train, val = train_test_split(bags, test_size=validation_fraction, stratify=labels, random_state=seed)
        return [(train, val)]
    folds = StratifiedKFold(n_splits=int(min(n_networks, counts.min())), shuffle=True, random_state=seed)
    return [(bags[train], bags[val]) for train, val in folds.split(bags, labels)]


def fit_attention_network(
    X_sorted: np.ndarray,
    offsets: np.ndarray,
    labels: np.ndarray,
    *,
    hidden: tuple[int, ...],
    n_components: int,
    attention_dim: int,
    learning_rate: float,
    weight_decay: float,
    max_epochs: int,
    early_stopping: bool,
    validation_fraction: float,
    n_epochs_no_change: int,
    seed: int,
    hold_out: bool = False,
    n_networks: int = 1,
    negative_instances: bool = False,
) -> NetworkFit:
    """Train the gated-attention network on bags (rows of bag ``b`` are
    ``X_sorted[offsets[b]:offsets[b+1]]``, label ``labels[b]``) by Adam on the bag cross-entropy,
    one bag per step in a seeded random order (Ilse et al. 2018's protocol; ``weight_decay`` is
    Adam's L2 term); with ``negative_instances`` each negative bag's step adds its instances'
    cross-entropy against 0 (:func:`training_loss`; the traces and the stopping rule use the bag
    cross-entropy alone).

    With ``early_stopping`` (or ``hold_out``) bags are held out (:func:`validation_splits`): one
    network holds out a stratified ``validation_fraction``; ``n_networks`` > 1 members are
    cross-fitted, each holding out its own fold, and trained in lockstep, epoch by epoch. With
    ``early_stopping`` the ensemble is scored after every epoch on the *pooled* out-of-fold bags
    (each held-out bag scored by the member that did not train on it) by their bag AUC, ties broken
    by the lower bag cross-entropy; training stops after ``n_epochs_no_change`` epochs without a
    better score, and every member keeps its parameters of the best epoch (one epoch count for
    all). Only epochs from the first whose mean training loss is at most
    :data:`FITTED_LOSS_FRACTION` of the constant predictor's ``H(π)`` compete (the patience counts
    from there); if none is reached, the last epoch is kept. Why: networks that have not yet fit
    their training bags give every held-out bag nearly the same score, and their AUC ranks noise —
    on a large-bag draw (20 training bags, 4 held out per member) the members stopped at epoch 6
    with a training loss of 0.695 ≈ ln 2, bag AUC 0.470 (``docs/BENCHMARKS.md``). Why the AUC
    first: the validation loss alone is lowest after a few epochs, when the network is still
    poorly ranking but not yet confident (measured: bag AUC 0.958 → 0.962 MUSK1, 0.850 → 0.864 digits,
    0.726 → 0.752 on the sparse ``text`` set, ``docs/BENCHMARKS.md``);
    confidence is left to a post-hoc calibration. Why pooled over the members: a fifth of 80 bags
    scores an epoch by 16 bags, the pooled folds by all 80, and one epoch count for all is one
    trace to report (measured against each member stopping on its own fold: MUSK1 bag AUC 0.936
    vs 0.939, level, ``docs/BENCHMARKS.md``). Without early stopping the members
    train ``max_epochs`` epochs and the last epoch is kept, on all bags unless ``hold_out`` asks
    for the same held-out bags anyway (kept out for a post-hoc calibration). Deterministic for a
    given ``seed``.
    """
    torch = _import_torch()
    hidden = tuple(hidden)
    validate_training_params(hidden, n_components, attention_dim, learning_rate, weight_decay, max_epochs,
                              validation_fraction, n_epochs_no_change, n_networks, negative_instances)
    rng = np.random.default_rng(seed)
    bags = np.arange(labels.shape[0])
    splits = validation_splits(labels, n_networks, validation_fraction, rng) if early_stopping or hold_out \
        else [(bags, bags[:0])]
    inits = []
    for train_bags, _ in splits:
        train_rows = np.concatenate([np.arange(offsets[b], offsets[b + 1]) for b in train_bags])
        inits.append(_input_scaling(X_sorted[train_rows])
                     | _init_params(X_sorted.shape[1], hidden, n_components, attention_dim, rng))
    val_bags = np.concatenate([val for _, val in splits])

    with _single_thread(torch):
        X = torch.from_numpy(np.ascontiguousarray(X_sorted, dtype=np.float32))
        targets = torch.from_numpy(labels.astype(np.float32))
        loss_fn = torch.nn.functional.binary_cross_entropy_with_logits
        members = []
        for init in inits:
            fixed = {k: torch.from_numpy(v) for k, v in init.items() if k.startswith("input.")}
            learnt = {k: torch.from_numpy(v.copy()).requires_grad_(True) for k, v in init.items() if not k.startswith("input.")}
            members.append((fixed, learnt, torch.optim.Adam(learnt.values(), lr=learning_rate, weight_decay=weight_decay)))

        def embedded(params: Params, b: int) -> Any:
            return instance_embedding(params, X[offsets[b] : offsets[b + 1]])

        def bag_logit(params: Params, b: int) -> Any:
            return _single_bag_logit(params, embedded(params, b))

        def snapshot() -> list[dict[str, Any]]:
            return [{k: v.detach().clone() for k, v in learnt.items()} for _, learnt, _ in members]

        train_loss, val_loss, val_auc = [], [], []
        best = ((-np.inf, -np.inf), 0, snapshot())
        fitted_loss, fitted = FITTED_LOSS_FRACTION * _label_entropy(labels), False
        for epoch in range(1, max_epochs + 1):
            total = 0.0
            for (fixed, learnt, optimiser), (train_bags, _) in zip(members, splits, strict=True):
                params = fixed | learnt
                for b in rng.permutation(train_bags):
                    optimiser.zero_grad()
                    loss, bag_loss = training_loss(params, embedded(params, int(b)), int(labels[b]), loss_fn,
                                                   negative_instances)
                    loss.backward()
                    optimiser.step()
                    total += float(bag_loss.detach())
            train_loss.append(total / sum(train.size for train, _ in splits))
            if not early_stopping:
                continue
            with torch.no_grad():  # each held-out bag scored by the member that did not train on it
                logits = torch.cat([torch.stack([bag_logit(fixed | learnt, int(b)) for b in val])
                                    for (fixed, learnt, _), (_, val) in zip(members, splits, strict=True)])
                val_loss.append(float(loss_fn(logits, targets[val_bags])))
            val_auc.append(float(roc_auc_score(labels[val_bags], logits.numpy())))
            fitted = fitted or train_loss[-1] <= fitted_loss
            if not fitted:
                continue
            score = (val_auc[-1], -val_loss[-1])
            if score > best[0]:
                best = (score, epoch, snapshot())
            elif epoch - best[1] >= n_epochs_no_change:
                break
        kept, best_epoch = (best[2], best[1]) if early_stopping and fitted else (snapshot(), len(train_loss))
        states = [{k: v.numpy().copy() for k, v in fixed.items()} | {k: v.numpy().copy() for k, v in member.items()}
                  for (fixed, _, _), member in zip(members, kept, strict=True)]
    return NetworkFit(params=states, validation_bags=[np.sort(val) for _, val in splits],
                      train_loss=np.asarray(train_loss), validation_loss=np.asarray(val_loss),
                      validation_auc=np.asarray(val_auc), best_epoch=best_epoch)


def network_arrays(state: dict[str, np.ndarray], dtype: Any = np.float64) -> dict[str, np.ndarray]:
    """The stored network parameters as arrays of ``dtype`` for NumPy prediction (float64: no
    float32 rounding in the features a GP sees)."""
    return {k: np.asarray(v, dtype=dtype) for k, v in state.items()}
