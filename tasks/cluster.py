"""Dask clients: connect to an existing scheduler, or start a ``LocalCluster`` sized to the machine.

Cluster specifications for Slurm, Kubernetes and GPU workers live in ``infra/`` (see
``infra/README.md``); they all end in a scheduler address that :func:`dask_client` connects to.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from distributed import Client, LocalCluster

__all__ = ["dask_client", "local_cluster_size"]


def local_cluster_size() -> tuple[int, int]:
    """``(n_workers, threads_per_worker)`` for this machine: one single-threaded worker process per
    core (the partition step is one BLAS call per block, so processes avoid the GIL and keep
    BLAS from oversubscribing cores)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores), 1


@contextmanager
def dask_client(
    scheduler_address: str | None = None,
    *,
    n_workers: int | None = None,
    threads_per_worker: int | None = None,
    memory_limit: str | int = "auto",
    processes: bool = True,
) -> Iterator[Client]:
    """A Dask client for the duration of a ``with`` block.

    With ``scheduler_address`` it connects to that cluster and leaves it running afterwards;
    otherwise it starts a ``LocalCluster`` (``local_cluster_size()`` unless given) and closes it.
    """
    if scheduler_address:
        with Client(scheduler_address) as client:
            yield client
        return
    default_workers, default_threads = local_cluster_size()
    single_threaded_blas = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cluster = LocalCluster(
        n_workers=n_workers or default_workers,
        threads_per_worker=threads_per_worker or default_threads,
        memory_limit=memory_limit,
        processes=processes,
        dashboard_address=":0",
        **({"env": single_threaded_blas} if processes else {}),
    )
    try:
        with Client(cluster) as client:
            yield client
    finally:
        cluster.close()
