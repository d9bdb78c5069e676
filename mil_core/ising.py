"""The Ising/CAR coupling of VGPMIL-PR-I (seed 002, Sec. 2.3, Eq. 8–12): neighbour graphs from
instance coordinates, the sparse precision ``P_b = λC_b + I`` and the two things the model needs
from ``Σ_b = P_b⁻¹`` — products ``Σ_b v`` and the diagonal ``diag(Σ_b)`` — without ever forming
``Σ_b`` for a large bag.

Neighbourhoods
--------------
Coordinates are integer grid positions of the instances of a bag: ``(row, col)`` for tiles of a
slide, a single ``slice`` index for CT slices (shape (N,) or (N, 1)). Two instances of the *same
bag* are contiguous when

* 1-D coordinates (chain):   ``|Δz| = 1``;
* 2-D, ``neighbourhood=4``:   ``|Δr| + |Δc| = 1`` (the paper's 5-patch example, Eq. 9–10);
* 2-D, ``neighbourhood=8``:   ``max(|Δr|, |Δc|) = 1``.

``C_b`` is the graph Laplacian (degree on the diagonal, −1 per edge): ``mᵀC_b m = Σ_{i~j}(m_i − m_j)²``.

Solves and diag(Σ_b)
--------------------
``P_b = I + λC_b`` is symmetric, diagonally dominant, with spectrum in ``[1, 1 + λ·2·deg_max]``
(Gershgorin). Products ``Σ_b v`` use one sparse LU factorisation (SuperLU, minimum-degree ordering
of ``Pᵀ + P``) of the block-diagonal precision of a whole partition, made once and reused.

``diag(Σ_b)`` is exact (dense Cholesky of ``P_b``) for bags of at most ``exact_max_size``
instances. For larger bags it is computed by *probing* (Tang & Saad 2012) with a coordinate
colouring and a proven error bound:

* colour instance ``i`` by its coordinates modulo ``s`` (``s²`` colours in 2-D, ``s`` on a chain);
  same-coloured instances are at grid (hence graph) distance ≥ ``s``;
* one solve ``P_b x_c = 1_c`` per colour ``c``; ``(x_c)_i`` for ``i`` of colour ``c`` equals
  ``(Σ_b)_ii + Σ_{j≠i, same colour} (Σ_b)_ij``;
* ``P_b`` is an M-matrix, so ``Σ_b ≥ 0`` entrywise: the estimate is an upper bound, and by the
  Chebyshev-polynomial decay bound (Demko–Moss–Smith 1984; graph form Benzi & Razouk 2007)
  ``(Σ_b)_ij ≤ K q^{d(i,j)}``, ``q = (√κ−1)/(√κ+1)``, ``K = (1+√κ)²/(2b)``, ``b = 1 + 2λ·deg_max``,
  ``κ = b``, so the error of every entry is at most ``K·Σ_{k≥1} n_k q^{ks}`` with ``n_k = 8k``
  same-coloured instances at Chebyshev distance ``ks`` in 2-D (``2`` on a chain):
  ``8Kx/(1−x)²`` resp. ``2Kx/(1−x)``, ``x = q^s``.
* ``s`` is the smallest period whose bound is below ``diag_tol``; the bound is returned.

The cost is ``s²`` sparse solves per large bag, once per fit (``diag(Σ_b)`` does not change
across iterations).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import scipy.linalg
import scipy.sparse as sp
import scipy.sparse.linalg as spla
from scipy.special import log_ndtr, logsumexp

from ._backend import array_namespace, is_host_array, like
from .bags import BagIndex, segment_sum
from .predictive import sample_latent

__all__ = [
    "Neighbourhood",
    "check_coords",
    "neighbour_edges",
    "laplacian",
    "probing_period",
    "CARCoupling",
    "sparse_lu",
    "smoothed_field_log_p0",
]

Neighbourhood = Literal[4, 8]


def check_coords(coords: Any, bags: BagIndex) -> np.ndarray:
    """Validate instance coordinates and return them as int64 (N, d), d ∈ {1, 2}, in bag order.

    Raises ``ValueError`` for a wrong shape, non-integer or non-finite values, or two instances of
    one bag at the same position.
    """
    coords = np.asarray(coords)
    n = bags.order.shape[0]
    if coords.ndim == 1:
        coords = coords[:, None]
    if coords.ndim != 2 or coords.shape[0] != n or coords.shape[1] not in (1, 2):
        raise ValueError(
            f"coords must have shape ({n},), ({n}, 1) for slice indices or ({n}, 2) for (row, col) "
            f"grid positions, got {np.shape(coords)}"
        )
    if coords.dtype.kind not in "iuf" or (coords.dtype.kind == "f" and not np.all(np.isfinite(coords))):
        raise ValueError("coords must be finite integer grid positions")
    if coords.dtype.kind == "f" and not np.all(coords == np.round(coords)):
        raise ValueError("coords must be integer grid positions (found non-integer values)")
    coords = coords.astype(np.int64)[bags.order]
    bag_of_row = bags.instance_bag()
    keyed = np.column_stack([bag_of_row, coords])
    order = np.lexsort(keyed.T[::-1])
    same = np.all(keyed[order[1:]] == keyed[order[:-1]], axis=1)
    if np.any(same):
        first = order[1:][same][0]
        raise ValueError(
            f"bag {bags.key(bag_of_row[first])!r} has two instances at coordinates "
            f"{coords[first].tolist()}; coordinates must be unique within a bag ({int(same.sum())} duplicate(s))"
        )
    return coords


def _half_offsets(dim: int, neighbourhood: Neighbourhood) -> np.ndarray:
    if dim == 1:
        return np.array([[1]])
    if neighbourhood == 4:
        return np.array([[0, 1], [1, 0]])
    if neighbourhood == 8:
        return np.array([[0, 1], [1, 0], [1, 1], [1, -1]])
    raise ValueError(f"neighbourhood must be 4 or 8, got {neighbourhood!r}")


def neighbour_edges(coords: np.ndarray, offsets: np.ndarray, neighbourhood: Neighbourhood = 4) -> np.ndarray:
    """Edges ``(i, j)``, ``i < j`` (rows of an (E, 2) array), between contiguous instances of the
    same bag; ``coords`` (n, d) are in the block's row order, ``offsets`` its CSR bag offsets."""
    n, dim = coords.shape
    bag = np.repeat(np.arange(offsets.shape[0] - 1), np.diff(offsets))
    if n == 0:
        return np.zeros((0, 2), dtype=np.int64)
    low = coords.min(axis=0) - 1
    span = coords.max(axis=0) - low + 2
    if np.prod(span.astype(float)) * (bag[-1] + 1) > 2**62:
        raise ValueError("coordinate range too large to index; shift coords to start near 0 per bag")

    def key(positions: np.ndarray) -> np.ndarray:
        k = bag.copy()
        for axis in range(dim):
            k = k * span[axis] + (positions[:, axis] - low[axis])
        return k

    own = key(coords)
    order = np.argsort(own, kind="stable")
    sorted_keys = own[order]
    edges = []
    for delta in _half_offsets(dim, neighbourhood):
        target = key(coords + delta)
        pos = np.clip(np.searchsorted(sorted_keys, target), 0, n - 1)
        hit = sorted_keys[pos] == target
        i, j = np.flatnonzero(hit), order[pos[hit]]
        edges.append(np.column_stack([np.minimum(i, j), np.maximum(i, j)]))
    return np.concatenate(edges).astype(np.int64)


