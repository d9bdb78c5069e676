"""Dask clusters from the configuration, the way prefect-dask's ``DaskTaskRunner`` names them: a
cluster class by import path (``distributed.LocalCluster``, ``dask_jobqueue.SLURMCluster``,
``dask_kubernetes.operator.KubeCluster``, ``dask_cuda.LocalCUDACluster``, …), its constructor
keyword arguments, and optional adaptive scaling; or the address of a scheduler that is already
running. The default is a ``LocalCluster`` sized to the machine.

Cluster specifications for Slurm, PBS, Kubernetes and GPU workers live in ``infra/`` (see
``infra/README.md``).
"""

from __future__ import annotations

import importlib
import logging
import os
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import dask.config
import yaml
from distributed import Client, LocalCluster
from distributed.deploy import Cluster

__all__ = ["DEFAULT_CLUSTER_CLASS", "ClusterSettingError", "WorkersDidNotStartError", "import_cluster_class", "start_cluster",
           "worker_start_errors", "WorkerStartErrors", "wait_for_first_worker", "dask_client", "local_cluster_size", "read_dask_config"]

DEFAULT_CLUSTER_CLASS = "distributed.LocalCluster"
log = logging.getLogger("gpmil.cluster")
SINGLE_THREADED_BLAS = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class ClusterSettingError(ValueError):
    """The cluster class refused a value of ``dask.cluster_kwargs`` or ``adapt_kwargs`` (a
    ``memory_limit`` that is no size, ``n_workers: two``): an input error, named with the setting."""


def local_cluster_size() -> tuple[int, int]:
    """``(n_workers, threads_per_worker)`` for this machine: one single-threaded worker process per
    core (the partition step is one BLAS call per block, so processes avoid the GIL and keep
    BLAS from oversubscribing cores)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores), 1


def import_cluster_class(path: str) -> type[Cluster]:
    """The cluster class named by ``module.Class`` (a ``distributed.deploy.Cluster`` subclass)."""
    module_name, _, class_name = path.rpartition(".")
    if not module_name:
        raise ValueError(f"cluster class {path!r}: give its import path, e.g. {DEFAULT_CLUSTER_CLASS!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ValueError(f"cluster class {path!r}: cannot import {module_name} ({error}); install the package that provides it") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Cluster)):
        raise ValueError(f"cluster class {path!r}: {module_name} has no Dask cluster class {class_name!r}")
    return cls


def read_dask_config(path: str | Path) -> dict[str, Any]:
    """A Dask configuration file (e.g. ``infra/slurm.yaml``: the ``jobqueue`` profiles)."""
    config = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{path}: a Dask configuration file holds a mapping, not {type(config).__name__}")
    return config


def dotted(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """A nested Dask configuration as dotted keys (``distributed.worker.resources.GPU``), as
    ``dask.config.set`` takes them without replacing the rest of each section: a file holding
    ``distributed: {worker: …}`` set as a mapping replaced all of ``distributed`` (its comm
    timeouts too: ``KeyError: 'comm'`` when the cluster started)."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, Mapping) and value:
            flat |= dotted(value, f"{prefix}{key}.")
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def check_scheduler_answers(address: str, timeout_s: float) -> None:
    """Raise unless a Dask scheduler answers at ``address`` (``tcp://`` or ``tls://``) within
    ``timeout_s``: a scheduler sends its handshake as soon as it accepts a connection, while a
    dashboard or another server on the port waits for a request, and Dask's client then waited
    for its handshake forever. A ``tls://`` scheduler speaks only after the TLS handshake, made
    with the client certificates of the Dask configuration (``distributed.comm.tls``) as the
    client makes it."""
    import socket
    import ssl
    from urllib.parse import urlsplit

    parts = urlsplit(address if "://" in address else f"tcp://{address}")
    if parts.scheme not in ("tcp", "tls") or parts.hostname is None:
        return
    try:
        with socket.create_connection((parts.hostname, parts.port or 8786), timeout=timeout_s) as plain:
            plain.settimeout(timeout_s)
            with _tls_client(plain, address, parts.hostname) if parts.scheme == "tls" else plain as sock:
                if not sock.recv(1):
                    raise OSError("it closed the connection")
    except TimeoutError:
        raise TimeoutError(f"dask.scheduler_address {address}: something accepts connections there but sent no Dask "
                           f"handshake within {timeout_s:g} s (a dashboard or another server? a scheduler listens on "
                           "8786 unless told otherwise)") from None
    except ssl.SSLError as error:
        raise OSError(f"dask.scheduler_address {address}: no TLS handshake with a Dask scheduler ({error.reason or error}; "
                      "the client's certificates are the Dask configuration's distributed.comm.tls settings, e.g. "
                      "in dask.config_file)") from None
    except OSError as error:
        raise OSError(f"dask.scheduler_address {address}: no Dask scheduler answers ({error})") from None


