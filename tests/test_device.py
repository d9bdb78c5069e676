"""The accelerator path, proven without an accelerator.

Every model runs on an emulated device (``tests/emulated_device.py``: array-api-strict on its
``device1``, where conversion to NumPy raises, as for CuPy) through the real code path, and must
give the host result. Every device → host copy is counted: only the documented ones may happen —
scalars, M × M and M statistics, N-vectors of per-instance moments (a block's rows at most), the
D / M × D kernel-gradient pieces of ``learn_kernel``, and AbSMIL's (n, C + 1) logits and
(F, C + 1) gradient. The features X (N × D) leave the device once per fit, for the k-means
initialisation of the inducing points and the automatic kernel choice (``kernel=None``), both
host-only (the distributed fit samples them from the store instead); the whitened features
A' (N × M) never do.
"""

from __future__ import annotations

import numpy as np
import pytest
from distributed import Client, LocalCluster
from distributed.diagnostics.plugin import SchedulerPlugin

from mil_core import GVGPMIL, RBF, VGPMIL, VGPMILPR, VGPMILPRI, VWSGP, AbSMIL, VGPMILPRGibbs
from tests.conftest import make_toy_bags
from tests.emulated_device import NAMESPACE, count_transfers, to_emulated, xp

M = 8
N_BAGS = 30


@pytest.fixture(scope="module")
def data():
    X, bags, y, _ = make_toy_bags(n_bags=N_BAGS, n_features=5, seed=1)
    coords = (np.arange(X.shape[0]) - np.searchsorted(bags, bags))[:, None]  # a chain of slices per bag
    return X, bags, y, coords


def _allowed(model, X) -> set[tuple[int, ...]]:
    D = X.shape[1]
    shapes = {(M, M), (M,), (D,), (M, D), (1,)}
    if isinstance(model, AbSMIL):
        shapes |= {(D + 1, model.n_attributes + 1)}
    if isinstance(model, VWSGP):  # its data are per-bag sums ā'_b: (bags of a block) × M
        shapes |= {(b, M) for b in range(1, N_BAGS + 1)}
    return shapes


def _assert_only_documented(log, model, X, n_max: int, kmeans_copies: int = 1):
    features = [s for s in log.shapes if len(s) == 2 and s[1] == X.shape[1] and s[0] > M]
    assert len(features) <= kmeans_copies, f"features copied to the host {len(features)} times: {features}"
    offending = [s for s in log.offending(_allowed(model, X), n_max) if s not in features]
    if isinstance(model, AbSMIL):  # per-instance attribute logits (n, C + 1): N-vectors of moments
        offending = [s for s in offending if not (len(s) == 2 and s[0] <= n_max and s[1] == model.n_attributes + 1)]
    assert not offending, f"undocumented device→host transfers: {sorted(set(offending))}"
    assert not [s for s in log.shapes if len(s) == 2 and s[1] == M and s[0] > max(M, N_BAGS)], "A' (N × M) left the device"


GP = dict(n_inducing=M, max_iter=4, tol=0.0, random_state=0, standardize=False)  # the features as given (test_standardize covers the scaling)
CASES = {
    "VGPMIL": (VGPMIL, GP),
    "GVGPMIL": (GVGPMIL, GP),
    "VGPMIL-early-stopping": (VGPMIL, {**GP, "max_iter": 6, "early_stopping": True, "n_iter_no_change": 2}),
    "VGPMIL-learn_kernel": (VGPMIL, {**GP, "max_iter": 2, "learn_kernel": True, "hyper_steps": 2}),
    "GVGPMIL-learn_kernel-inducing": (GVGPMIL, {**GP, "max_iter": 2, "learn_kernel": True, "learn_inducing": True, "hyper_steps": 2}),
    "VGPMIL-learn_kernel-ard": (VGPMIL, {**GP, "max_iter": 2, "kernel": RBF(1.0, "ard"), "learn_kernel": True, "hyper_steps": 2}),
    "VWSGP": (VWSGP, GP),
    "VGPMILPR": (VGPMILPR, GP),
    "VGPMILPRI": (VGPMILPRI, {**GP, "lam": 0.7}),
    "VGPMILPRI-learn_lam": (VGPMILPRI, {**GP, "max_iter": 2, "lam": 0.7, "learn_lam": True, "hyper_steps": 2}),
    "AbSMIL": (AbSMIL, dict(max_iter=5, random_state=0, n_init=1)),
}


