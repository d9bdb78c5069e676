"""The Dask executor: a fit over store partitions on a real LocalCluster equals ``model.fit``."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest
import zarr
from distributed import Client, LocalCluster

from mil_core import GVGPMIL, RBF, VGPMIL, VGPMILPR
from tasks.store import BagData, CohortSpec, append_bags, create_cohort
from tasks.training import fit_cohort, predict_cohort, read_predictions

pytestmark = pytest.mark.timeout(300)

PARAMS = dict(n_inducing=12, max_iter=12, tol=0.0, random_state=0)  # standardize=True, the default: fit_cohort follows it
FIXED_KERNEL = dict(PARAMS, kernel=RBF(4.0))


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=":0") as cluster:
        yield cluster


@pytest.fixture
def client(cluster):
    with Client(cluster) as client:
        yield client


def write_store(path, X, bags, y, unlabelled=()):
    """Bags in the order of their (zero-padded) ids, as ``model.fit`` sorts them."""
    create_cohort(path, CohortSpec(name="toy", n_features=X.shape[1], coords_dim=1, coords_meaning="index"))
    records = []
    for b in np.unique(bags):
        rows = np.flatnonzero(bags == b)
        label = -1 if b in unlabelled else int(y[rows[0]])
        records.append(BagData(bag_id=f"bag{b:04d}", label=label, source="memory", features=X[rows],
                               coords=np.arange(rows.size)[:, None], instance_labels=np.full(rows.size, -1)))
    append_bags(path, records)
    return str(path)


@pytest.fixture
def toy_store(tmp_path, toy_bags):
    X, bags, y, _ = toy_bags
    X = X.astype(np.float32).astype(np.float64)  # the store keeps float32 features
    return write_store(tmp_path / "toy.zarr", X, bags, y), (X, bags, y)


def assert_same_fit(distributed, serial):
    np.testing.assert_allclose(distributed.gp_.Z, serial.gp_.Z, rtol=1e-12)
    np.testing.assert_allclose(distributed.q_.mean, serial.q_.mean, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(distributed.q_.cov, serial.q_.cov, rtol=1e-8, atol=1e-10)
    np.testing.assert_allclose(distributed.elbo_, serial.elbo_, rtol=1e-8)


@pytest.mark.parametrize(("partition_bytes", "params"), [(200, FIXED_KERNEL), (2_000, PARAMS), (10**9, PARAMS)],
                         ids=["200", "2000", "1000000000"])
@pytest.mark.parametrize("mode", ["persist", "stream"])
def test_distributed_fit_equals_serial_fit_for_any_partitioning(client, toy_store, partition_bytes, params, mode):
    """Partitions of about a bag (200 bytes) with a fixed kernel: the kernel choice's hundreds of
    fits over them cost 20 s per mode; it runs on partitions of several bags and on one partition."""
    path, (X, bags, y) = toy_store
    serial = VGPMIL(**params).fit(X, bags, y)
    model = VGPMIL(**params)
    summary = fit_cohort(model, path, client, partition_bytes=partition_bytes, mode=mode, resume=False)
    assert summary.mode == mode and summary.n_iter == serial.n_iter_  # kernel=None: the same chosen stop
    assert_same_fit(model, serial)


@pytest.mark.parametrize("n_workers", [1, 4])
def test_distributed_fit_does_not_depend_on_the_number_of_workers(tmp_path, toy_store, n_workers):
    path, (X, bags, y) = toy_store
    serial = GVGPMIL(**PARAMS).fit(X, bags, y)
    with LocalCluster(n_workers=n_workers, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        model = GVGPMIL(**PARAMS)
        fit_cohort(model, path, client, partition_bytes=3_000, resume=False)
    assert_same_fit(model, serial)


def test_a_cohort_smaller_than_n_inducing_trains_as_model_fit_does(client, toy_store):
    """Fewer training instances than ``n_inducing``: on the cluster too every instance becomes an
    inducing point (with the warning), and the fit equals the serial one."""
    path, (X, bags, y) = toy_store
    params = dict(FIXED_KERNEL, n_inducing=10 * X.shape[0])
    with pytest.warns(UserWarning, match="every training instance is an inducing point"):
        serial = VGPMIL(**params).fit(X, bags, y)
    model = VGPMIL(**params)
    with pytest.warns(UserWarning, match="every training instance is an inducing point"):
        fit_cohort(model, path, client, partition_bytes=2_000, resume=False)
    assert model.gp_.Z.shape[0] == X.shape[0]
    assert_same_fit(model, serial)


def test_unlabelled_bags_are_left_out_of_training(tmp_path, toy_bags, client):
    X, bags, y, _ = toy_bags
    X = X.astype(np.float32).astype(np.float64)
    unlabelled = {1, 4}
    path = write_store(tmp_path / "partial.zarr", X, bags, y, unlabelled=unlabelled)
    keep = ~np.isin(bags, list(unlabelled))
    serial = VGPMIL(**PARAMS).fit(X[keep], bags[keep], y[keep])
    model = VGPMIL(**PARAMS)
    fit_cohort(model, path, client, partition_bytes=2_000, resume=False)
    assert_same_fit(model, serial)


@pytest.mark.parametrize("coupled", [False, True], ids=["VGPMIL", "VGPMILPRI"])
def test_early_stopping_matches_serial_fit(client, toy_store, coupled):
    """The hold-out bags are scored on the workers as ``model.fit`` scores them; VGPMIL-PR-I's
    in-context scores through the coupling each hold-out block prepares once on its worker."""
    from mil_core import VGPMILPRI

    path, (X, bags, y) = toy_store
    params = {**PARAMS, "max_iter": 30, "early_stopping": True, "n_iter_no_change": 3}
    coords = {"coords": np.concatenate([np.arange(np.sum(bags == b)) for b in np.unique(bags)])[:, None]} if coupled else {}
    make = (lambda: VGPMILPRI(lam=0.5, **params)) if coupled else (lambda: VGPMIL(**params))
    serial = make().fit(X, bags, y, **coords)
    model = make()
    fit_cohort(model, path, client, partition_bytes=2_000, resume=False)
    np.testing.assert_allclose(model.validation_auc_, serial.validation_auc_, rtol=1e-10)
    assert model.best_iteration_ == serial.best_iteration_
    assert_same_fit(model, serial)


def test_a_killed_worker_does_not_change_the_result(client, toy_store):
    path, (X, bags, y) = toy_store
    serial = VGPMIL(**PARAMS).fit(X, bags, y)
    killed = []

    def kill_one_worker(iteration, objective):
        if iteration == 4 and not killed:
            pid = next(iter(client.run(os.getpid).values()))
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    model = VGPMIL(**PARAMS)
    fit_cohort(model, path, client, partition_bytes=2_000, mode="persist", checkpoint_every=100, resume=False, on_iteration=kill_one_worker)
    assert killed
    assert_same_fit(model, serial)


class ClientDied(Exception):
    pass


def interrupt(model_class, path, client, run, at):
    """Run ``run`` of ``model_class(**FIXED_KERNEL)`` killed on the client at iteration ``at``, with
    checkpoints every 3. A fixed kernel: all 12 sweeps run (kernel=None may stop before ``at``)."""
    def die(iteration, objective):
        if iteration == at:
            raise ClientDied

    with pytest.raises(ClientDied):
        fit_cohort(model_class(**FIXED_KERNEL), path, client, run=run, partition_bytes=2_000, checkpoint_every=3, on_iteration=die)


def fit_and_interrupt(model_class, path, client, run):
    """The uninterrupted fit (run ``reference``), and run ``run`` of the same model killed at
    iteration 8 (its latest checkpoint: 6)."""
    uninterrupted = model_class(**FIXED_KERNEL)
    fit_cohort(uninterrupted, path, client, run="reference", partition_bytes=2_000, resume=False)
    interrupt(model_class, path, client, run, at=8)
    assert zarr.open_group(path, mode="r")[f"training/{run}"].attrs["latest"] == 6
    return uninterrupted


@pytest.mark.parametrize("model_class", [VGPMIL, VGPMILPR])  # VGPMILPR: local states whose cache is not saved
def test_a_fit_interrupted_on_the_client_resumes_from_the_last_checkpoint(client, toy_store, model_class):
    path, _ = toy_store
    uninterrupted = fit_and_interrupt(model_class, path, client, "crashy")
    resumed = model_class(**FIXED_KERNEL)
    summary = fit_cohort(resumed, path, client, run="crashy", partition_bytes=2_000, checkpoint_every=3)
    assert summary.resumed_from == 6
    assert_same_fit(resumed, uninterrupted)


def test_a_vgpmil_pr_checkpoint_of_bare_warm_starts_resumes(client, toy_store):
    """Checkpoints written before session 17 hold each partition's warm start as a bare array, not a
    ``ProbitLocal``: a run interrupted before an upgrade resumes after it, to the uninterrupted fit."""
    from tasks.training.checkpoint import Checkpoint

    path, _ = toy_store
    uninterrupted = fit_and_interrupt(VGPMILPR, path, client, "old")
    checkpoint = Checkpoint(path, "old")
    for index in map(int, zarr.open_group(path, mode="r")["training/old/it6/local"].array_keys()):
        checkpoint.save_local(6, index, checkpoint.load_local(6, index).warm)  # the previous format
    assert isinstance(checkpoint.load_local(6, 0), np.ndarray)
    resumed = VGPMILPR(**FIXED_KERNEL)
    assert fit_cohort(resumed, path, client, run="old", partition_bytes=2_000, checkpoint_every=3).resumed_from == 6
    assert_same_fit(resumed, uninterrupted)


def test_a_checkpoint_without_a_fitted_attribute_of_this_version_is_refused_clearly(client, toy_store):
    """A VGPMIL checkpoint written before ``H_`` existed (session 19) cannot resume: the error says
    so and names the attribute, instead of an AttributeError from deep in the fit."""
    from mil_core import persist
    from tasks.training.checkpoint import _read, _write_bytes

    path, _ = toy_store
    interrupt(VGPMIL, path, client, "older", at=4)
    group = zarr.open_group(path, mode="a")["training/older"]
    model, scaling = _read(group, "model")
    del model.H_  # as the previous version wrote it
    _write_bytes(group, "model", persist.dumps((model, scaling)))
    with pytest.raises(ValueError, match=r"training/older was written by an older gpmil: its VGPMIL has no 'H_'.*new run name"):
        fit_cohort(VGPMIL(**FIXED_KERNEL), path, client, run="older", partition_bytes=2_000, checkpoint_every=3)


def test_resuming_with_another_configuration_is_refused(client, toy_store):
    path, _ = toy_store
    fit_cohort(VGPMIL(**PARAMS), path, client, run="r", partition_bytes=2_000)
    with pytest.raises(ValueError, match="n_inducing"):
        fit_cohort(VGPMIL(**{**PARAMS, "n_inducing": 8}), path, client, run="r", partition_bytes=2_000)
    with pytest.raises(ValueError, match=rf"other partitions .*: resume with the partition size it was written with "
                                         rf"\(training.partition_mib, .*\), or delete {path}/training/r to train this model afresh"):
        fit_cohort(VGPMIL(**PARAMS), path, client, run="r", partition_bytes=1_000)


def test_distributed_predictions_equal_the_model_predictions(client, toy_store):
    path, (X, bags, y) = toy_store
    model = VGPMIL(**PARAMS).fit(X, bags, y)
    predict_cohort(model, path, client, run="p", partition_bytes=2_000,
                   instance_kwargs={"method": "probit"}, bag_kwargs={"method": "probit", "rule": "max"})
    out = read_predictions(path, "p")
    order = np.argsort(bags, kind="stable")
    np.testing.assert_allclose(out["instances/proba"], model.predict_instance_proba(X[order], method="probit"), rtol=1e-10)
    _, p_bag = model.predict_bag_proba(X, bags, method="probit", rule="max")
    np.testing.assert_allclose(out["bags/proba"], p_bag, rtol=1e-10)
    assert np.all(np.isfinite(out["instances/std"])) and np.all(np.isfinite(out["bags/std"]))


def test_a_cohort_without_both_classes_cannot_be_trained(tmp_path, toy_bags, client):
    X, bags, y, _ = toy_bags
    path = write_store(tmp_path / "neg.zarr", X, bags, np.zeros_like(y))
    from tasks.training.errors import CohortError

    with pytest.raises(CohortError, match="both classes"):  # an input error: the command line prints it without a traceback
        fit_cohort(VGPMIL(**PARAMS), path, client)


@pytest.mark.parametrize("kernel", [RBF(4.0), None], ids=["fixed-kernel", "kernel-choice"])
def test_ising_coupled_probit_model_trains_on_store_coordinates(client, toy_store, kernel):
    """With ``kernel=None`` the cluster fit chooses the kernel on the store's coordinates, as
    ``model.fit`` does on the coords it is given: same choice, same fit."""
    from mil_core import VGPMILPRI

    path, (X, bags, y) = toy_store
    coords = np.concatenate([np.arange(np.sum(bags == b)) for b in np.unique(bags)])[:, None]
    params = dict(lam=0.5, n_inducing=8, max_iter=6, tol=0.0, random_state=0, kernel=kernel, standardize=False)
    serial = VGPMILPRI(**params).fit(X, bags, y, coords=coords)
    model = VGPMILPRI(**params)
    fit_cohort(model, path, client, partition_bytes=2_000, resume=False)
    assert model.kernel_selection_.shape == ((4, 2) if kernel is None else (0, 2))
    np.testing.assert_array_equal(model.kernel_selection_, serial.kernel_selection_)
    assert model.kernel_.variance == serial.kernel_.variance and model.auto_max_iter_ == serial.auto_max_iter_
    assert_same_fit(model, serial)
    if kernel is None:  # the pipeline scores bags by the estimator's bag_rule, in the bags' context
        predict_cohort(model, path, client, run="pri", partition_bytes=2_000)
        _, p_bag = model.predict_bag_proba(X, bags, coords=coords)
        np.testing.assert_allclose(read_predictions(path, "pri")["bags/proba"], p_bag, rtol=1e-10)


@pytest.mark.parametrize("mode", ["persist", "stream"])
def test_a_learnt_prior_mean_probes_from_the_cached_latent_and_equals_the_serial_fit(client, toy_store, tmp_path, mode):
    """VGPMIL-PR's learnt b probes Σ log Z_b between sweeps; a partition caches ``A'm`` for them in its local
    state, and in stream mode a probe after the first of an iteration reads nothing: the executor's step answers
    it with no store at all. The fit equals the serial one."""
    from mil_core.models.probit_updates import PriorMeanProbe, ProbitMILUpdates, ProbitQ, fresh_local
    from tasks.store import open_cohort
    from tasks.training.executor import _stream_partition_step
    from tasks.training.placement import ArrayPlacement

    path, (X, bags, y) = toy_store
    serial = VGPMILPR(**FIXED_KERNEL).fit(X, bags, y)
    model = VGPMILPR(**FIXED_KERNEL)
    fit_cohort(model, path, client, partition_bytes=2_000, mode=mode, resume=False)
    assert serial.q_.prior_mean != 0.0
    assert model.q_.prior_mean == pytest.approx(serial.q_.prior_mean, rel=1e-8)
    assert_same_fit(model, serial)

    partition = open_cohort(path).partitions(2_000)[0]
    updates = ProbitMILUpdates(gp=serial.gp_, learn_prior_mean=True)

    def step(store, local, glob):
        return _stream_partition_step(updates, store, partition, ArrayPlacement(), None, False, None, local, glob)

    missing = str(tmp_path / "no-such-store.zarr")
    probe = PriorMeanProbe(q=serial.q_, prior_mean=-1.0)
    first, local = step(path, fresh_local(partition.n_rows), probe)
    assert step(missing, local, probe)[0] == first  # answered from the partition's cache: nothing read
    moved = PriorMeanProbe(q=ProbitQ(mean=serial.q_.mean + 0.1, cov=serial.q_.cov), prior_mean=-1.0)
    with pytest.raises(FileNotFoundError):  # another q(v) needs the block, and there is no store
        step(missing, local, moved)


def test_vwsgp_trains_and_predicts_on_the_cluster(client, toy_store):
    from mil_core import VWSGP

    path, (X, bags, y) = toy_store
    params = dict(n_inducing=8, max_iter=6, tol=0.0, random_state=0, standardize=False)
    serial = VWSGP(**params).fit(X, bags, y)
    model = VWSGP(**params)
    fit_cohort(model, path, client, partition_bytes=2_000, resume=False)
    assert_same_fit(model, serial)
    predict_cohort(model, path, client, run="vwsgp", partition_bytes=2_000, bag_kwargs={"method": "probit"})
    out = read_predictions(path, "vwsgp")
    assert "instances/proba" not in out  # evidences are not instance probabilities (seed 001, §3)
    order = np.argsort(bags, kind="stable")
    np.testing.assert_allclose(out["instances/evidence"], model.predict_instance_evidence(X[order]), rtol=1e-10)


def test_absmil_gradient_solver_runs_unchanged_on_the_dask_executor(client, toy_store):
    from mil_core import AbSMIL
    from mil_core.bags import BagIndex
    from mil_core.engine import BagBlock, SerialExecutor, optimise
    from tasks.store import open_cohort
    from tasks.training import DaskExecutor

    path, (X, bags, y) = toy_store
    index = BagIndex.from_ids(bags)
    X_sorted, labels = X[index.order], y[index.order][index.offsets[:-1]]
    updates = AbSMIL(n_attributes=2, n_max=2)._start_fit(X_sorted, np.random.RandomState(0))
    blocks = [BagBlock(X=X_sorted, offsets=index.offsets, labels=labels)]
    serial = optimise(SerialExecutor(updates, blocks).sweep, updates, updates.init_global(), max_iter=15, tol=0.0)
    executor = DaskExecutor(client, updates, path, open_cohort(path).partitions(2_000), mode="stream")
    distributed = optimise(executor.sweep, updates, updates.init_global(), max_iter=15, tol=0.0)
    np.testing.assert_allclose(distributed.objective, serial.objective, rtol=1e-8)
    np.testing.assert_allclose(distributed.glob.solution, serial.glob.solution, rtol=1e-8, atol=1e-12)


def test_a_fit_that_learns_the_kernel_resumes_with_the_learnt_kernel(client, toy_store):
    path, (X, bags, y) = toy_store
    params = {**PARAMS, "learn_kernel": True, "hyper_steps": 2, "max_iter": 6}
    serial = VGPMIL(**params).fit(X, bags, y)

    def die(iteration, objective):
        if iteration == 5:
            raise ClientDied

    with pytest.raises(ClientDied):
        fit_cohort(VGPMIL(**params), path, client, run="hyper", partition_bytes=2_000, checkpoint_every=2, on_iteration=die)
    resumed = VGPMIL(**params)
    fit_cohort(resumed, path, client, run="hyper", partition_bytes=2_000, checkpoint_every=2)
    np.testing.assert_allclose(resumed.kernel_.variance, serial.kernel_.variance, rtol=1e-6)
    np.testing.assert_allclose(resumed.q_.mean, serial.q_.mean, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("early_stopping", [False, True])
def test_the_models_own_standardisation_trains_and_predicts_as_its_fit(client, tmp_path, toy_bags, early_stopping):
    """fit_cohort follows the model's ``standardize`` (default True) as ``model.fit`` does — the
    validation bags' rows in the mean and std too — and predict_cohort applies it once."""
    X, bags, y, _ = toy_bags
    X = (X * [1.0, 1000.0] + [0.0, 5e4]).astype(np.float32).astype(np.float64)  # features on wildly different scales
    X = np.column_stack([X, np.full(X.shape[0], 7e4)])  # and a constant one: scale 1, as in fit
    path = write_store(tmp_path / "scaled.zarr", X, bags, y)
    params = {**PARAMS, "standardize": True, "early_stopping": early_stopping, "n_iter_no_change": 3}
    model = VGPMIL(**params)
    summary = fit_cohort(model, path, client, partition_bytes=2_000, resume=False)
    serial = VGPMIL(**params).fit(X, bags, y)
    np.testing.assert_allclose(model.feature_mean_, serial.feature_mean_, rtol=1e-10)
    np.testing.assert_allclose(model.feature_scale_, serial.feature_scale_, rtol=1e-8)
    np.testing.assert_array_equal(summary.scaling.mean, model.feature_mean_)
    assert model.feature_scale_[2] == 1.0 and model.feature_mean_[2] == 7e4
    assert_same_fit(model, serial)
    mean_before = model.feature_mean_.copy()
    predict_cohort(model, path, client, run="scaled", instance_kwargs={"method": "probit"})
    predict_cohort(model, path, client, run="again", scaling=summary.scaling, instance_kwargs={"method": "probit"})  # the same, once
    np.testing.assert_array_equal(model.feature_mean_, mean_before)  # the reader's copy, not the model, drops it
    order = np.argsort(bags, kind="stable")
    expected = serial.predict_instance_proba(X[order], method="probit")
    for run in ("scaled", "again"):
        np.testing.assert_allclose(read_predictions(path, run)["instances/proba"], expected, rtol=1e-8)
    other = type(summary.scaling)(mean=summary.scaling.mean + 1.0, scale=summary.scaling.scale)
    with pytest.raises(ValueError, match="standardised twice"):
        predict_cohort(model, path, client, run="twice", scaling=other)


