"""The fit engine: every iteration is map (partition step) → sum (reduction) → small solve.

See ``DESIGN.md`` §1. With ``Kzz = L Lᵀ`` and the whitened instance feature
``a'ₙ = L⁻¹ k(Z, xₙ)``, q(v) = N(m', S') for ``v = L⁻¹u``; every model's global update is a
closed-form function of statistics that are *sums over partitions of whole bags*.

A model plugs into an executor through :class:`PartitionUpdates`:

``prepare(block)``          raw bag block → what the step works on (e.g. whitened features);
``init_local(block)``       the block's local variational parameters (π, ξ, …);
``init_global()``           the starting global state (e.g. q(v) = prior);
``partition_step(block, local, global)`` → ``(statistics, new local)``;
``global_update(statistics, global)`` → ``(new global, objective)``;
``step_from_local(local, global)`` (optional) → the partition step from the local state alone,
                            or ``None`` when it needs the block (:func:`step_from_local`).

Statistics are :class:`Summable` dataclasses, so the reduction is plain ``+`` (a Python
``sum`` here, a Dask tree reduction in ``tasks``). :class:`SerialExecutor` is the
single-process executor; :func:`optimise` is the shared convergence loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property, reduce
from typing import Any, Generic, Protocol, TypeVar

import numpy as np
from array_api_compat import device
from sklearn.exceptions import ConvergenceWarning

from ._backend import (
    array_namespace,
    cholesky_with_jitter,
    is_host_array,
    like,
    solve_lower,
    to_numpy,
)
from ._native_blas import cholesky_solve, upper_triangular_product
from .kernels import RBF

__all__ = [
    "BagBlock",
    "HeldOutRows",
    "FitTrace",
    "GaussianQ",
    "PartitionUpdates",
    "SerialExecutor",
    "SparseGP",
    "Summable",
    "WhitenedBags",
    "WhitenedBlock",
    "gaussian_update",
    "optimise",
    "step_from_local",
]

Block = TypeVar("Block")
Local = TypeVar("Local")
Global = TypeVar("Global")
Stats = TypeVar("Stats", bound="Summable")


@dataclass(frozen=True)
class BagBlock:
    """A block of whole bags: rows ``X`` (n, D), CSR ``offsets`` (b + 1) local to the block,
    bag ``labels`` (b,) in {0, 1} (−1 for unlabelled bags at prediction time), and optionally
    integer instance ``coords`` (n, d) in the same row order (used by VGPMIL-PR-I's neighbour graph).
    ``bag_index`` (b,): each bag's position among all the bags of the fit, where a model keys per-bag
    random streams by it (the Gibbs sampler: its draws then do not depend on the partitioning)."""

    X: Any
    offsets: np.ndarray
    labels: np.ndarray
    coords: np.ndarray | None = None
    bag_index: np.ndarray | None = None

    @property
    def n_instances(self) -> int:
        return int(self.offsets[-1])


class HeldOutRows:
    """Rows scored again and again, each time under the GP of one fit: the held-out bags of the
    kernel choice (every checkpoint of a candidate) and of early stopping (every sweep).
    :meth:`SparseGP.whiten` whitens them once and reuses that while the GP is the same object
    (a fit that learns its kernel gives each state its own GP, whitened afresh)."""

    def __init__(self, X: Any):
        self.X = X
        self._last: tuple[SparseGP, WhitenedBlock] | None = None

    def __getstate__(self) -> dict[str, Any]:  # sent to another worker: the rows, not a GP's whitening of them
        return {"X": self.X, "_last": None}

    def whitened_by(self, gp: SparseGP) -> WhitenedBlock:
        if self._last is None or self._last[0] is not gp:
            self._last = (gp, gp.whiten(self.X))
        return self._last[1]


@dataclass(frozen=True)
class SparseGP:
    """The fixed part of the sparse prior: kernel, inducing points Z and ``chol(Kzz + jitter·I)``."""

    kernel: RBF
    Z: np.ndarray
    chol: np.ndarray
    jitter: float

    @classmethod
    def build(cls, kernel: RBF, Z: np.ndarray) -> SparseGP:
        Z = np.asarray(Z, dtype=np.float64)
        chol, jitter = cholesky_with_jitter(kernel(Z, Z))
        return cls(kernel=kernel, Z=Z, chol=chol, jitter=jitter)

    @property
    def n_inducing(self) -> int:
        return int(self.Z.shape[0])

    def whiten(self, X: Any) -> WhitenedBlock:
        """``A' = K(X, Z) L⁻ᵀ`` (rows a'ₙ) and the FITC residual ``k(xₙ, xₙ) − ‖a'ₙ‖² ≥ 0``.
        ``X`` may be :class:`HeldOutRows`, whitened once per GP.

        Kernel block and triangular solve in float64 in the namespace of ``X``, over chunks of
        rows (:func:`_chunk_rows`) written into one C-ordered (n, M) array: on the host the
        temporaries of a chunk stay in cache instead of costing ~10 passes over n×M freshly
        allocated memory (3× faster on a 64 MiB partition), and the
        row-major A' makes the sweeps' GEMMs fast. Float32 ``X`` gives float32 ``A'`` (half the
        memory, float32 GEMMs in the sweeps) whose statistics are still accumulated in float64.
        """
        if isinstance(X, HeldOutRows):
            return X.whitened_by(self)
        xp = array_namespace(X)
        n, dtype = X.shape[0], (xp.float32 if X.dtype == xp.float32 else xp.float64)
        Z = like(self.Z, X, dtype=xp.float64)
        A = xp.empty((n, self.n_inducing), dtype=dtype, device=device(X))
        resid = xp.empty((n,), dtype=xp.float64, device=device(X))
        for start, stop in row_chunks(n, _chunk_rows(X)):
            chunk = X[start:stop, ...]
            part = self.whiten_cross(self.kernel(chunk, Z).T, self.kernel.diag(chunk), dtype=dtype)
            A[start:stop, ...] = part.A
            resid[start:stop] = part.resid
        return WhitenedBlock(A=A, resid=resid)

    def whiten_cross(self, Kzx: Any, diag: Any, dtype: Any = None) -> WhitenedBlock:
        """:meth:`whiten` from an already computed ``K(Z, X)`` (M, n) and ``diag K(X, X)`` (n,),
        for callers that also need the kernel block itself (the hyper-parameter gradient);
        ``dtype`` float32 stores A' in float32."""
        xp = array_namespace(Kzx)
        A = solve_lower(like(self.chol, Kzx), Kzx).T
        resid = xp.clip(diag - xp.sum(A * A, axis=1), 0.0, None)
        if dtype == xp.float32:
            A = xp.astype(A, xp.float32)
        return WhitenedBlock(A=A, resid=resid)