def _fit(model, X, bags, y, coords):
    kwargs = {"coords": coords} if isinstance(model, VGPMILPRI | VGPMILPRGibbs) else {}
    return model.fit(X, bags, y, **kwargs), kwargs


@pytest.mark.parametrize("case", list(CASES))
def test_every_model_fits_and_predicts_on_the_device_as_on_the_host(case, data, monkeypatch):
    X, bags, y, coords = data
    cls, params = CASES[case]
    on_host, kwargs = _fit(cls(**params), X, bags, y, coords)
    with count_transfers(monkeypatch) as log:
        on_device, _ = _fit(cls(**params), to_emulated(X), bags, y, coords)
        assert log.shapes, "the fit made no device→host transfer at all: the device path did not run"
        _assert_only_documented(log, on_device, X, n_max=X.shape[0], kmeans_copies=0 if isinstance(on_device, AbSMIL) else 1)
        log.clear()
        _, p_device = on_device.predict_bag_proba(to_emulated(X), bags, **kwargs)
        _assert_only_documented(log, on_device, X, n_max=X.shape[0], kmeans_copies=0)
    _, p_host = on_host.predict_bag_proba(X, bags, **kwargs)
    assert isinstance(p_device, np.ndarray)
    # VGPMIL-PR-I's exact orthant probabilities come from SciPy's randomised Genz integration
    # (two host calls differ by ~1e-6), so its bag probabilities agree only to that.
    tolerance = 1e-5 if isinstance(on_host, VGPMILPRI) else 1e-7
    np.testing.assert_allclose(p_device, p_host, rtol=tolerance, atol=1e-9)
    if isinstance(on_host, AbSMIL):
        np.testing.assert_allclose(on_device.weights_, on_host.weights_, rtol=1e-7, atol=1e-9)
    else:
        np.testing.assert_allclose(on_device.q_.mean, on_host.q_.mean, rtol=1e-7, atol=1e-9)
        np.testing.assert_allclose(on_device.elbo_, on_host.elbo_, rtol=1e-8)
    if "early" in case:
        np.testing.assert_allclose(on_device.validation_auc_, on_host.validation_auc_, rtol=1e-12)
    if "learn_kernel" in case:
        np.testing.assert_allclose(on_device.kernel_.length_scale, on_host.kernel_.length_scale, rtol=1e-7)
    if "learn_lam" in case:
        assert on_device.lam_ == pytest.approx(on_host.lam_, rel=1e-7)


def test_instance_predictions_on_the_device(data, monkeypatch):
    X, bags, y, _ = data
    model = VGPMIL(**GP).fit(X, bags, y)
    with count_transfers(monkeypatch) as log:
        p, sd = model.predict_instance_proba(to_emulated(X), return_std=True)
    np.testing.assert_allclose(p, model.predict_instance_proba(X), rtol=1e-10)
    assert sorted(set(log.shapes)) <= [(), (X.shape[0],)]


GIBBS = dict(n_inducing=M, lam=0.5, kernel=RBF(4.0), n_samples=20, burn_in=5, thin=1, random_state=0)  # the kernel choice is host-side


def car_case(bags, coords):
    """The CAR coupling (λ = 3) of the data's chains of slices and a right-hand side of 5 columns."""
    from mil_core.ising import CARCoupling

    offsets = np.concatenate([[0], np.cumsum(np.bincount(bags))])
    return CARCoupling.from_coords(coords, offsets, lam=3.0), np.random.default_rng(0).standard_normal((bags.size, 5))


def test_gibbs_reference_on_the_device(data, monkeypatch):
    X, bags, y, coords = data
    on_host = VGPMILPRGibbs(**GIBBS).fit(X, bags, y, coords=coords)
    with count_transfers(monkeypatch) as log:
        on_device = VGPMILPRGibbs(**GIBBS).fit(to_emulated(X), bags, y, coords=coords)
    _assert_only_documented(log, on_device, X, n_max=X.shape[0])
    np.testing.assert_allclose(on_device.v_samples_, on_host.v_samples_, rtol=1e-6, atol=1e-8)


def test_car_solve_on_the_device_matches_the_sparse_lu(data):
    _, bags, _, coords = data
    coupling, rhs = car_case(bags, coords)
    np.testing.assert_allclose(np.from_dlpack(coupling.solve(to_emulated(rhs)), device="cpu"), coupling.solve(rhs), rtol=1e-10, atol=1e-12)



