"""Where and how a fit runs on a cluster: the device (from the workers' ``GPU`` resources) and
whether partitions are kept in worker memory or streamed from Zarr."""

from __future__ import annotations

from typing import Literal

from distributed import Client

from mil_core.models.base import SparseGPMILBase

Device = Literal["auto", "cpu", "gpu"]
Mode = Literal["auto", "persist", "stream"]


def worker_resources(client: Client) -> list[dict[str, float]]:
    return [w.get("resources", {}) for w in client.scheduler_info(n_workers=-1)["workers"].values()]


def resolve_device(client: Client, device: Device) -> str:
    has_gpu = any(r.get("GPU", 0) > 0 for r in worker_resources(client))
    if device == "auto":
        return "gpu" if has_gpu else "cpu"
    if device == "gpu" and not has_gpu:
        raise ValueError("device='gpu' but no worker advertises a GPU resource (start workers with --resources GPU=1, see infra/)")
    return device


def resolve_mode(client: Client, cohort, model: SparseGPMILBase, mode: Mode, memory_fraction: float) -> str:
    if mode != "auto":
        if mode not in ("persist", "stream"):
            raise ValueError(f"mode must be 'auto', 'persist' or 'stream', got {mode!r}")
        return mode
    per_instance = 8 * (model.n_inducing + 4)  # whitened features a'ₙ, FITC residual, local state
    limits = [w.get("memory_limit") or 0 for w in client.scheduler_info(n_workers=-1)["workers"].values()]
    memory = sum(limits) if all(limits) else None
    needed = per_instance * cohort.n_instances
    return "persist" if memory is None or needed <= memory_fraction * memory else "stream"