ROWS = 1 << 13
DEVICE_ROWS = 1 << 16


def row_chunks(n: int, rows: int | None = None) -> list[tuple[int, int]]:
    """``[start, stop)`` of consecutive chunks of at most ``rows`` (default :data:`ROWS`) rows
    covering ``n`` rows (none for n = 0)."""
    rows = rows or ROWS
    return [(start, min(start + rows, n)) for start in range(0, n, rows)]


def _chunk_rows(x: Any) -> int:
    """Rows per chunk of the whitening and the moments: :data:`ROWS` (cache-sized) on the host,
    :data:`DEVICE_ROWS` on a device (fewer kernel launches; GPU memory is not the constraint).
    Float32 statistics are summed over chunks of :data:`ROWS` everywhere (their rounding error
    grows with the chunk length)."""
    return ROWS if is_host_array(x) else DEVICE_ROWS


@dataclass(frozen=True)
class WhitenedBlock:
    """Whitened features ``A'`` (n, M) and FITC residual variances (n,), in the input's namespace."""

    A: Any
    resid: Any

    def latent_moments(self, q: GaussianQ) -> tuple[np.ndarray, np.ndarray]:
        """Host float64 ``E fₙ = a'ₙᵀm'`` and ``Var fₙ = a'ₙᵀS'a'ₙ + resid`` (DESIGN §1, Eq. 30),
        in the dtype of A'. With ``S' = RRᵀ`` (:attr:`GaussianQ.cov_factor`) the variance is
        ``‖Rᵀa'ₙ‖²``: on the host one triangular BLAS product (TRMM) per chunk of rows, about
        half the flops and a third of the time of the GEMM ``A'S'``; a GEMM by R elsewhere."""
        xp = array_namespace(self.A)
        factor = q.cov_factor
        mean = self.A @ like(q.mean, self.A, dtype=self.A.dtype)
        if is_host_array(self.A):
            upper = np.asarray(factor.T, dtype=self.A.dtype, order="F")
            var = np.empty(self.A.shape[0], dtype=self.A.dtype)
            buffer = np.empty((self.A.shape[1], min(ROWS, self.A.shape[0])), dtype=self.A.dtype, order="F")  # one allocation per call
            for start, stop in row_chunks(self.A.shape[0]):
                product = buffer[:, : stop - start]
                product[...] = self.A[start:stop].T
                upper_triangular_product(upper, product)  # Rᵀ A'ᵀ in place, (M, rows), without the GIL
                var[start:stop] = np.einsum("ij,ij->j", product, product)
        else:
            R = like(factor, self.A, dtype=self.A.dtype)
            var = xp.concat([xp.sum((self.A[start:stop, ...] @ R) ** 2, axis=1) for start, stop in row_chunks(self.A.shape[0], DEVICE_ROWS)]
                            or [xp.zeros((0,), dtype=self.A.dtype, device=device(self.A))])
        return _host64(mean), np.maximum(_host64(var) + _host64(self.resid), 0.0)

    def latent_mean(self, mean: np.ndarray) -> np.ndarray:
        """Host float64 ``A'm`` for a whitened mean ``m`` (an N-vector)."""
        return _host64(self.A @ like(mean, self.A, dtype=self.A.dtype))

    def weighted_gram(self, weights: np.ndarray) -> np.ndarray:
        """``Σ wₙ a'ₙa'ₙᵀ`` on the host in float64, summed over chunks of rows (float64 sums of
        float32 chunk products for float32 A'). Non-negative host weights: ``BᵀB`` with
        ``B = diag(√w) A'`` (a symmetric rank-k update, half the flops of a GEMM)."""
        xp = array_namespace(self.A)
        w = like(weights, self.A, dtype=self.A.dtype)
        symmetric = is_host_array(weights) and bool(np.all(np.asarray(weights) >= 0))
        scale = xp.sqrt(w) if symmetric else w
        if not is_host_array(self.A):
            def product(A: Any, rows: slice) -> Any:
                B = A * scale[rows, None]
                return B.T @ B if symmetric else A.T @ B

            return _accumulate(self.A, product)
        buffer = np.empty((min(ROWS, self.A.shape[0]), self.A.shape[1]), dtype=self.A.dtype)  # one allocation per call

        def host_product(A: np.ndarray, rows: slice) -> np.ndarray:
            B = np.multiply(A, scale[rows, None], out=buffer[: A.shape[0]])
            return B.T @ B if symmetric else A.T @ B  # NumPy runs BᵀB as a SYRK

        return _accumulate(self.A, host_product)

    def project(self, values: np.ndarray) -> np.ndarray:
        """``Σ a'ₙ vₙ`` (an M-vector) on the host."""
        return transposed_product(self.A, like(values, self.A, dtype=self.A.dtype))