def laplacian(edges: np.ndarray, n: int) -> sp.csr_matrix:
    """Graph Laplacian ``C`` of Eq. 8–10: ``mᵀCm = Σ_{(i,j)∈edges}(m_i − m_j)²``."""
    i, j = edges[:, 0], edges[:, 1]
    adjacency = sp.coo_matrix((np.ones(i.shape[0]), (i, j)), shape=(n, n)).tocsr()
    adjacency = adjacency + adjacency.T
    degree = np.asarray(adjacency.sum(axis=1)).ravel()
    return (sp.diags(degree) - adjacency).tocsr()


def _decay_constants(lam: float, max_degree: int) -> tuple[float, float]:
    """``(K, q)`` of the bound ``(Σ)_ij ≤ K q^{d(i,j)}`` for ``Σ = (I + λC)⁻¹``."""
    b = 1.0 + 2.0 * lam * max_degree
    root = np.sqrt(b)
    return (1.0 + root) ** 2 / (2.0 * b), (root - 1.0) / (root + 1.0)


def _probing_bound(K: float, q: float, period: int, dim: int) -> float:
    x = q**period
    return K * (8.0 * x / (1.0 - x) ** 2 if dim == 2 else 2.0 * x / (1.0 - x))


def probing_period(lam: float, max_degree: int, dim: int, tol: float) -> tuple[int, float]:
    """Smallest colouring period ``s`` whose probing error bound is ≤ ``tol``; returns ``(s, bound)``."""
    if not tol > 0:
        raise ValueError(f"the probing tolerance must be > 0 (no period's bound falls below {tol!r})")
    K, q = _decay_constants(lam, max_degree)
    if q == 0.0:
        return 1, 0.0
    period = 2
    while _probing_bound(K, q, period, dim) > tol:
        period += 1
    return period, _probing_bound(K, q, period, dim)