def assert_attention_networks_match_the_host(to_device, X, bags, y) -> list:
    """ABMIL and EmbeddedGPMIL train their networks in PyTorch on the host: features on a device
    (``to_device(X)``) are copied there at the boundary and give the host fit. Returns the fits."""
    from mil_core import ABMIL, EmbeddedGPMIL

    network = dict(hidden=(8,), n_components=4, max_epochs=3, random_state=0)
    fits = []
    for cls, params in ((ABMIL, network), (EmbeddedGPMIL, {**network, "gp": VGPMIL(**GP, kernel=RBF(4.0)), "n_networks": 2}),
                        (EmbeddedGPMIL, {**network, "gp": VGPMIL(**GP), "n_networks": 2})):  # kernel choice: the GPs on X kept
        on_host = cls(**params).fit(X, bags, y)
        on_device = cls(**params).fit(to_device(X), bags, y)
        if "gp" in params:
            assert on_device.representation_ == on_host.representation_ == ("embedding" if params["gp"].kernel else "features")
        _, p_device = on_device.predict_bag_proba(to_device(X), bags)
        np.testing.assert_allclose(p_device, on_host.predict_bag_proba(X, bags)[1], rtol=1e-7, err_msg=cls.__name__)
        np.testing.assert_allclose(on_device.predict_instance_proba(to_device(X)), on_host.predict_instance_proba(X),
                                   rtol=1e-7, err_msg=cls.__name__)
        fits.append(on_device)
    return fits


def test_the_kernel_choice_runs_on_device_arrays_and_chooses_as_on_the_host(data):
    """``_select_kernel`` on device rows (the relevance weights are ranked on one host copy per
    split): the same kernel, sweeps and bag rule as on the host, each candidate's score to rounding."""
    from mil_core.bags import BagIndex

    X, bags, y, _ = data
    index = BagIndex.from_ids(bags)
    X_sorted, labels = X[index.order], y[index.order][index.offsets[:-1]].astype(int)
    host, device = VGPMIL(random_state=0, max_iter=10), VGPMIL(random_state=0, max_iter=10)  # 10 sweeps a candidate: CI time
    kernel = host._select_kernel(X_sorted, index.offsets, labels, None)
    assert device._select_kernel(to_emulated(X_sorted), index.offsets, labels, None) == kernel
    assert (device.auto_max_iter_, getattr(device, "bag_rule_", None)) == (host.auto_max_iter_, getattr(host, "bag_rule_", None))
    np.testing.assert_allclose(device.kernel_selection_, host.kernel_selection_, rtol=1e-9)


def test_device_features_are_checked_on_the_device_and_a_nan_is_named_by_row_column_and_bag(data, monkeypatch):
    from mil_core.validation import check_features, check_mil_data

    X, bags, y, _ = data
    with count_transfers(monkeypatch) as log:
        check_mil_data(to_emulated(X), bags, y)
    assert log.shapes == [()]  # all finite: one scalar comes back
    bad = X.copy()
    bad[7, 2] = np.inf
    with pytest.raises(ValueError, match=rf"X contains infinity at row 7, column 2, bag {bags[7].item()} \(1 row"):
        check_mil_data(to_emulated(bad), bags, y)
    with pytest.raises(ValueError, match="X has 3 features, but the model was fitted with 4"):
        check_features(to_emulated(bad[:, :3]), n_features=4)


def test_the_attention_networks_take_device_features(data):
    pytest.importorskip("torch")
    X, bags, y, _ = data
    assert_attention_networks_match_the_host(to_emulated, X, bags, y)

# ------------------------------------------------------------------ the Dask executor on GPU workers
class ResourceLog(SchedulerPlugin):
    """Records the resource restrictions of every task the scheduler starts, by key family."""

    def __init__(self):
        self.restrictions: dict[str, set] = {}

    def transition(self, key, start, finish, *args, **kwargs):
        if finish == "processing":
            family = "-".join(p for p in str(key).split("-") if not any(c.isdigit() for c in p)) or str(key)
            ts = self.scheduler.tasks[key]
            self.restrictions.setdefault(family, set()).add(tuple(sorted((ts.resource_restrictions or {}).items())))


# the task families that hold device arrays: each must ask for the GPU
DEVICE_TASKS = {"load-partition", "init-local", "partition-step", "validation-block", "bag_scores", "predict-partition"}