def _accumulate(A: Any, product: Callable[[Any, slice], Any], shape: tuple[int, ...] | None = None) -> np.ndarray:
    """``Σ_chunks product(A[chunk], chunk)`` in float64 where ``A`` lives, returned on the host
    (zeros of ``shape``, default (M, M), when ``A`` has no rows)."""
    xp = array_namespace(A)
    out = None
    for start, stop in row_chunks(A.shape[0]):
        part = product(A[start:stop, ...], slice(start, stop))
        part = part if part.dtype == xp.float64 else xp.astype(part, xp.float64)
        out = part if out is None else out + part
    return np.zeros(shape or (A.shape[1], A.shape[1])) if out is None else to_numpy(out)


def transposed_product(A: Any, B: Any) -> np.ndarray:
    """``AᵀB`` summed over rows, on the host in float64: one GEMM for float64 input; for float32
    input, float32 GEMMs over chunks of :data:`ROWS` rows accumulated in float64 where the
    arrays live (the rounding error of a chunk grows with its length, not with N)."""
    xp = array_namespace(A)
    if A.dtype != xp.float32:
        return to_numpy(A.T @ B)
    return _accumulate(A, lambda chunk, rows: chunk.T @ B[rows, ...], shape=(A.shape[1],) + tuple(B.shape[1:]))