@dataclass
class CARCoupling:
    """``Σ = (I + λC)⁻¹`` for one block of whole bags (block diagonal over its bags).

    Built by :meth:`from_coords`. ``identity`` is True when λ = 0 or no two instances are
    contiguous: then ``Σ = I`` exactly and no factorisation is made. The sparse LU factor is
    created lazily and dropped on pickling (it is rebuilt on first use), so the object can travel
    to a Dask worker.
    """

    precision: sp.csr_matrix
    lam: float
    coords: np.ndarray | None
    offsets: np.ndarray
    edge_count: np.ndarray  # per bag
    _factor: Any = field(default=None, repr=False, compare=False)
    _kept: dict[Any, Any] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_coords(
        cls, coords: np.ndarray | None, offsets: np.ndarray, lam: float, neighbourhood: Neighbourhood = 4
    ) -> CARCoupling:
        n = int(offsets[-1])
        if lam == 0.0 or coords is None:
            edges = np.zeros((0, 2), dtype=np.int64)
        else:
            edges = neighbour_edges(np.asarray(coords, dtype=np.int64), offsets, neighbourhood)
        return cls.from_laplacian(laplacian(edges, n), offsets, lam, coords)

    @classmethod
    def from_laplacian(
        cls, laplacian_matrix: sp.spmatrix, offsets: np.ndarray, lam: float, coords: np.ndarray | None = None
    ) -> CARCoupling:
        """The coupling for a block-diagonal Laplacian ``C`` already built (so that changing λ
        costs no neighbour search); ``coords`` are only needed by probing and colouring."""
        n = int(offsets[-1])
        edge_count = np.rint(0.5 * segment_sum(laplacian_matrix.diagonal(), offsets)).astype(np.int64)
        if lam == 0.0:
            edge_count[:] = 0
        precision = (sp.identity(n, format="csr") + lam * laplacian_matrix).tocsr()
        return cls(precision=precision, lam=float(lam), coords=coords, offsets=offsets, edge_count=edge_count)

    @property
    def identity(self) -> bool:
        return not np.any(self.edge_count)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_factor"], state["_kept"] = None, None
        return state

    def keeping_bag_terms(self) -> CARCoupling:
        """This coupling, remembering what it computes per bag and what does not depend on the fit:
        :meth:`diagonal` and each small bag's ``Σ_b ∘ Σ_b`` (:meth:`smoothed_variance`). For bags
        scored again and again (the held-out bags of the kernel choice and of early stopping), not
        for training partitions: it holds every bag of up to ``exact_max_size`` instances densely."""
        return replace(self, _kept={})

    def _remembered(self, key: Any, compute: Callable[[], Any]) -> Any:
        if self._kept is None:
            return compute()
        if key not in self._kept:
            self._kept[key] = compute()
        return self._kept[key]

    def _lu(self):
        if self._factor is None:
            self._factor = sparse_lu(self.precision)
        return self._factor

    def solve(self, rhs: Any) -> Any:
        """``Σ · rhs`` (rhs (n,) or (n, k)) by the sparse LU factor of ``P = I + λC`` for host
        arrays; for arrays on a device, in their namespace by :meth:`solve_cg`."""
        if not is_host_array(rhs):
            return rhs if self.identity else self.solve_cg(rhs)
        rhs = np.asarray(rhs, dtype=np.float64)
        if self.identity:
            return rhs.copy()
        return self._lu().solve(rhs)

    def solve_cg(self, rhs: Any, rtol: float = 1e-13) -> Any:
        """``Σ · rhs`` where ``rhs`` lives (any array-API namespace), without a sparse solver there.

        Conjugate gradients on the SPD ``P`` (spectrum in ``[1, 1 + 2λ·deg_max]``, so at most
        ``O(√κ · log(1/rtol))`` steps), one independent recurrence per column. ``P``'s rows are
        padded to its longest (≤ 9 entries for an 8-neighbourhood), so a product with ``P`` is a
        few row gathers; only that table goes host → device, and only one convergence flag per
        step comes back.
        """
        xp = array_namespace(rhs)
        rhs = xp.astype(rhs, xp.float64)
        index, weight = self._padded_rows()
        index, weight = like(index, rhs), like(weight, rhs, dtype=rhs.dtype)
        vector = rhs.ndim == 1
        B = rhs[:, None] if vector else rhs

        def apply(X: Any) -> Any:
            out = weight[:, 0:1] * xp.take(X, index[:, 0], axis=0)
            for k in range(1, index.shape[1]):
                out = out + weight[:, k : k + 1] * xp.take(X, index[:, k], axis=0)
            return out

        kappa = 1.0 + 2.0 * float(np.max(self.precision.diagonal() - 1.0, initial=0.0))  # 1 + 2λ·deg_max
        max_steps = int(10 * np.sqrt(kappa) * np.log(2.0 / rtol)) + 10
        X = xp.zeros_like(B)
        R, P = B, B
        rs = xp.sum(R * R, axis=0)
        target = (rtol**2) * rs
        for _ in range(max_steps):
            AP = apply(P)
            curvature = xp.sum(P * AP, axis=0)
            alpha = xp.where(curvature > 0, rs / xp.where(curvature > 0, curvature, 1.0), 0.0)
            X, R = X + alpha * P, R - alpha * AP
            rs_new = xp.sum(R * R, axis=0)
            if bool(xp.all(rs_new <= target)):
                break
            P = R + xp.where(rs > 0, rs_new / xp.where(rs > 0, rs, 1.0), 0.0) * P
            rs = rs_new
        else:
            raise np.linalg.LinAlgError(f"conjugate gradients on I + λC (λ={self.lam}) did not reach rtol={rtol} in {max_steps} steps")
        return X[:, 0] if vector else X

    def _padded_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """``P`` as (n, k) column indices and values, rows padded with zero weights on the diagonal."""
        P = self.precision.tocsr()
        n, lengths = P.shape[0], np.diff(P.indptr)
        k = max(int(lengths.max(initial=1)), 1)
        index = np.repeat(np.arange(n, dtype=np.int64)[:, None], k, axis=1)
        weight = np.zeros((n, k))
        row = np.repeat(np.arange(n), lengths)
        slot = np.arange(P.indices.shape[0]) - P.indptr[row]
        index[row, slot], weight[row, slot] = P.indices, P.data
        return index, weight

    def bag_precision(self, b: int) -> sp.csr_matrix:
        a, z = self.offsets[b], self.offsets[b + 1]
        return self.precision[a:z, a:z]

    def bag_covariance(self, b: int) -> np.ndarray:
        """Dense ``Σ_b = P_b⁻¹`` by Cholesky solves (for bags small enough to hold densely)."""
        P = self.bag_precision(b).toarray()
        return scipy.linalg.cho_solve(scipy.linalg.cho_factor(P), np.eye(P.shape[0]))

    def diagonal(self, exact_max_size: int = 2000, tol: float = 1e-6) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``diag(Σ)`` for every instance, and per bag a bound on its absolute error (0 where
        exact) and ``log det P_b``.

        Exact (dense Cholesky) for bags of ≤ ``exact_max_size`` instances, coordinate-colour
        probing with error ≤ ``tol`` (the bound returned) above (module docstring).
        """
        return self._remembered(("diagonal", exact_max_size, tol), lambda: self._diagonal(exact_max_size, tol))

    def _diagonal(self, exact_max_size: int, tol: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        n_bags = self.offsets.shape[0] - 1
        diag = np.ones(int(self.offsets[-1]))
        bound, logdet = np.zeros(n_bags), np.zeros(n_bags)
        for b in np.flatnonzero(self.edge_count):
            a, z = self.offsets[b], self.offsets[b + 1]
            P = self.bag_precision(b)
            if z - a <= exact_max_size:
                L = np.linalg.cholesky(P.toarray())
                Linv = scipy.linalg.solve_triangular(L, np.eye(z - a), lower=True, check_finite=False)
                diag[a:z] = np.sum(Linv**2, axis=0)
                logdet[b] = 2.0 * np.sum(np.log(np.diag(L)))
            else:
                diag[a:z], bound[b], logdet[b] = _probe_diagonal(P, self.coords[a:z], self.lam, tol)
        return diag, bound, logdet

    def squared_diagonal(self, exact_max_size: int = 2000) -> np.ndarray:
        """``diag(Σ²)`` for every instance (the smoother form's weights of ``Var f``; exact, dense
        per bag). Raises ``ValueError`` for a coupled bag above ``exact_max_size`` instances."""
        return self.smoothed_variance(np.ones(int(self.offsets[-1])), exact_max_size)[0]

    def smoothed_variance(
        self, var: np.ndarray, exact_max_size: int = 2000, *, n_probes: int | None = None,
        rngs: Sequence[np.random.Generator] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``diag(Σ diag(var) Σ)`` for every instance (the variance of ``Σf`` for independent
        ``f_i`` of variance ``var_i``), and per bag the standard error of its largest entry.

        Exact (dense Cholesky, standard error 0) for bags of ≤ ``exact_max_size`` instances. Above,
        Monte Carlo with ``n_probes`` probes ``w = Σ(√var ⊙ z)``, ``z ~ N(0, I)``: ``E w_i² =
        diag_i``, relative standard error ``√(2/n_probes)``, bag b's probes drawn from ``rngs[b]`` (one
        generator per bag: a bag's values do not depend on the other bags); without ``n_probes`` a
        large coupled bag raises ``ValueError`` (the training path wants exact values).
        """
        var = np.asarray(var, dtype=np.float64)
        diag, std_error = var.copy(), np.zeros(self.offsets.shape[0] - 1)
        for b in np.flatnonzero(self.edge_count):
            a, z = self.offsets[b], self.offsets[b + 1]
            if z - a <= exact_max_size:
                diag[a:z] = self._remembered(("squared covariance", b), lambda: self.bag_covariance(b) ** 2) @ var[a:z]
                continue
            if n_probes is None:
                raise ValueError(f"diag(Σ diag(var) Σ) is computed densely per bag; a bag has {z - a} instances "
                                 f"> exact_diag_max={exact_max_size} (raise exact_diag_max)")
            rng = rngs[b] if rngs is not None else np.random.default_rng(0)
            probes = sparse_lu(self.bag_precision(b)).solve(np.sqrt(var[a:z])[:, None] * rng.standard_normal((z - a, n_probes)))
            squares = probes**2
            diag[a:z] = squares.mean(axis=1)
            std_error[b] = float(np.max(squares.std(axis=1, ddof=1))) / np.sqrt(n_probes)
        return diag, std_error

    def colour_classes(self) -> list[np.ndarray]:
        """Independent sets of the neighbour graph (parity colouring of the coordinates): updating
        all members of one class at once equals updating them one after another."""
        if self.identity:
            return [np.arange(int(self.offsets[-1]))]
        parity = np.mod(self.coords, 2)
        colour = parity[:, 0] * 2 + parity[:, 1] if parity.shape[1] == 2 else parity[:, 0]
        return [np.flatnonzero(colour == c) for c in np.unique(colour)]


