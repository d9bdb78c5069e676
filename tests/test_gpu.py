"""The CUDA path on a real GPU: CuPy arrays in, the host result out.

``tests/test_device.py`` proves these paths everywhere on an emulated device (array-api-strict);
this module runs the same cases on CuPy, where cuBLAS / cuSOLVER sum in another order (so the
tolerances are those of rounding, not of identity), and the Dask executor on GPU worker
*processes*, where every array the client receives must have been sent back as NumPy. Skipped
where CuPy sees no CUDA device (CI).
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from mil_core import GVGPMIL, RBF, VGPMIL, VGPMILPR, VGPMILPRI, VWSGP, AbSMIL, VGPMILPRGibbs

cupy = pytest.importorskip("cupy", reason="CuPy is not installed (no GPU on this machine)")
try:
    cupy.cuda.runtime.getDeviceCount()
except Exception as error:  # pragma: no cover - depends on the machine
    pytest.skip(f"no usable CUDA device: {error}", allow_module_level=True)

from tests.test_device import CASES, GIBBS, GP, M, _fit, assert_attention_networks_match_the_host, car_case  # noqa: E402  (after the skip: needs array-api-strict)

pytestmark = pytest.mark.gpu

RTOL = 1e-6  # a few fixed-point sweeps of float64 rounding in another summation order


@pytest.fixture(scope="module")
def data():
    from tests.conftest import make_toy_bags

    X, bags, y, _ = make_toy_bags(n_bags=30, n_features=5, seed=1)
    X = X.astype(np.float32).astype(np.float64)  # the cohort store keeps float32 features
    coords = (np.arange(X.shape[0]) - np.searchsorted(bags, bags))[:, None]
    return X, bags, y, coords


def device_arrays(obj, path: str = "model", depth: int = 0) -> list[str]:
    """Where a fitted estimator still holds a CuPy array (it must hold host arrays only: it is
    pickled to workers, saved and read by the client)."""
    if isinstance(obj, cupy.ndarray):
        return [path]
    if depth > 3:
        return []
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, list | tuple):
        items = enumerate(obj)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = ((f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj))
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = vars(obj).items()
    else:
        return []
    return [p for key, value in items for p in device_arrays(value, f"{path}.{key}", depth + 1)]


@pytest.mark.parametrize("case", list(CASES))
def test_every_model_fits_and_predicts_on_cupy_as_on_the_host(case, data):
    X, bags, y, coords = data
    cls, params = CASES[case]
    on_host, kwargs = _fit(cls(**params), X, bags, y, coords)
    on_gpu, _ = _fit(cls(**params), cupy.asarray(X), bags, y, coords)
    assert device_arrays(on_gpu) == []
    _, p_gpu = on_gpu.predict_bag_proba(cupy.asarray(X), bags, **kwargs)
    _, p_host = on_host.predict_bag_proba(X, bags, **kwargs)
    assert isinstance(p_gpu, np.ndarray)
    tolerance = 1e-5 if isinstance(on_host, VGPMILPRI) else RTOL  # SciPy's randomised Genz integration
    np.testing.assert_allclose(p_gpu, p_host, rtol=tolerance, atol=1e-9)
    if isinstance(on_host, AbSMIL):
        np.testing.assert_allclose(on_gpu.weights_, on_host.weights_, rtol=RTOL, atol=1e-9)
        return
    np.testing.assert_allclose(on_gpu.q_.mean, on_host.q_.mean, rtol=RTOL, atol=1e-8)
    np.testing.assert_allclose(on_gpu.elbo_, on_host.elbo_, rtol=RTOL)
    if "learn_kernel" in case:
        np.testing.assert_allclose(on_gpu.kernel_.length_scale, on_host.kernel_.length_scale, rtol=RTOL)
    if "learn_lam" in case:
        assert on_gpu.lam_ == pytest.approx(on_host.lam_, rel=RTOL)


def test_instance_predictions_on_cupy(data):
    X, bags, y, _ = data
    model = VGPMIL(**GP).fit(X, bags, y)
    p, sd = model.predict_instance_proba(cupy.asarray(X), return_std=True)
    p_host, sd_host = model.predict_instance_proba(X, return_std=True)
    assert isinstance(p, np.ndarray) and isinstance(sd, np.ndarray)
    np.testing.assert_allclose(p, p_host, rtol=1e-10)
    np.testing.assert_allclose(sd, sd_host, rtol=1e-8)


def test_gibbs_reference_on_cupy(data):
    X, bags, y, coords = data
    on_host = VGPMILPRGibbs(**GIBBS).fit(X, bags, y, coords=coords)
    on_gpu = VGPMILPRGibbs(**GIBBS).fit(cupy.asarray(X), bags, y, coords=coords)
    assert device_arrays(on_gpu) == []
    np.testing.assert_allclose(on_gpu.v_samples_, on_host.v_samples_, rtol=1e-6, atol=1e-8)


def test_car_solve_on_cupy_matches_the_sparse_lu(data):
    _, bags, _, coords = data
    coupling, rhs = car_case(bags, coords)
    on_gpu = coupling.solve(cupy.asarray(rhs))
    assert isinstance(on_gpu, cupy.ndarray)
    np.testing.assert_allclose(on_gpu.get(), coupling.solve(rhs), rtol=1e-10, atol=1e-12)


def test_the_kernel_choice_runs_on_cupy_and_chooses_as_on_the_host(data):
    from mil_core.bags import BagIndex

    X, bags, y, _ = data
    index = BagIndex.from_ids(bags)
    X_sorted, labels = X[index.order], y[index.order][index.offsets[:-1]].astype(int)
    host, device = VGPMIL(random_state=0, max_iter=10), VGPMIL(random_state=0, max_iter=10)
    kernel = host._select_kernel(X_sorted, index.offsets, labels, None)
    assert device._select_kernel(cupy.asarray(X_sorted), index.offsets, labels, None) == kernel
    assert (device.auto_max_iter_, device.bag_rule_) == (host.auto_max_iter_, host.bag_rule_)
    np.testing.assert_allclose(device.kernel_selection_, host.kernel_selection_, rtol=RTOL)


def test_a_nan_in_cupy_features_is_named_by_row_column_and_bag(data):
    from mil_core.validation import check_mil_data

    X, bags, y, _ = data
    bad = X.copy()
    bad[7, 2] = np.nan
    with pytest.raises(ValueError, match=rf"X contains NaN at row 7, column 2, bag {bags[7].item()} \(1 row"):
        check_mil_data(cupy.asarray(bad), bags, y)
    assert check_mil_data(cupy.asarray(X), bags, y)[0].shape == X.shape


def test_the_attention_networks_take_cupy_features(data):
    pytest.importorskip("torch")
    X, bags, y, _ = data
    for model in assert_attention_networks_match_the_host(cupy.asarray, X, bags, y):
        assert device_arrays(model) == [], type(model).__name__


# --------------------------------------------------------- the Dask executor on GPU worker processes
@pytest.fixture(scope="module")
def gpu_client():
    """One worker *process* advertising the GPU: partitions live there as CuPy arrays and only what
    the executor sends back (NumPy) reaches this process."""
    from distributed import Client, LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, resources={"GPU": 1},
                      dashboard_address=":0") as cluster, Client(cluster) as client:
        yield client


DISTRIBUTED = {
    "VGPMIL": (VGPMIL, {**GP, "max_iter": 5, "early_stopping": True, "n_iter_no_change": 3}),
    "GVGPMIL": (GVGPMIL, {**GP, "max_iter": 5}),
    "VWSGP": (VWSGP, GP),
    "VGPMILPR": (VGPMILPR, GP),
    "VGPMILPRI": (VGPMILPRI, {**GP, "lam": 0.7, "kernel": RBF(variance=4.0)}),  # no kernel choice with coords
    "VGPMIL-standardised": (VGPMIL, {**GP, "standardize": True}),  # fit_cohort's scaling, applied on read by predict_cohort
}


@pytest.mark.parametrize("mode", ["persist", "stream"])
@pytest.mark.parametrize("case", list(DISTRIBUTED))
def test_fit_and_predict_cohort_on_a_gpu_worker_equal_the_host_fit(tmp_path, data, gpu_client, case, mode):
    from tasks.training import fit_cohort, predict_cohort, read_predictions
    from tests.test_distributed import write_store

    X, bags, y, coords = data
    cls, params = DISTRIBUTED[case]
    path = write_store(tmp_path / "gpu.zarr", X, bags, y)
    kwargs = {"coords": coords} if cls is VGPMILPRI else {}
    serial = cls(**params).fit(X, bags, y, **kwargs)
    model = cls(**params)
    summary = fit_cohort(model, path, gpu_client, partition_bytes=1_500, mode=mode, device="gpu", resume=False)
    assert summary.device == "gpu" and summary.n_partitions > 2
    assert device_arrays(model) == []
    np.testing.assert_allclose(model.q_.mean, serial.q_.mean, rtol=RTOL, atol=1e-8)
    np.testing.assert_allclose(model.elbo_, serial.elbo_, rtol=RTOL)
    if cls is VGPMILPRI:
        return  # its bag probabilities come from the randomised orthant integral: test_every_model compares them
    predict_cohort(model, path, gpu_client, run="gpu", partition_bytes=1_500, device="gpu")
    _, p_bag = serial.predict_bag_proba(X, bags)
    np.testing.assert_allclose(read_predictions(path, "gpu")["bags/proba"], p_bag, rtol=RTOL, atol=1e-9)


def test_the_gibbs_chain_on_a_gpu_worker_is_the_host_chain(tmp_path, data, gpu_client):
    from tasks.training import fit_cohort
    from tests.test_distributed import write_store

    X, bags, y, _ = data
    path = write_store(tmp_path / "gibbs.zarr", X, bags, y)
    params = dict(n_inducing=M, kernel=RBF(4.0), n_samples=8, burn_in=2, thin=1, random_state=0, standardize=False)
    serial = VGPMILPRGibbs(**params).fit(X, bags, y)
    model = VGPMILPRGibbs(**params)
    summary = fit_cohort(model, path, gpu_client, partition_bytes=1_500, mode="persist", device="gpu", resume=False)
    assert summary.device == "gpu"
    np.testing.assert_allclose(model.v_samples_, serial.v_samples_, rtol=1e-6, atol=1e-8)


def test_float32_on_a_gpu_worker_stays_close_to_float64(tmp_path, data, gpu_client):
    from tasks.training import fit_cohort
    from tests.test_distributed import write_store

    X, bags, y, _ = data
    path = write_store(tmp_path / "f32.zarr", X, bags, y)
    serial = VGPMIL(**GP).fit(X, bags, y)
    model = VGPMIL(**GP)
    fit_cohort(model, path, gpu_client, partition_bytes=1_500, mode="persist", device="gpu", compute_dtype="float32",
               resume=False)
    assert np.abs(model.q_.mean - serial.q_.mean).max() < 1e-4 * np.abs(serial.q_.mean).max()
    np.testing.assert_allclose(model.elbo_, serial.elbo_, rtol=1e-5)


def test_device_memory_is_read_from_the_gpu_worker(tmp_path, data, gpu_client):
    from tasks.store import open_cohort
    from tasks.training.placement import ArrayPlacement, resolve_mode
    from tests.test_distributed import write_store

    X, bags, y, _ = data
    cohort = open_cohort(write_store(tmp_path / "mem.zarr", X, bags, y))
    needed = 8 * (M + 4) * X.shape[0]  # the prepared partitions' bytes, as resolve_mode counts them
    fraction = 2 * needed / cupy.cuda.runtime.memGetInfo()[1]  # half of it would not hold them
    assert resolve_mode(gpu_client, cohort, VGPMIL(**GP), "auto", fraction, ArrayPlacement.gpu()) == "persist"
    assert resolve_mode(gpu_client, cohort, VGPMIL(**GP), "auto", fraction / 4, ArrayPlacement.gpu()) == "stream"


def test_the_documented_local_cuda_cluster_trains_the_default_model_on_its_gpu(tmp_path, data):
    """infra/README.md's one-node recipe, as the pipeline starts it from the config's ``dask``
    section: ``cluster_class: dask_cuda.LocalCUDACluster``, ``cluster_kwargs: {resources: {GPU: 1}}``,
    ``training.device: auto``."""
    pytest.importorskip("dask_cuda", reason="dask-cuda (the gpu extra) is not installed")
    from distributed import Client

    from tasks.cluster import start_cluster
    from tasks.training import fit_cohort, predict_cohort, read_predictions
    from tests.test_distributed import write_store

    X, bags, y, _ = data
    path = write_store(tmp_path / "cuda-cluster.zarr", X, bags, y)
    serial = VGPMILPR(**GP).fit(X, bags, y)
    model = VGPMILPR(**GP)
    with start_cluster("dask_cuda.LocalCUDACluster", {"resources": {"GPU": 1}}) as cluster, Client(cluster) as client:
        assert len(client.scheduler_info()["workers"]) == cupy.cuda.runtime.getDeviceCount()
        summary = fit_cohort(model, path, client, partition_bytes=1_500, resume=False)
        predict_cohort(model, path, client, run="cuda-cluster", partition_bytes=1_500)
    assert summary.device == "gpu" and summary.n_partitions > 2
    assert device_arrays(model) == []
    np.testing.assert_allclose(model.q_.mean, serial.q_.mean, rtol=RTOL, atol=1e-8)
    _, p_bag = serial.predict_bag_proba(X, bags)
    np.testing.assert_allclose(read_predictions(path, "cuda-cluster")["bags/proba"], p_bag, rtol=RTOL, atol=1e-9)


def test_the_gpu_workers_script_joins_a_scheduler_and_the_fit_runs_on_its_gpu(tmp_path, data):
    """infra/gpu-workers.sh (``dask cuda worker … --resources GPU=1``) against a running scheduler,
    as on a GPU node of a shared cluster."""
    pytest.importorskip("dask_cuda", reason="dask-cuda (the gpu extra) is not installed")
    if shutil.which("dask") is None:
        pytest.skip("the dask command is not on PATH")
    from distributed import Client, LocalCluster

    from tasks.training import fit_cohort
    from tests.test_distributed import write_store

    X, bags, y, _ = data
    path = write_store(tmp_path / "gpu-node.zarr", X, bags, y)
    serial = VGPMIL(**GP).fit(X, bags, y)
    model = VGPMIL(**GP)
    script = Path(__file__).resolve().parents[1] / "infra" / "gpu-workers.sh"
    with LocalCluster(n_workers=0, dashboard_address=":0") as scheduler, Client(scheduler) as client:
        worker = subprocess.Popen(["bash", str(script), scheduler.scheduler_address])
        try:
            client.wait_for_workers(cupy.cuda.runtime.getDeviceCount(), timeout=120)
            summary = fit_cohort(model, path, client, partition_bytes=1_500, resume=False)
        finally:
            worker.terminate()
            worker.wait(timeout=60)
    assert summary.device == "gpu"
    np.testing.assert_allclose(model.q_.mean, serial.q_.mean, rtol=RTOL, atol=1e-8)