def _host64(x: Any) -> np.ndarray:
    return np.asarray(to_numpy(x), dtype=np.float64)


@dataclass(frozen=True)
class WhitenedBags:
    """A prepared block of whole bags: whitened features plus the block's CSR offsets and labels."""

    features: WhitenedBlock
    offsets: np.ndarray
    labels: np.ndarray

    @classmethod
    def from_block(cls, gp: SparseGP, block: BagBlock) -> WhitenedBags:
        return cls(features=gp.whiten(block.X), offsets=block.offsets, labels=np.asarray(block.labels))

    @property
    def instance_labels(self) -> np.ndarray:
        """Each instance's bag label."""
        return np.repeat(self.labels, np.diff(self.offsets))


@dataclass(frozen=True)
class GaussianQ:
    """Whitened q(v) = N(mean, cov)."""

    mean: np.ndarray
    cov: np.ndarray

    def __post_init__(self) -> None:
        self.cov_factor  # noqa: B018 — factored with q, so a prediction reads a fitted q and never adds to it

    @classmethod
    def prior(cls, n_inducing: int) -> GaussianQ:
        return cls(mean=np.zeros(n_inducing), cov=np.eye(n_inducing))

    @cached_property
    def cov_factor(self) -> np.ndarray:
        """Lower Cholesky factor R of ``S' = RRᵀ`` (host float64), computed once per q, when q is. A jitter of
        at least 1e-12 of the mean variance is added only where S' is singular (a sample covariance
        of fewer draws than M) or rounding left it indefinite."""
        return cholesky_with_jitter(self.cov, initial_relative_jitter=0.0)[0]

    def kl_to_prior(self) -> float:
        """KL(N(m', S') ‖ N(0, I)) = ½(tr S' + m'ᵀm' − M − log det S')."""
        logdet = 2.0 * np.sum(np.log(np.diag(self.cov_factor)))
        return 0.5 * float(np.trace(self.cov) + self.mean @ self.mean - self.mean.shape[0] - logdet)


def gaussian_update(precision: np.ndarray, shift: np.ndarray) -> GaussianQ:
    """``S' = (I + G')⁻¹``, ``m' = S' r'`` by a Cholesky factorisation of ``I + G'``.

    ``I + G'`` has eigenvalues ≥ 1, so the factorisation is well conditioned (DESIGN §1).
    """
    M = shift.shape[0]
    P = np.eye(M) + 0.5 * (precision + precision.T)
    chol, _ = cholesky_with_jitter(P, initial_relative_jitter=0.0)
    cov = cholesky_solve(chol, np.eye(M))  # LAPACK POTRS without the GIL
    mean = cholesky_solve(chol, shift)
    return GaussianQ(mean=mean, cov=0.5 * (cov + cov.T))


class Summable:
    """Mixin for dataclass statistics: ``a + b`` adds every field (the reduction)."""

    def __add__(self, other: Any) -> Any:
        if not isinstance(other, type(self)):
            return NotImplemented
        return type(self)(**{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)})


class PartitionUpdates(Protocol, Generic[Block, Local, Global, Stats]):
    """What an executor needs from a model (see the module docstring)."""

    def prepare(self, block: BagBlock) -> Block: ...

    def init_local(self, block: Block) -> Local: ...

    def init_global(self) -> Global: ...

    def partition_step(self, block: Block, local: Local, glob: Global) -> tuple[Stats, Local]: ...

    def global_update(self, stats: Stats, glob: Global) -> tuple[Global, float]: ...


def step_from_local(updates: PartitionUpdates, local: Any, glob: Any) -> tuple[Any, Any] | None:
    """The partition step answered from the partition's local state alone, when the model's optional
    ``step_from_local`` can (a probe whose inputs the local state cached); ``None`` otherwise. An
    executor that reads its blocks from storage on every sweep (``tasks.training``'s stream mode)
    asks first and reads the block only on ``None``; one that holds its blocks need not ask."""
    hook = getattr(updates, "step_from_local", None)
    return None if hook is None else hook(local, glob)


@dataclass
class FitTrace:
    """What :func:`optimise` returns: final global state, objective per iteration, stop reason."""

    glob: Any
    objective: list[float] = field(default_factory=list)
    n_iter: int = 0
    converged: bool = False


