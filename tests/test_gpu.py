"""The CuPy path: the same functions on device arrays must give the NumPy result."""

import numpy as np
import pytest

from mil_core import GVGPMIL

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (no GPU on this machine)")
try:
    cupy.cuda.runtime.getDeviceCount()
except Exception as error:  # pragma: no cover - depends on the machine
    pytest.skip(f"no usable CUDA device: {error}", allow_module_level=True)

pytestmark = pytest.mark.gpu


def test_fit_and_predict_on_cupy_arrays_match_numpy(toy_bags):
    X, bags, y, _ = toy_bags
    params = dict(n_inducing=10, max_iter=20, tol=0.0, random_state=0)
    on_cpu = GVGPMIL(**params).fit(X, bags, y)
    on_gpu = GVGPMIL(**params).fit(cupy.asarray(X), bags, y)
    np.testing.assert_allclose(on_gpu.q_.mean, on_cpu.q_.mean, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(on_gpu.elbo_, on_cpu.elbo_, rtol=1e-8)
    _, p_gpu = on_gpu.predict_bag_proba(cupy.asarray(X), bags, method="probit")
    _, p_cpu = on_cpu.predict_bag_proba(X, bags, method="probit")
    assert isinstance(p_gpu, np.ndarray)
    np.testing.assert_allclose(p_gpu, p_cpu, rtol=1e-8)


def test_distributed_fit_on_gpu_workers_matches_cpu_fit(tmp_path, toy_bags):
    from distributed import Client, LocalCluster

    from tasks.training import fit_cohort
    from tests.test_distributed import write_store

    X, bags, y, _ = toy_bags
    X = X.astype(np.float32).astype(np.float64)
    path = write_store(tmp_path / "gpu.zarr", X, bags, y)
    params = dict(n_inducing=10, max_iter=10, tol=0.0, random_state=0)
    on_cpu = GVGPMIL(**params).fit(X, bags, y)
    with LocalCluster(n_workers=1, threads_per_worker=1, resources={"GPU": 1}, dashboard_address=":0") as cluster, Client(cluster) as client:
        model = GVGPMIL(**params)
        summary = fit_cohort(model, path, client, partition_bytes=2_000, resume=False)
    assert summary.device == "gpu"
    np.testing.assert_allclose(model.q_.mean, on_cpu.q_.mean, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(model.elbo_, on_cpu.elbo_, rtol=1e-8)