def smoothed_field_log_p0(
    mean_f: np.ndarray, var_f: np.ndarray, precision: sp.spmatrix, *, n_draws: int, rng: np.random.Generator
) -> tuple[float, float, float]:
    """``log P(m < 0)`` for one bag of the smoother form, ``m = Σf + ε``, ``Σ = precision⁻¹``,
    ``ε ~ N(0, I)``, with
    independent ``f_i ~ N(mean_f_i, var_f_i)``: given ``f`` the ``m_i`` are independent, so
    ``P(m < 0 | f) = Π Φ(−(Σf)_i)`` exactly and only ``f`` is sampled (Rao–Blackwellised Monte
    Carlo, log-sum-exp). Returns ``(log p, standard error of p, sd of P(m < 0 | f) over f)``."""
    draws = sample_latent(mean_f, var_f, n_draws, rng)
    log_given_f = np.sum(log_ndtr(-sparse_lu(precision).solve(draws)), axis=0)
    log_p = float(logsumexp(log_given_f) - np.log(n_draws))
    spread = float(np.std(np.exp(log_given_f)))
    return log_p, spread / np.sqrt(n_draws), spread


def sparse_lu(P: sp.spmatrix):
    """SuperLU factor of an SPD matrix: symmetric minimum-degree ordering, no pivoting."""
    return spla.splu(P.tocsc(), permc_spec="MMD_AT_PLUS_A", diag_pivot_thresh=0.0, options={"SymmetricMode": True})


