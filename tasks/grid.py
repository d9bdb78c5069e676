"""Tile grids of level-0 pixel coordinates (CLAM/TRIDENT ``.h5``, tables' x, y columns): the grid
step of a bag or cohort, for the report's squares and heatmaps and VGPMIL-PR-I's neighbour graph."""

from __future__ import annotations

import math

import numpy as np


def neighbour_gaps(xy: np.ndarray) -> np.ndarray:
    """The positive gaps between consecutive tiles of one row (same y) or one column (same x) of a bag."""
    gaps = []
    for axis in (0, 1):
        line = xy[np.lexsort((xy[:, axis], xy[:, 1 - axis]))].astype(np.float64)
        same_line = line[1:, 1 - axis] == line[:-1, 1 - axis]
        gaps.append(np.diff(line[:, axis])[same_line])
    gaps = np.concatenate(gaps)
    return gaps[gaps > 0]


def fundamental_step(gaps: np.ndarray, share: float = 0.75, tolerance: float = 0.02) -> float | None:
    """The largest step of which at least ``share`` of the gaps are whole multiples (within
    ``tolerance`` of one: corners rounded to pixels): tiles sampled sparsely leave gaps of 1, 2, 3 …
    patches (step: the patch), a few gaps off the grid (two tissue pieces) do not count. Candidates
    are the gaps and, for whole-pixel gaps, the greatest common divisors of the commonest ones, at
    least half the smallest gap that ≥ 5 % of the gaps have (256 and 257 px are no grid of 1 px);
    None without gaps."""
    if not gaps.size:
        return None
    values, counts = np.unique(gaps, return_counts=True)
    candidates = set(values.tolist())
    if np.all(values == np.round(values)):
        common = values[np.argsort(-counts)[:8]].astype(np.int64)
        candidates |= {float(math.gcd(int(a), int(b))) for a in common for b in common}
    floor = 0.5 * values[counts >= 0.05 * counts.sum()].min()

    def multiples(step: float) -> float:
        ratio = values / step
        return counts[(np.abs(ratio - np.round(ratio)) <= tolerance * np.round(ratio)) & (ratio > 0.5)].sum() / counts.sum()

    held = [step for step in candidates if step >= floor and multiples(step) >= share]
    return float(max(held)) if held else float(values[np.argmax(counts)])


def grid_step(xy: np.ndarray) -> float | None:
    """One bag's grid step (:func:`fundamental_step` of its neighbour gaps); without two tiles in a
    row or column, the smallest spacing of its x or y values (None for one tile)."""
    if (step := fundamental_step(neighbour_gaps(xy))) is not None:
        return step
    spacings = np.concatenate([np.diff(np.unique(xy[:, axis])) for axis in (0, 1)])
    return float(spacings[spacings > 0].min()) if (spacings > 0).any() else None


def grid_positions(xy: np.ndarray) -> np.ndarray:
    """One bag's level-0 corners as integer grid positions (corner / the bag's grid step): the
    neighbour graph links positions one step apart, and corners 256 px apart were never neighbours."""
    step = grid_step(xy) or 1.0
    return np.round(np.asarray(xy, dtype=np.float64) / step).astype(np.int64)