@pytest.fixture(scope="module")
def gpu_client():
    """An in-process cluster whose worker advertises a GPU (the emulated device lives in this process)."""
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, resources={"GPU": 1}, dashboard_address=":0") as cluster, \
            Client(cluster) as client:
        plugin = ResourceLog()
        plugin.scheduler = cluster.scheduler
        cluster.scheduler.add_plugin(plugin)
        yield client, plugin


@pytest.mark.parametrize("standardize", [False, True])  # True: fit_cohort's scaling, applied on read by predict_cohort
@pytest.mark.parametrize("mode", ["persist", "stream"])
def test_the_dask_executor_on_gpu_workers_equals_the_host_fit(tmp_path, data, gpu_client, mode, standardize, monkeypatch):
    from tasks.training import fit_cohort, predict_cohort, read_predictions
    from tests.test_distributed import assert_same_fit, write_store

    client, resources = gpu_client
    X, bags, y, _ = data
    X = X.astype(np.float32).astype(np.float64)  # the store keeps float32 features
    path = write_store(tmp_path / "gpu.zarr", X, bags, y)
    params = {**GP, "max_iter": 5, "early_stopping": True, "n_iter_no_change": 3, "standardize": standardize}
    serial = VGPMIL(**params).fit(X, bags, y)
    model = VGPMIL(**params)
    with count_transfers(monkeypatch) as log:
        summary = fit_cohort(model, path, client, partition_bytes=1_500, mode=mode, gpu_namespace=NAMESPACE, resume=False)
        predict_cohort(model, path, client, run="gpu", partition_bytes=1_500, gpu_namespace=NAMESPACE,
                       instance_kwargs={"method": "probit"}, bag_kwargs={"method": "probit"})
    assert summary.device == "gpu" and summary.n_partitions > 2
    assert_same_fit(model, serial)
    np.testing.assert_allclose(model.validation_auc_, serial.validation_auc_, rtol=1e-12)
    _assert_only_documented(log, model, X, n_max=X.shape[0], kmeans_copies=0)
    _, p_bag = serial.predict_bag_proba(X, bags, method="probit")
    np.testing.assert_allclose(read_predictions(path, "gpu")["bags/proba"], p_bag, rtol=1e-8)
    seen = {family: r for family, r in resources.restrictions.items() if family in DEVICE_TASKS}
    assert set(seen) >= DEVICE_TASKS - ({"load-partition"} if mode == "stream" else set())
    assert all(r == {(("GPU", 1),)} for r in seen.values()), seen


def test_vgpmil_pri_on_gpu_workers_solves_the_car_system_on_the_device(tmp_path, data, gpu_client, monkeypatch):
    from tasks.training import fit_cohort
    from tests.test_distributed import assert_same_fit, write_store

    client, _ = gpu_client
    X, bags, y, _ = data
    X = X.astype(np.float32).astype(np.float64)
    path = write_store(tmp_path / "pri.zarr", X, bags, y)  # coords: the instance index within its bag
    coords = (np.arange(X.shape[0]) - np.searchsorted(bags, bags))[:, None]
    params = {**GP, "lam": 0.7, "kernel": RBF(variance=4.0)}  # fit_cohort chooses no kernel for models reading coords
    serial = VGPMILPRI(**params).fit(X, bags, y, coords=coords)
    model = VGPMILPRI(**params)
    with count_transfers(monkeypatch) as log:
        fit_cohort(model, path, client, partition_bytes=1_500, mode="persist", gpu_namespace=NAMESPACE, resume=False)
    _assert_only_documented(log, model, X, n_max=X.shape[0], kmeans_copies=0)
    assert_same_fit(model, serial)


