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
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, TypeVar

from threadpoolctl import threadpool_limits

__all__ = ["SMALL_SWEEP_FLOPS", "single_thread_when_small", "threads_for"]

SMALL_SWEEP_FLOPS = 2**30
"""``N·M²`` below which a fit runs on one thread (≈ 10⁹: a sweep of ~20 ms on one core)."""

Method = TypeVar("Method", bound=Callable[..., Any])


def threads_for(n_rows: int, n_inducing: int) -> AbstractContextManager:
    """The context a fit of ``n_rows`` instances with ``n_inducing`` inducing points runs in:
    BLAS and OpenMP limited to one thread when ``n_rows · M² < SMALL_SWEEP_FLOPS``, else
    unchanged; ``M = min(n_inducing, n_rows)``, as a fit on fewer rows than ``n_inducing`` makes
    every row an inducing point."""
    if n_rows * min(n_inducing, n_rows) ** 2 < SMALL_SWEEP_FLOPS:
        return threadpool_limits(limits=1)
    return nullcontext()


def single_thread_when_small(method: Method) -> Method:
    """Decorate ``method(self, X, …)`` of an estimator with ``n_inducing`` to run under
    :func:`threads_for` for the rows of ``X``."""

    @functools.wraps(method)
    def run(self: Any, X: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            context = threads_for(len(X), int(self.n_inducing))
        except (TypeError, ValueError):  # invalid input: the method's own validation names it
            context = nullcontext()
        with context:
            return method(self, X, *args, **kwargs)

    return run  # type: ignore[return-value]