def _probe_diagonal(P: sp.csr_matrix, coords: np.ndarray, lam: float, tol: float) -> tuple[np.ndarray, float, float]:
    """Probing estimate of ``diag(P⁻¹)`` with its proven error bound (module docstring), and
    ``log det P`` from the same factor."""
    n, dim = coords.shape
    max_degree = int(np.max(P.diagonal() - 1.0) / lam + 0.5)
    period, bound = probing_period(lam, max_degree, dim, tol)
    colour = np.zeros(n, dtype=np.int64)
    for axis in range(dim):
        colour = colour * period + np.mod(coords[:, axis], period)
    colours, colour = np.unique(colour, return_inverse=True)
    lu = sparse_lu(P)
    diag = np.empty(n)
    chunk = max(1, (1 << 24) // max(n, 1))
    for start in range(0, colours.shape[0], chunk):
        ids = np.arange(start, min(start + chunk, colours.shape[0]))
        probes = (colour[:, None] == ids[None, :]).astype(np.float64)
        solved = lu.solve(probes)
        rows = np.flatnonzero((colour >= ids[0]) & (colour <= ids[-1]))
        diag[rows] = solved[rows, colour[rows] - ids[0]]
    return diag, bound, float(np.sum(np.log(np.abs(lu.U.diagonal()))))
