"""Bags as CSR segments, and the bag-local operations of the MIL likelihood.

Instances of a bag are contiguous rows ``offsets[b]:offsets[b+1]``. All segment operations use
``ufunc.reduceat`` on host float64 arrays: sequential, deterministic summation, so a bag's
result does not depend on how bags are grouped into partitions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

__all__ = [
    "BagIndex",
    "segment_sum",
    "expected_max_of_others",
    "log_prob_all_negative",
    "split_into_blocks",
    "bag_score",
    "BAG_RULES",
    "TOP_FRACTION",
]

EmaxRule = Literal["exact", "max"]
BagRule = Literal["top_fraction", "max", "mean", "noisy_or"]
BAG_RULES: tuple[str, ...] = ("top_fraction", "max", "mean", "noisy_or")
TOP_FRACTION = 0.05


@dataclass(frozen=True)
class BagIndex:
    """How the rows of an (N, D) array group into bags.

    Attributes
    ----------
    keys:
        Sorted unique bag ids (length B); bag ``b`` is ``keys[b]``.
    order:
        Stable permutation of the N rows that makes each bag contiguous (``X[order]``).
    offsets:
        CSR offsets (B + 1) into the reordered rows.
    """

    keys: np.ndarray
    order: np.ndarray
    offsets: np.ndarray

    @classmethod
    def from_ids(cls, bag_ids: np.ndarray) -> BagIndex:
        keys, codes = np.unique(np.asarray(bag_ids), return_inverse=True)
        order = np.argsort(codes, kind="stable")
        counts = np.bincount(codes, minlength=keys.shape[0])
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return cls(keys=keys, order=order, offsets=offsets)

    @property
    def n_bags(self) -> int:
        return int(self.keys.shape[0])

    @property
    def sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def instance_bag(self) -> np.ndarray:
        """Bag number of each reordered row."""
        return np.repeat(np.arange(self.n_bags), self.sizes)

    def key(self, b: int) -> Any:
        """Bag ``b``'s id as a plain Python value (NumPy scalar or not, e.g. the strings of an
        object array), for messages that name the bag."""
        key = self.keys[b]
        return key.item() if isinstance(key, np.generic) else key


def segment_sum(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-bag sums of ``values`` along axis 0 (every bag non-empty)."""
    return np.add.reduceat(values, offsets[:-1], axis=0)


def segment_logsumexp(values: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """Per-bag ``log Σ exp(values)`` over CSR segments (every bag non-empty); ``−inf`` for a bag
    whose values are all ``−inf``."""
    top = np.maximum.reduceat(values, offsets[:-1])
    top = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.add.reduceat(np.exp(values - np.repeat(top, np.diff(offsets))), offsets[:-1])) + top


def expected_max_of_others(pi: np.ndarray, log1m_pi: np.ndarray, offsets: np.ndarray, rule: EmaxRule) -> np.ndarray:
    """``E[max y_{b∖n}]`` for every instance (the term of Eq. 11/25).

    ``rule="exact"``: the mean-field value ``1 − Π_{j≠n}(1 − π_j)``, computed as
    ``−expm1(Σ_b log(1−π) − log(1−π_n))`` so that nothing underflows or cancels.
    ``rule="max"``: the reference implementations' ``max_{j≠n} π_j``.
    A bag of one instance has no others: the value is 0.
    """
    sizes = np.diff(offsets)
    if rule == "exact":
        others = np.repeat(segment_sum(log1m_pi, offsets), sizes) - log1m_pi
        return -np.expm1(np.minimum(others, 0.0))
    if rule == "max":
        top = np.repeat(np.maximum.reduceat(pi, offsets[:-1]), sizes)
        is_top = pi == top
        unique_top = is_top & (np.repeat(np.add.reduceat(is_top.astype(np.int64), offsets[:-1]), sizes) == 1)
        second = np.repeat(np.maximum.reduceat(np.where(is_top, -np.inf, pi), offsets[:-1]), sizes)
        return np.maximum(np.where(unique_top, second, top), 0.0)
    raise ValueError(f"unknown E[max] rule {rule!r}; use 'exact' or 'max'")


def log_prob_all_negative(log1m_p: np.ndarray, offsets: np.ndarray) -> np.ndarray:
    """``log Π_{n∈b}(1 − p_n)`` per bag from per-instance ``log(1 − p_n)`` (noisy-OR in log
    space: bags of 10⁵ instances do not underflow). Works on (N,) or (N, L) arrays."""
    return segment_sum(log1m_p, offsets)


def split_into_blocks(offsets: np.ndarray, block_size: int) -> list[tuple[int, int]]:
    """Group consecutive whole bags into blocks of about ``block_size`` instances.

    Returns ``(bag_start, bag_stop)`` pairs; a block closes as soon as it holds at least
    ``block_size`` instances, so a bag larger than ``block_size`` is a block of its own.
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    blocks, start = [], 0
    n_bags = offsets.shape[0] - 1
    for stop in range(1, n_bags + 1):
        if offsets[stop] - offsets[start] >= block_size or stop == n_bags:
            blocks.append((start, stop))
            start = stop
    return blocks


def bag_score(p: np.ndarray, offsets: np.ndarray, rule: str) -> np.ndarray:
    """A bag's score from its instances' probabilities ``p`` ((N,) or (N, L) Monte Carlo columns).

    * ``"top_fraction"``: the mean of the bag's top ``max(1, ⌈0.05·n_b⌉)`` probabilities — the
      maximum in bags of up to 20 instances, a top-quantile mean in large ones, so that neither
      the number of negatives (which drives ``max`` up) nor dilution (which drives ``mean`` down)
      makes the ranking follow bag size;
    * ``"max"``: ``max pₙ``; ``"mean"``: ``mean pₙ``;
    * ``"noisy_or"``: ``1 − Π(1 − pₙ)`` (seed 000, Eq. 34–35), in log space; with independent
      instance errors it grows with the bag size and saturates in bags of 10³+ instances.

    ``docs/MODELS.md`` ("Bag rule") has the measurement behind the estimators' default.
    """
    p = np.asarray(p, dtype=np.float64)
    if rule == "noisy_or":
        return -np.expm1(log_prob_all_negative(np.log1p(-np.minimum(p, 1.0)), offsets))
    if rule == "max":
        return np.maximum.reduceat(p, offsets[:-1], axis=0)
    if rule == "mean":
        sizes = np.diff(offsets).reshape((-1,) + (1,) * (p.ndim - 1))
        return segment_sum(p, offsets) / sizes
    if rule == "top_fraction":
        out = np.empty((offsets.shape[0] - 1,) + p.shape[1:])
        for b, (start, stop) in enumerate(zip(offsets[:-1], offsets[1:])):
            k = max(1, int(np.ceil(TOP_FRACTION * (stop - start))))
            out[b] = -np.partition(-p[start:stop], k - 1, axis=0)[:k].mean(axis=0)
        return out
    raise ValueError(f"unknown bag rule {rule!r}; use one of {', '.join(BAG_RULES)}")