def test_the_standardisation_runs_in_row_chunks_as_on_whole_partitions(tmp_path, toy_bags, monkeypatch):
    """The standardised read and the mean/std sums work on float64 chunks of ``FLOAT64_ROWS`` rows
    (no float64 temporaries of a whole partition): chunk edges inside bags change no value."""
    from tasks.store import open_cohort
    from tasks.training import blocks
    from tasks.training.preprocess import _feature_sums

    X, bags, y, _ = toy_bags
    X = (X * [1.0, 1000.0] + [0.0, 5e4]).astype(np.float32).astype(np.float64)
    path = write_store(tmp_path / "chunks.zarr", X, bags, y)
    cohort = open_cohort(path)
    scaling = blocks.FeatureScaling(mean=X.mean(axis=0), scale=X.std(axis=0))
    monkeypatch.setattr(blocks, "FLOAT64_ROWS", 7)
    partitions = cohort.partitions(2_000)
    assert len(partitions) > 1 and partitions[0].n_rows > 7 and partitions[0].n_rows % 7  # a last, partial chunk
    for partition in partitions:
        stored = cohort.read_partition(partition)
        whole = (np.asarray(stored.features, dtype=np.float64) - scaling.mean) / scaling.scale
        for dtype in ("float64", "float32"):
            np.testing.assert_array_equal(blocks.read_features(stored, scaling, dtype), whole.astype(dtype))
        narrower = blocks.read_features(stored, lambda rows: scaling(rows)[:, 1:] ** 2)  # a transform changing the width
        np.testing.assert_array_equal(narrower, whole[:, 1:] ** 2)
        shifted = np.asarray(stored.features, dtype=np.float64) - X[0]
        expected = np.concatenate([[shifted.shape[0]], shifted.sum(axis=0), (shifted**2).sum(axis=0)])
        np.testing.assert_allclose(_feature_sums(path, partition, np.empty(0, dtype=np.int64), X[0]), expected, rtol=1e-12)


