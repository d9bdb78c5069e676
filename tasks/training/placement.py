"""Where and how a fit runs on a cluster: the device (from the workers' ``GPU`` resources), the
array namespace that holds device arrays, and whether partitions are kept in worker (or GPU)
memory or streamed from Zarr."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
from distributed import Client

from mil_core.models.base import SparseGPMILBase

Device = Literal["auto", "cpu", "gpu"]
Mode = Literal["auto", "persist", "stream"]
log = logging.getLogger("gpmil.training")


@dataclass(frozen=True)
class ArrayPlacement:
    """Where the partition arrays of a fit or a prediction live.

    ``kind="cpu"``: host NumPy. ``kind="gpu"``: an array-API namespace on an accelerator, named
    ``"module"`` or ``"module:device"`` — ``"cupy"`` (the default: the worker's current CUDA device,
    one GPU per worker as dask-cuda starts them) or, in CI, ``"array_api_strict:device1"`` (an
    emulated device). Tasks that hold device arrays ask the scheduler for ``resources``.
    ``dtype="float32"`` places float32 features, so the whitened features A' are float32 (half
    the memory, float32 GEMMs) while every statistic is accumulated in float64
    (:func:`mil_core.engine.transposed_product`); the error against float64 is measured in
    ``tests/test_device.py`` and ``docs/BENCHMARKS.md``.
    """

    kind: Literal["cpu", "gpu"] = "cpu"
    namespace: str = "cupy"
    dtype: Literal["float64", "float32"] = "float64"

    def __post_init__(self):
        if self.kind not in ("cpu", "gpu"):
            raise ValueError(f"device must be 'cpu' or 'gpu', got {self.kind!r}")
        if self.dtype not in ("float64", "float32"):
            raise ValueError(f"compute_dtype must be 'float64' or 'float32', got {self.dtype!r}")

    @classmethod
    def gpu(cls, namespace: str = "cupy", dtype: Literal["float64", "float32"] = "float64") -> ArrayPlacement:
        return cls(kind="gpu", namespace=namespace, dtype=dtype)

    @property
    def resources(self) -> dict[str, float] | None:
        """The Dask resource a task holding device arrays needs (``GPU``, one per worker's GPU)."""
        return {"GPU": 1} if self.kind == "gpu" else None

    def to_device(self, X: np.ndarray) -> Any:
        """Host rows → this placement in its dtype (a copy on the device for ``kind="gpu"``)."""
        X = np.asarray(X, dtype=self.dtype)
        if self.kind == "cpu":
            return X
        module_name, _, device_name = self.namespace.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(f"GPU array namespace {self.namespace!r}: cannot import {module_name} ({error}); "
                             "install the gpu extra (CuPy) on the GPU workers") from None
        if not device_name:
            return module.asarray(X)
        devices = module.__array_namespace_info__().devices()
        chosen = [d for d in devices if device_name in (str(d), repr(d), f"{module_name}.Device({device_name!r})")
                  or str(d).endswith(f"({device_name!r})")]
        if not chosen:
            raise ValueError(f"GPU array namespace {self.namespace!r}: {module_name} has no device {device_name!r} "
                             f"(it has {[str(d) for d in devices]})")
        return module.asarray(X, device=chosen[0])


def worker_resources(client: Client) -> list[dict[str, float]]:
    return [w.get("resources", {}) for w in client.scheduler_info(n_workers=-1)["workers"].values()]


def resolve_placement(client: Client, device: Device, gpu_namespace: str = "cupy",
                      compute_dtype: Literal["float64", "float32"] = "float64") -> ArrayPlacement:
    """``device="auto"``: the GPU when some worker advertises a ``GPU`` resource, else the CPU."""
    if device not in ("auto", "cpu", "gpu"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'gpu', got {device!r}")
    has_gpu = any(r.get("GPU", 0) > 0 for r in worker_resources(client))
    if device == "auto":
        device = "gpu" if has_gpu else "cpu"
    if device == "gpu" and not has_gpu:
        raise ValueError("device='gpu' but no worker advertises a GPU resource (start workers with --resources GPU=1, "
                         "also under dask_cuda.LocalCUDACluster, as cluster_kwargs resources: {GPU: 1}; see infra/README.md)")
    return ArrayPlacement(kind=device, namespace=gpu_namespace, dtype=compute_dtype)


def resolve_mode(client: Client, cohort, model: SparseGPMILBase, mode: Mode, memory_fraction: float,
                 placement: ArrayPlacement | None = None, device_memory: int | None = None) -> str:
    """``mode="auto"``: persist when the prepared partitions take at most ``memory_fraction`` of the
    memory that holds them — the GPU workers' device memory for a GPU placement (``device_memory``
    bytes per GPU, else asked of CuPy on the workers), the workers' memory limits on the CPU —
    else stream from Zarr."""
    if mode != "auto":
        if mode not in ("persist", "stream"):
            raise ValueError(f"mode must be 'auto', 'persist' or 'stream', got {mode!r}")
        return mode
    width = getattr(model, "n_inducing", None) or cohort.n_features  # a'ₙ of the GP models, AbSMIL's features
    per_instance = (4 if placement is not None and placement.dtype == "float32" else 8) * width + 32  # + FITC residual, local state
    needed = per_instance * cohort.n_instances
    workers = client.scheduler_info(n_workers=-1)["workers"]
    if placement is not None and placement.kind == "gpu":
        gpus = {address: w.get("resources", {}).get("GPU", 0) for address, w in workers.items()}
        gpus = {address: n for address, n in gpus.items() if n > 0}
        if device_memory is None:
            reported = client.run(_device_memory, placement.namespace, workers=list(gpus))
            if all(reported.values()):
                return "persist" if needed <= memory_fraction * sum(reported.values()) else "stream"
            log.warning("device memory of %s unknown on the GPU workers; persist/stream decided from host memory "
                        "(pass device_memory= / training.device_memory_gib)", placement.namespace)
        else:
            return "persist" if needed <= memory_fraction * device_memory * sum(gpus.values()) else "stream"
    limits = [w.get("memory_limit") or 0 for w in workers.values()]
    memory = sum(limits) if all(limits) else None
    return "persist" if memory is None or needed <= memory_fraction * memory else "stream"


def _device_memory(namespace: str) -> int | None:
    """Total memory of this worker's device in bytes, where the namespace can tell (CuPy)."""
    if namespace.partition(":")[0] != "cupy":
        return None
    import cupy

    return int(cupy.cuda.runtime.memGetInfo()[1])