def _convergence_scale(objective: float, stats: Any) -> float:
    """What :func:`optimise`'s relative test divides a change by: ``|objective − kernel_term|``
    (at least 1), the objective without the part that no update changes."""
    return max(abs(objective - getattr(stats, "kernel_term", 0.0)), 1.0)


def optimise(
    sweep: Callable[[Any], Any],
    updates: PartitionUpdates,
    glob: Any,
    *,
    max_iter: int,
    tol: float | None,
    monitor: Callable[[int, Any], bool] | None = None,
    resume_from: FitTrace | None = None,
) -> FitTrace:
    """The shared fit loop: ``stats = sweep(global)`` (map + reduce, done by an executor), then
    ``global_update``. Stops when the relative change of the objective falls below ``tol``, after
    ``max_iter`` iterations, or when ``monitor(iteration, global)`` returns True. ``tol=None`` (a
    sampler) runs all ``max_iter`` iterations, with no convergence test and no warning.

    The change is relative to the objective less the statistics' optional ``kernel_term``: a term
    that no update of the variational factors changes (the probit family's FITC residual,
    ``−½ Σ r_i``, which grows with the kernel variance). Measured against the whole ELBO it ended fits on a slow climb: ``VGPMILPR``
    at v = 64 on 14,293 instances, ELBO −125,730 of which −125,310 is that term, gained 0.03 nats
    a sweep (2·10⁻⁷ of the whole, 7·10⁻⁵ of the rest), stopped after 4 sweeps at a held-out bag
    AUC of 0.60 and reached 0.98 after 200 (``docs/BENCHMARKS.md``, "The probit family's stop").

    ``resume_from`` continues a checkpointed run (its ``glob``, objective trace and ``n_iter``;
    ``glob`` is then ignored), so that an interrupted fit ends where an uninterrupted one would.
    A fit that reaches ``max_iter`` unconverged emits a scikit-learn ``ConvergenceWarning``.

    Updates may define the optional ``hyper_step(sweep, iteration, glob) → glob``: a step on
    hyper-parameters run after each global update, which may call ``sweep`` itself (seed 000,
    Algorithm 1, step 8; :mod:`mil_core.models.hyper`).
    """
    trace = FitTrace(glob=glob) if resume_from is None else resume_from
    hyper_step = getattr(updates, "hyper_step", None)
    stats = None  # a resumed trace at max_iter runs no sweep
    for it in range(trace.n_iter + 1, max_iter + 1):
        stats = sweep(trace.glob)
        trace.glob, objective = updates.global_update(stats, trace.glob)
        trace.objective.append(float(objective))
        trace.n_iter = it
        if not np.isfinite(objective):
            raise FloatingPointError(f"objective became {objective} at iteration {it}")
        if hyper_step is not None:
            trace.glob = hyper_step(sweep, it, trace.glob)
        if it > 1 and tol is not None:
            previous = trace.objective[-2]
            if abs(objective - previous) <= tol * _convergence_scale(previous, stats):
                trace.converged = True
        if monitor is not None and monitor(it, trace.glob):
            break
        if trace.converged:
            break
    else:
        if not trace.converged and len(trace.objective) >= 2 and tol is not None:
            change = abs(trace.objective[-1] - trace.objective[-2]) / _convergence_scale(trace.objective[-2], stats)
            warnings.warn(f"the fit stopped at max_iter={max_iter} without converging: the last relative change of the "
                          f"objective was {change:.1e} > tol={tol:g}; raise max_iter (or tol)", ConvergenceWarning, stacklevel=2)
    return trace


class SerialExecutor:
    """Single-process executor: holds the prepared blocks and their local state in memory and
    runs the partition step over them one after another."""

    def __init__(self, updates: PartitionUpdates, blocks: Sequence[BagBlock]):
        self.updates = updates
        self.blocks = [updates.prepare(b) for b in blocks]
        self.locals = [updates.init_local(b) for b in self.blocks]

    def sweep(self, glob: Any) -> Any:
        """Map the partition step over all blocks (updating their local state) and sum."""
        stats = []
        for i, block in enumerate(self.blocks):
            s, self.locals[i] = self.updates.partition_step(block, self.locals[i], glob)
            stats.append(s)
        return reduce(lambda a, b: a + b, stats)