def test_the_standardisation_reads_only_the_bags_it_trains_on(client, tmp_path, toy_bags):
    """An unlabelled first bag (here with a NaN row written behind the store's back, as predict_cohort
    tolerates) takes no part in the mean and std: they are model.fit's on the labelled bags."""
    X, bags, y, _ = toy_bags
    X = X.astype(np.float32).astype(np.float64)
    path = write_store(tmp_path / "first.zarr", X, bags, y, unlabelled=(0,))
    zarr.open_group(path, mode="a")["instances/features"][0, 1] = np.nan
    model = VGPMIL(**PARAMS)
    fit_cohort(model, path, client, resume=False)
    labelled = bags != 0
    serial = VGPMIL(**PARAMS).fit(X[labelled], bags[labelled], y[labelled])
    np.testing.assert_allclose(model.feature_mean_, serial.feature_mean_, rtol=1e-12)
    np.testing.assert_allclose(model.feature_scale_, serial.feature_scale_, rtol=1e-12)


def test_a_raw_fit_and_a_transform_leave_the_model_without_a_standardisation(client, toy_store):
    path, (X, bags, y) = toy_store
    model = VGPMIL(**PARAMS, standardize=False)  # the features as stored, as its fit
    assert fit_cohort(model, path, client, resume=False).scaling is None and model.feature_mean_ is None
    assert_same_fit(model, VGPMIL(**PARAMS, standardize=False).fit(X, bags, y))
    with pytest.raises(ValueError, match="standardize=True with a transform"):
        fit_cohort(VGPMIL(**PARAMS), path, client, run="t", standardize=True, transform=np.asarray)