def _tls_client(sock, address: str, hostname: str):
    """``sock`` wrapped in the TLS context a Dask client connects with (``distributed.security.Security``
    from the Dask configuration), its handshake done."""
    from distributed.security import Security

    context = Security().get_connection_args("client").get("ssl_context")
    if context is None:  # Dask's client refuses tls:// without one too, less clearly
        raise ClusterSettingError(f"dask.scheduler_address {address}: a tls:// scheduler needs the client's certificates in the "
                                  "Dask configuration (distributed.comm.tls.ca-file, client.cert, client.key; e.g. in "
                                  "dask.config_file)")
    return context.wrap_socket(sock, server_hostname=hostname)


@contextmanager
def start_cluster(
    cluster_class: str | None = None,
    cluster_kwargs: Mapping[str, Any] | None = None,
    adapt_kwargs: Mapping[str, Any] | None = None,
    *,
    n_workers: int | None = None,
    dask_config: Mapping[str, Any] | None = None,
) -> Iterator[Cluster]:
    """A cluster for the duration of a ``with`` block, closed afterwards.

    ``cluster_class(**cluster_kwargs)`` under ``dask_config`` (set while the cluster lives, so
    ``SLURMCluster(config_name="slurm-gpu")`` finds its profile); then ``cluster.adapt(**adapt_kwargs)``,
    or ``cluster.scale(n_workers)``. A plain ``LocalCluster`` (the default; not its subclasses such
    as dask-cuda's ``LocalCUDACluster``, which size themselves) gets ``n_workers`` or one
    single-threaded worker process per core, and single-threaded BLAS, unless ``cluster_kwargs``
    say otherwise.
    """
    cls = import_cluster_class(cluster_class or DEFAULT_CLUSTER_CLASS)
    kwargs = dict(cluster_kwargs or {})
    if cls is LocalCluster:
        workers, threads = local_cluster_size()
        defaults = {"n_workers": n_workers or workers, "threads_per_worker": threads, "dashboard_address": ":0"}
        if kwargs.get("processes", True):
            defaults["env"] = SINGLE_THREADED_BLAS
        kwargs = defaults | kwargs
    with dask.config.set(dotted(dask_config or {})):
        _check_adapt_times(adapt_kwargs or {})  # before the cluster: a refused adapt left a half-built Adaptive behind
        try:
            cluster = cls(**kwargs)
        except (TypeError, ValueError, KeyError) as error:  # the library's traceback went through its event loop
            if (key := _quoted_setting(error, cluster_kwargs or {})) is None:
                raise  # not a value of the configuration's (a bug, a dask config file's value): its traceback
            raise ClusterSettingError(f"dask.cluster_kwargs.{key}: {cluster_kwargs[key]!r}: {cls.__name__} did not start: "
                                      f"{str(error).strip(chr(39))}") from error
        except RuntimeError as error:  # "Cluster failed to start: …" around what the settings asked for
            if (failure := _start_failure(cls.__name__, error, cluster_kwargs or {})) is None:
                raise  # no setting of the configuration's is named (a bug, a dask config file's value): its traceback
            raise ClusterSettingError(failure) from error
        try:
            if adapt_kwargs:
                cluster.adapt(**adapt_kwargs)
            elif n_workers and cls is not LocalCluster:
                cluster.scale(n_workers)
            yield cluster
        except BaseException:
            _close_after_error(cluster)
            raise
        cluster.close()


def _close_after_error(cluster: Cluster) -> None:
    """Close a cluster on the way out of an error without hiding it: dask-jobqueue's ``close`` fails
    (``AssertionError: Status.created``) on a job whose submission failed, and that became the run's
    error in place of the submission's."""
    try:
        cluster.close()
    except Exception as error:
        log.warning("closing the %s failed as well: %s: %s", type(cluster).__name__, type(error).__name__, error)


