"""How many native threads (BLAS, OpenMP) a fit on the host uses: one for small fits, the
process's setting otherwise.

A sweep of a sparse-GP MIL fit is a few N×M and M×M products and an M×M Cholesky solve; its
inducing points come from a k-means (scikit-learn, OpenMP). When ``N·M²`` is small (a MIL
benchmark table, the kernel choice's halves, a cohort of tens of slides) each call takes micro- to
milliseconds, and a threaded BLAS or OpenMP loop hands it to a second thread. On a machine whose
other cores are busy — a shared node, Dask workers beside the client, other jobs — every handoff
waits for a scheduler time slice, about 10 ms a call: a default ``VGPMIL()`` fit on MUSK2 took
206 s instead of 10 s (``docs/BENCHMARKS.md``, "Native threads in small fits"). Large fits keep
their threads: there a call's work dwarfs the handoff.

The threads a small fit gives up are not lost: independent parts of it (the kernel choice's
splits) run side by side, each on one native thread (:func:`concurrent_parts`), when each part's
sweeps are BLAS work enough (:data:`CONCURRENT_SWEEP_FLOPS`); below that a sweep is mostly Python,
and two threads contending for the GIL were slower than one. Each part is seconds of work with no
handoff inside it, so a busy core slows it down no more than it would a serial run; a process
limited to one native thread (a Dask worker) runs them one after another.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, TypeVar

from threadpoolctl import threadpool_info, threadpool_limits

__all__ = ["CONCURRENT_SWEEP_FLOPS", "SMALL_SWEEP_FLOPS", "concurrent_parts", "native_threads", "single_thread_when_small", "threads_for"]

SMALL_SWEEP_FLOPS = 2**30
"""``N·M²`` below which a fit runs on one thread (≈ 10⁹: a sweep of ~20 ms on one core)."""
CONCURRENT_SWEEP_FLOPS = 2**24
"""``N·M²`` of each part's sweeps from which :func:`concurrent_parts` runs parts side by side (≈ 1.7·10⁷:
a kernel-choice half of 1,700 instances with 100 inducing points). Below it the parts' Python
work dominates and two threads were up to 2× slower than one; from 4,000 instances every default
gained (``docs/BENCHMARKS.md``, "The kernel choice's splits side by side", the gate)."""

Method = TypeVar("Method", bound=Callable[..., Any])
Part = TypeVar("Part")
Result = TypeVar("Result")

_GIVEN_UP: ContextVar[int] = ContextVar("native threads before the small-fit limit", default=1)


def _sweep_flops(n_rows: int, n_inducing: int) -> int:
    """``N·M²`` of a sweep over ``n_rows`` instances, ``M = min(n_inducing, n_rows)`` (a fit on fewer
    rows than ``n_inducing`` makes every row an inducing point)."""
    return n_rows * min(n_inducing, n_rows) ** 2


def native_threads() -> int:
    """The most threads any native pool (BLAS, OpenMP) of this process would run a call on now."""
    return max((pool["num_threads"] for pool in threadpool_info()), default=1)


@contextmanager
def threads_for(n_rows: int, n_inducing: int) -> Iterator[None]:
    """The context a fit of ``n_rows`` instances with ``n_inducing`` inducing points runs in:
    BLAS and OpenMP limited to one thread when ``N·M² < SMALL_SWEEP_FLOPS`` (:func:`_sweep_flops`),
    else unchanged. Under the limit, :func:`concurrent_parts` may use the threads it took (the
    outermost limit's count)."""
    if _sweep_flops(n_rows, n_inducing) >= SMALL_SWEEP_FLOPS:
        yield
        return
    token = _GIVEN_UP.set(max(_GIVEN_UP.get(), native_threads()))
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        _GIVEN_UP.reset(token)


def concurrent_parts(work: Callable[[Part], Result], parts: Iterable[Part], n_rows: int, n_inducing: int) -> list[Result]:
    """``[work(p) for p in parts]``, in order, with as many parts at once as :func:`threads_for`'s
    limit took native threads from this fit (1 outside it: one after another), when each part's
    sweeps over about ``n_rows`` instances with ``n_inducing`` inducing points do
    ``N·M² ≥ CONCURRENT_SWEEP_FLOPS`` (else one after another). Each part runs on one native
    thread, so the results are those of the serial loop; ``work`` must not share mutable state
    between parts."""
    parts = list(parts)
    enough = _sweep_flops(n_rows, n_inducing) >= CONCURRENT_SWEEP_FLOPS
    workers = min(_GIVEN_UP.get(), len(parts)) if enough else 1
    if workers <= 1:
        return [work(part) for part in parts]

    def on_one_thread(part: Part) -> Result:  # OpenMP's limit is per thread: set it in each
        with threadpool_limits(limits=1):
            return work(part)

    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="mil-core-part") as pool:
        return list(pool.map(on_one_thread, parts))


def single_thread_when_small(method: Method) -> Method:
    """Decorate ``method(self, X, …)`` of an estimator with ``n_inducing`` to run under
    :func:`threads_for` for the rows of ``X``."""

    @functools.wraps(method)
    def run(self: Any, X: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            n_rows, n_inducing = len(X), int(self.n_inducing)
        except (TypeError, ValueError):  # invalid input: the method's own validation names it
            return method(self, X, *args, **kwargs)
        with threads_for(n_rows, n_inducing):
            return method(self, X, *args, **kwargs)

    return run  # type: ignore[return-value]