def test_the_gibbs_chain_on_gpu_workers_is_the_host_chain(tmp_path, data, gpu_client, monkeypatch):
    """The sampler's m-step on device partitions (A' stays there; N-vectors and M-vectors come back), its
    keyed draws giving the serial host chain."""
    from tasks.training import fit_cohort
    from tests.test_distributed import write_store

    client, _ = gpu_client
    X, bags, y, _ = data
    X = X.astype(np.float32).astype(np.float64)
    path = write_store(tmp_path / "gibbs.zarr", X, bags, y)
    params = dict(n_inducing=M, kernel=RBF(4.0), n_samples=8, burn_in=2, thin=1, random_state=0, standardize=False)
    serial = VGPMILPRGibbs(**params).fit(X, bags, y)
    model = VGPMILPRGibbs(**params)
    with count_transfers(monkeypatch) as log:
        summary = fit_cohort(model, path, client, partition_bytes=1_500, mode="persist", gpu_namespace=NAMESPACE, resume=False)
    assert summary.device == "gpu" and summary.n_partitions > 2
    _assert_only_documented(log, model, X, n_max=X.shape[0], kmeans_copies=0)
    np.testing.assert_allclose(model.v_samples_, serial.v_samples_, rtol=1e-8, atol=1e-10)


def test_persist_or_stream_is_chosen_from_device_memory(tmp_path, data, gpu_client):
    from tasks.store import open_cohort
    from tasks.training.placement import ArrayPlacement, resolve_mode
    from tests.test_distributed import write_store

    client, _ = gpu_client
    X, bags, y, _ = data
    cohort = open_cohort(write_store(tmp_path / "mem.zarr", X, bags, y))
    gpu = ArrayPlacement.gpu(NAMESPACE)
    needed = 8 * (M + 4) * X.shape[0]
    assert resolve_mode(client, cohort, VGPMIL(**GP), "auto", 0.5, gpu, device_memory=4 * needed) == "persist"
    assert resolve_mode(client, cohort, VGPMIL(**GP), "auto", 0.5, gpu, device_memory=needed) == "stream"


# ------------------------------------------------- float32 whitened features, float64 statistics
def test_float32_whitened_features_keep_float64_statistics_and_stay_close_to_float64(data):
    from mil_core.engine import transposed_product

    X, bags, y, _ = data
    X32 = X.astype(np.float32)
    fit64 = VGPMIL(**{**GP, "max_iter": 10}).fit(X32.astype(np.float64), bags, y)
    fit32 = VGPMIL(**{**GP, "max_iter": 10}).fit(X32, bags, y)
    whitened = fit32.gp_.whiten(to_emulated(X32))
    assert whitened.A.dtype == xp.float32 and whitened.weighted_gram(np.ones(X.shape[0])).dtype == np.float64
    # chunked float32 products summed in float64 beat one float32 GEMM over all rows
    rng = np.random.default_rng(0)
    A = rng.standard_normal((20_000, 4)).astype(np.float32) + 3.0
    exact = A.astype(np.float64).T @ A.astype(np.float64)
    assert np.abs(transposed_product(A, A) - exact).max() <= np.abs((A.T @ A).astype(np.float64) - exact).max()
    # the error of the fit against float64 (docs/BENCHMARKS.md has it at scale)
    scale = np.abs(fit64.q_.mean).max()
    assert np.abs(fit32.q_.mean - fit64.q_.mean).max() < 1e-4 * scale
    _, p32 = fit32.predict_bag_proba(X32, bags)
    _, p64 = fit64.predict_bag_proba(X32.astype(np.float64), bags)
    assert np.abs(p32 - p64).max() < 1e-5


def test_float32_on_gpu_workers(tmp_path, data, gpu_client):
    from tasks.training import fit_cohort
    from tests.test_distributed import write_store

    client, _ = gpu_client
    X, bags, y, _ = data
    X = X.astype(np.float32).astype(np.float64)
    path = write_store(tmp_path / "f32.zarr", X, bags, y)
    serial = VGPMIL(**GP).fit(X, bags, y)
    model = VGPMIL(**GP)
    fit_cohort(model, path, client, partition_bytes=1_500, mode="stream", gpu_namespace=NAMESPACE, compute_dtype="float32", resume=False)
    assert np.abs(model.q_.mean - serial.q_.mean).max() < 1e-4 * np.abs(serial.q_.mean).max()
    np.testing.assert_allclose(model.elbo_, serial.elbo_, rtol=1e-5)


def test_namespace_spec_is_checked():
    from tasks.training.placement import ArrayPlacement

    with pytest.raises(ValueError, match="no_such_module"):
        ArrayPlacement.gpu("no_such_module").to_device(np.zeros((2, 2)))
    with pytest.raises(ValueError, match="no device 'device9'"):
        ArrayPlacement.gpu("array_api_strict:device9").to_device(np.zeros((2, 2)))
    assert ArrayPlacement().resources is None and ArrayPlacement.gpu().resources == {"GPU": 1}