class WorkersDidNotStartError(ClusterSettingError):
    """The cluster could not start a worker (a batch job's submission failed: a wrong partition,
    account or queue, a missing ``sbatch``)."""


@contextmanager
def worker_start_errors() -> Iterator[WorkerStartErrors]:
    """The first error a Dask cluster started inside the ``with`` block logs while it starts workers:
    dask-jobqueue submits jobs from the cluster's event loop, which only logs a failed ``sbatch``."""
    errors = WorkerStartErrors()
    logger = logging.getLogger("tornado.application")  # where that event loop reports it
    logger.addHandler(errors)
    try:
        yield errors
    finally:
        logger.removeHandler(errors)


class WorkerStartErrors(logging.Handler):
    """Keeps the first error logged from a cluster's worker start (``SpecCluster._correct_state``)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.error: BaseException | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.error is None and record.exc_info and "_correct_state" in record.getMessage():
            self.error = record.exc_info[1]


def wait_for_first_worker(client: Client, timeout_s: float, cluster: Cluster | None = None,
                          start_errors: WorkerStartErrors | None = None) -> None:
    """``client.wait_for_workers(1)``, but failing at once, with the cluster's own error, when
    ``cluster`` fails to start its workers (``start_errors``, from :func:`worker_start_errors` around
    its start): the run waited out ``timeout_s`` and then failed on something else."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.wait_for_workers(1, timeout=max(0.01, min(1.0, deadline - time.monotonic())))
            return
        except TimeoutError:
            if start_errors is not None and start_errors.error is not None:
                error = start_errors.error
                raise WorkersDidNotStartError(f"{type(cluster).__name__} could not start a worker: "
                                              f"{type(error).__name__}: {str(error).strip()}") from error
            if time.monotonic() >= deadline:  # the last poll's error would name its own second, not the wait
                raise TimeoutError(f"no Dask worker arrived within {timeout_s:g} s (dask.worker_timeout_s; a batch "
                                   "queue may need longer)") from None


def _start_failure(cluster: str, error: BaseException, settings: Mapping[str, Any]) -> str | None:
    """One line for a cluster that did not start because of a setting of the configuration's: the
    setting an error of the chain names or quotes (an interface ``ib0``, which Dask wraps in
    "Cluster failed to start") and that error; None when none does."""
    chain = [error]
    while (cause := chain[-1].__cause__ or chain[-1].__context__) is not None and cause not in chain and len(chain) < 20:
        chain.append(cause)
    named = next(((key, e) for e in reversed(chain) if (key := _quoted_setting(e, settings)) is not None), None)  # innermost
    if named is None:
        return None
    key, reason = named
    return f"dask.cluster_kwargs.{key}: {settings[key]!r}: {cluster} did not start: {type(reason).__name__}: {reason}"


def _quoted_setting(error: Exception, settings: Mapping[str, Any]) -> str | None:
    """The key of ``settings`` the error names ("unexpected keyword argument 'quue'") or whose text
    value it quotes (dask's "Could not interpret 'lots' as a byte unit"), if any: only then is the
    error the configuration's to name. A named key comes first: dask-jobqueue's message about a
    misspelt key lists every argument, the other keys' values too."""
    text = str(error)
    named = (key for key in settings if f"argument '{key}'" in text or f"argument {key!r}" in text)
    quoted = (key for key, value in settings.items() if isinstance(value, str) and len(value) > 1 and value in text)
    return next(named, None) or next(quoted, None)


def _check_adapt_times(adapt_kwargs: Mapping[str, Any]) -> None:
    """``adapt_kwargs``' durations (``interval``, ``target_duration``) read as ``cluster.adapt`` reads them."""
    from dask.utils import parse_timedelta

    for key in ("interval", "target_duration"):
        if key in adapt_kwargs:
            try:
                parse_timedelta(adapt_kwargs[key])
            except (TypeError, ValueError, KeyError) as error:
                raise ClusterSettingError(f"dask.adapt_kwargs.{key}: {adapt_kwargs[key]!r} is no duration "
                                          f"(e.g. '500ms', '5s', 2): {str(error).strip(chr(39))}") from None


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
    local = {"memory_limit": memory_limit, "processes": processes}
    if threads_per_worker:
        local["threads_per_worker"] = threads_per_worker
    with start_cluster(DEFAULT_CLUSTER_CLASS, local, n_workers=n_workers) as cluster, Client(cluster) as client:
        yield client