def test_absmil_trains_and_predicts_through_fit_cohort_as_its_fit(client, toy_store):
    from mil_core import AbSMIL

    path, (X, bags, y) = toy_store
    params = dict(max_iter=30, n_random_features=16, random_state=0, standardize=False)
    serial = AbSMIL(**params).fit(X, bags, y)
    model = AbSMIL(**params)
    summary = fit_cohort(model, path, client, partition_bytes=2_000, resume=False)
    assert summary.n_partitions > 1
    np.testing.assert_allclose(model.weights_, serial.weights_, rtol=1e-8, atol=1e-12)
    np.testing.assert_allclose(model.objective_, serial.objective_, rtol=1e-10)
    predict_cohort(model, path, client, run="absmil", partition_bytes=2_000)
    out = read_predictions(path, "absmil")
    np.testing.assert_allclose(out["bags/proba"], serial.predict_bag_proba(X, bags)[1], rtol=1e-8)
    order = np.argsort(bags, kind="stable")
    np.testing.assert_allclose(out["instances/proba"], serial.predict_instance_proba(X[order]), rtol=1e-8)
    assert np.all(np.isnan(out["bags/std"]))  # a point estimate has no predictive std
    with pytest.raises(ValueError, match="n_init=1"):
        fit_cohort(AbSMIL(n_init=3), path, client, run="restarts", resume=False)



