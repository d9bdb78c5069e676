"""Formulas on the Gaussian latent predictive ``f* ~ N(μ, σ²)`` (independent across instances,
the FITC-diagonal predictive of DESIGN §3) shared by the models and the orthant/Ising numerics."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = ["bag_generators", "prediction_seed", "probit_link_scale", "probit_scale", "sample_latent", "sample_latent_bags",
           "shared_normal_draws"]


def probit_scale(mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """``μ / sqrt(1 + πσ²/8)``: ``E[σ(f)] ≈ σ(that)`` for ``f ~ N(μ, σ²)`` (the probit
    approximation of the logistic-Gaussian integral; seed 000 Eq. 31, seed 001 Sec. 3)."""
    return mean / np.sqrt(1.0 + np.pi * var / 8.0)


def probit_link_scale(mean: np.ndarray, var: np.ndarray) -> np.ndarray:
    """``μ / sqrt(1 + σ²)``: ``E[Φ(f)] = Φ(that)`` exactly for ``f ~ N(μ, σ²)`` (the probit
    link's instance probability, seed 002 Eq. 25)."""
    return mean / np.sqrt(1.0 + var)


def sample_latent(mean: np.ndarray, var: np.ndarray, n_draws: int, rng: Any) -> np.ndarray:
    """``n_draws`` independent draws of ``f*ₙ ~ N(meanₙ, varₙ)``: an (n, n_draws) array.

    ``rng`` is a ``numpy.random.Generator`` or ``RandomState``; its standard normals fill the
    array row by row, so drawing a block of rows at a time continues the same stream.
    """
    return mean[:, None] + np.sqrt(var)[:, None] * rng.standard_normal((mean.shape[0], n_draws))


def shared_normal_draws(random_state: Any, n_draws: int) -> np.ndarray:
    """The ``n_draws`` standard normals ``z`` (seeded by :func:`prediction_seed`) that every row's
    latent draws ``f*ₙ = meanₙ + sqrt(varₙ) z`` share in an instance prediction: a row's Monte Carlo
    probability and std (Eq. 32–33) then depend on its own moments only, not on the other rows of
    the call (its partition of a cohort, the bags predicted with it)."""
    return np.random.RandomState(prediction_seed(random_state)).standard_normal(n_draws)


def sample_latent_bags(mean: np.ndarray, var: np.ndarray, offsets: np.ndarray, n_draws: int,
                       rngs: Sequence[np.random.Generator]) -> np.ndarray:
    """``n_draws`` draws of ``f*ₙ ~ N(meanₙ, varₙ)`` (an (n, n_draws) array), each bag's rows from
    its own generator (``rngs[b]``, :func:`bag_generators`) one draw after another: a bag's k-th
    draw does not depend on the other bags of the call nor on how many draws are taken at a time."""
    z = np.empty((mean.shape[0], n_draws))
    for b, rng in enumerate(rngs):
        z[offsets[b]:offsets[b + 1]] = rng.standard_normal((n_draws, offsets[b + 1] - offsets[b])).T
    return mean[:, None] + np.sqrt(var)[:, None] * z


def prediction_seed(random_state: Any) -> int:
    """The seed of a prediction's Monte Carlo draws, read from an estimator's ``random_state``
    without advancing it (a prediction never changes the estimator): an int is itself, a
    ``RandomState`` or ``Generator`` gives a digest of its state (the same state, the same draws),
    ``None`` fresh entropy (other draws at each call, as scikit-learn's ``None``)."""
    if random_state is None:
        return int(np.random.SeedSequence().entropy) % 2**32
    if isinstance(random_state, (int, np.integer)) and not isinstance(random_state, bool):
        return int(random_state)
    if isinstance(random_state, np.random.RandomState):
        state = random_state.get_state(legacy=False)["state"]
        text = f"{state['pos']}:{np.asarray(state['key']).tobytes().hex()}"
    elif isinstance(random_state, np.random.Generator):
        text = repr(random_state.bit_generator.state)
    else:
        raise ValueError(f"random_state must be None, an int, a RandomState or a Generator, got {random_state!r}")
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=4).digest(), "little")


def bag_generators(random_state: Any, keys: Sequence[Any]) -> list[np.random.Generator]:
    """One generator per bag, seeded by :func:`prediction_seed` and the bag's key: a bag's draws do
    not depend on the other bags of the call, so a cohort predicted partition by partition gives
    each bag the spread it gets predicted alone, and the same seed the same spread."""
    seed = prediction_seed(random_state)

    def words(key: Any) -> list[int]:
        tag = f"i:{int(key)}" if isinstance(key, (int, np.integer)) and not isinstance(key, bool) else f"s:{key}"
        return list(np.frombuffer(hashlib.blake2b(tag.encode(), digest_size=16).digest(), dtype=np.uint32))

    return [np.random.default_rng([seed, *words(key)]) for key in keys]