def test_persisted_partitions_are_spread_evenly_over_the_workers(toy_store):
    """Each worker loads ⌊P/W⌋ or ⌈P/W⌉ of the P partitions and keeps their local state where they
    are (left to the scheduler, 10 partitions went 6/4 on 2 workers: a 1.67× cap on the speed-up).
    Work stealing, which may move tasks off a worker slowed by other load, is off here so that the
    test sees the placement itself."""
    import dask

    from tasks.store import open_cohort
    from tasks.training import DaskExecutor

    path, (X, bags, y) = toy_store
    updates = VGPMIL(**FIXED_KERNEL)._start_fit(X[:60], y[:60])
    partitions = open_cohort(path).partitions(400)
    with (dask.config.set({"distributed.scheduler.work-stealing": False}),
          LocalCluster(n_workers=2, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client):
        executor = DaskExecutor(client, updates, path, partitions, mode="persist")
        executor.sweep(updates.init_global())
        holders = client.who_has(executor.blocks)
        counts = np.bincount(np.unique([next(iter(w)) for w in holders.values()], return_inverse=True)[1])
        assert len(partitions) >= 5 and counts.size == 2 and counts.max() - counts.min() <= len(partitions) % 2
        local_holders = client.who_has(executor.locals)
        assert all(local_holders[local.key] == holders[block.key] for local, block in zip(executor.locals, executor.blocks))


def test_kernel_choice_is_the_serial_one_when_the_kmeans_sample_leaves_bags_out(client, toy_store, monkeypatch):
    """Above ``max_kmeans_sample`` the cluster fit's k-means sees a sample of whole bags; the kernel
    choice still fits on the bags ``model.fit`` chooses on (:func:`~mil_core.models.base.choice_bags`,
    here capped below the cohort too), so both make the same choice."""
    import mil_core.models.base as base

    path, (X, bags, y) = toy_store
    monkeypatch.setattr(base, "_SELECTION_MAX_INSTANCES", X.shape[0] // 3)
    params = dict(n_inducing=8, max_iter=12, tol=0.0, random_state=0, standardize=False)
    serial = VGPMIL(**params).fit(X, bags, y)
    model = VGPMIL(**params)
    fit_cohort(model, path, client, partition_bytes=2_000, resume=False, max_kmeans_sample=X.shape[0] // 2)
    assert model.gp_.Z.shape == serial.gp_.Z.shape and not np.allclose(model.gp_.Z, serial.gp_.Z)  # k-means on a sample
    np.testing.assert_array_equal(model.kernel_selection_, serial.kernel_selection_)
    assert model.kernel_.variance == serial.kernel_.variance and model.auto_max_iter_ == serial.auto_max_iter_
    assert model.H_ == serial.H_ and model.setting_selection_ == serial.setting_selection_  # H="auto": chosen with it


def test_pixel_coordinates_become_grid_positions_and_a_store_without_positions_is_refused_for_pr_i(tmp_path, client, toy_bags):
    """VGPMIL-PR-I's neighbour graph links grid positions one step apart: the level-0 pixels of .h5
    and x, y tables (256 px apart) gave no neighbour at all, and a table without coordinates was
    coupled along its rows' order, both without a word."""
    from types import SimpleNamespace

    from mil_core import VGPMILPRI
    from tasks.training.blocks import grid_coords

    rows, cols = np.meshgrid(np.arange(3), np.arange(4), indexing="ij")
    grid = np.stack([cols.ravel(), rows.ravel()], axis=1)
    block = SimpleNamespace(coords=np.concatenate([grid * 256, grid[:5] * 512 + 3]), offsets=np.array([40, 52, 57]))
    np.testing.assert_array_equal(grid_coords(block, "x,y (level-0 pixels, as in the .h5)"), np.concatenate([grid, grid[:5]]))
    np.testing.assert_array_equal(grid_coords(block, "given"), block.coords)  # grid positions as the user gave them

    X, bags, y, _ = toy_bags
    path = tmp_path / "rows.zarr"
    create_cohort(path, CohortSpec(name="t", n_features=X.shape[1], coords_dim=1, coords_meaning="instance_index"))
    append_bags(path, [BagData(bag_id=f"b{b}", label=int(y[bags == b][0]), source="memory", features=X[bags == b],
                               coords=np.arange((bags == b).sum())[:, None], instance_labels=np.full((bags == b).sum(), -1))
                       for b in np.unique(bags)])
    with pytest.raises(ValueError, match=r"VGPMILPRI couples neighbouring instances, and the instances of .* have no positions"):
        fit_cohort(VGPMILPRI(lam=1.0, **PARAMS), str(path), client)


def test_a_fit_killed_during_the_kernel_choice_resumes_the_choice_where_it_stopped(client, toy_store, monkeypatch, caplog):
    """The automatic kernel choice runs before the first checkpoint (13.5 of a fit's minutes on 50
    slides × 768 features): a run killed during it started it again. Its finished splits are now
    kept in ``training/<run>/choice`` until the first commit; the restarted run fits only the others
    (and one whose record was cut short) and ends as an uninterrupted fit."""
    from tasks.training.checkpoint import ChoiceMemo

    path, _ = toy_store
    uninterrupted = VGPMIL(**PARAMS)
    fit_cohort(uninterrupted, path, client, run="whole", partition_bytes=2_000)
    writes = []
    record = ChoiceMemo.__setitem__

    def killed_after_three(memo, key, value):
        if len(writes) == 3:
            raise KeyboardInterrupt  # the scheduler's kill, as the fourth split ends
        writes.append(key)
        record(memo, key, value)

    monkeypatch.setattr(ChoiceMemo, "__setitem__", killed_after_three)
    with pytest.raises(KeyboardInterrupt):
        fit_cohort(VGPMIL(**PARAMS), path, client, run="killed", partition_bytes=2_000)
    done = set(ChoiceMemo(path, "training/killed/choice"))
    assert done == set(writes) and len(done) == 3
    broken = sorted(done)[0]  # killed between an array's metadata and its data: reads as zeros
    group = zarr.open_group(path, mode="a")["training/killed/choice"]
    group.create_array(broken, shape=group[broken].shape, dtype="uint8", overwrite=True)
    monkeypatch.setattr(ChoiceMemo, "__setitem__", lambda memo, key, value: (writes.append(key), record(memo, key, value)))
    resumed = VGPMIL(**PARAMS)
    with caplog.at_level("INFO", logger="gpmil.training"):
        fit_cohort(resumed, path, client, run="killed", partition_bytes=2_000)
    assert "the kernel choice resumes, 3 of its splits recorded" in caplog.text
    assert (done - {broken}).isdisjoint(writes[3:]) and broken in writes[3:]  # the splits it had were not fitted again
    assert resumed.kernel_ == uninterrupted.kernel_ and resumed.auto_max_iter_ == uninterrupted.auto_max_iter_
    np.testing.assert_array_equal(resumed.kernel_selection_, uninterrupted.kernel_selection_)
    assert_same_fit(resumed, uninterrupted)
    assert "choice" not in zarr.open_group(path, mode="r")["training/killed"]  # the model holds the choice now
