"""Small fits run on one native thread (BLAS, OpenMP), whatever the process's setting: on a busy
machine a threaded BLAS made a default MUSK2 fit 20× slower (mil_core.threadpools). Large fits
keep the process's threads. The threads a small fit gives up run its kernel choice's splits side
by side, with the serial results."""

from __future__ import annotations

import threading
import warnings

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from mil_core import GVGPMIL, RBF, VGPMIL, VGPMILPR, VGPMILPRI, VGPMILPRGibbs
from mil_core import threadpools
from mil_core.threadpools import CONCURRENT_SWEEP_FLOPS, SMALL_SWEEP_FLOPS, concurrent_parts, threads_for
from tests.conftest import make_toy_bags
from tests.test_probit import chain_coords


def most_threads() -> int:
    return max(pool["num_threads"] for pool in threadpool_info())


def test_threads_for_limits_small_work_and_leaves_large_work_alone():
    with threadpool_limits(limits=2):
        assert most_threads() == 2
        with threads_for(1_000, 100):
            assert most_threads() == 1
        assert most_threads() == 2
        with threads_for(SMALL_SWEEP_FLOPS // 100**2 + 1, 100):
            assert most_threads() == 2
        with threads_for(500, 10**6):  # n_inducing above the rows: the exact GP on 500 points
            assert most_threads() == 1


def test_concurrent_parts_run_side_by_side_only_on_the_threads_a_small_fit_gave_up_and_only_for_blas_work():
    barrier = threading.Barrier(2, timeout=30)
    enough, too_little = (CONCURRENT_SWEEP_FLOPS, 1), (CONCURRENT_SWEEP_FLOPS - 1, 1)  # (rows, inducing points): N·M²

    def part(i):
        if i < 2:
            barrier.wait()  # only returns when two parts run at once
        return i * i, threading.get_ident(), most_threads()

    def alone(i):
        return threading.get_ident(), concurrent_parts(lambda j: threading.get_ident(), range(3), *enough)

    with threadpool_limits(limits=2):
        with threads_for(1_000, 100):  # gave up 2 threads
            results = concurrent_parts(part, range(5), *enough)
            assert {ident for ident, _ in concurrent_parts(alone, range(3), *too_little)} == {threading.get_ident()}
        assert [r[0] for r in results] == [0, 1, 4, 9, 16]  # in order
        assert len({r[1] for r in results}) == 2 and threading.get_ident() not in {r[1] for r in results}
        assert {r[2] for r in results} == {1}  # each part on one native thread (OpenMP's limit is per thread)
        with threads_for(SMALL_SWEEP_FLOPS, 1):  # a large fit keeps its threads and gives none up
            assert {ident for ident, _ in concurrent_parts(alone, range(3), *enough)} == {threading.get_ident()}
        with threads_for(1_000, 100):  # a part's own parts run one after another, in its thread
            for ident, inner in concurrent_parts(alone, range(3), *enough):
                assert set(inner) == {ident}
    with threadpool_limits(limits=1), threads_for(1_000, 100):  # a one-thread process (a Dask worker): serial
        assert {ident for ident, _ in concurrent_parts(alone, range(3), *enough)} == {threading.get_ident()}


class _Recording:
    """Records the thread count in force and the Python thread whenever a fit (the kernel choice's
    included) builds its updates."""

    seen: list[int] = []
    threads: set[str] = set()

    def _make_updates(self, gp):
        _Recording.seen.append(most_threads())
        _Recording.threads.add(threading.current_thread().name)
        return super()._make_updates(gp)


class RecordingVGPMIL(_Recording, VGPMIL):
    pass


class RecordingGibbs(_Recording, VGPMILPRGibbs):
    pass


@pytest.mark.parametrize("model", [
    RecordingVGPMIL(n_inducing=8, max_iter=5, random_state=0),  # kernel=None: the choice's fits too
    RecordingGibbs(n_inducing=8, kernel=RBF(1.0), n_samples=5, burn_in=2, random_state=0),
], ids=["VGPMIL", "Gibbs"])
@pytest.mark.parametrize("side_by_side", [False, True], ids=["python-bound", "as-if-blas-bound"])
def test_a_small_fit_and_its_kernel_choice_run_on_one_thread(model, side_by_side, monkeypatch, relevance_weightings):
    if side_by_side:  # these 72 instances are far below the work that runs the splits side by side
        monkeypatch.setattr(threadpools, "CONCURRENT_SWEEP_FLOPS", 0)
    rng = np.random.default_rng(0)
    bag_ids = np.repeat(np.arange(12), 6)
    y = np.repeat(np.arange(12) % 2, 6)
    X = rng.normal(size=(72, 3)) + y[:, None] * (rng.random((72, 1)) < 0.3)
    _Recording.seen, _Recording.threads = [], set()
    with threadpool_limits(limits=2):
        model.fit(X, bag_ids, y)
        assert most_threads() == 2  # restored afterwards
    # 5 variances x 2 H (H="auto"), then b = v with each H at the chosen variance and the relevance
    # kernel at the chosen variance and its neighbours (3, or 2 at an end of the grid), x 3 repeats x 2 halves
    # (the relevance kernel: once per distinct weighting a half's relevance forms give)
    per_variance = sum(relevance_weightings(12))
    expected_fits = {1} if model.kernel is not None else {1 + (5 * 2 + 2) * 6 + near * per_variance for near in (2, 3)}
    assert len(_Recording.seen) in expected_fits
    assert set(_Recording.seen) == {1}
    final_fit, choice = {threading.current_thread().name}, {"mil-core-part_0", "mil-core-part_1"}
    if model.kernel is None and side_by_side:  # the choice's fits on the two threads the limit took, the final fit here
        assert final_fit < _Recording.threads <= final_fit | choice
    else:
        assert _Recording.threads == final_fit


@pytest.mark.parametrize("make", [
    lambda: VGPMIL(n_inducing=10, max_iter=30, random_state=np.random.RandomState(3)),
    lambda: GVGPMIL(n_inducing=10, max_iter=30, random_state=1),
    lambda: VGPMILPR(n_inducing=10, max_iter=30, random_state=2),
    lambda: VGPMILPRI(n_inducing=10, max_iter=30, random_state=4),  # reads coords: a coupling per held-out half
], ids=["VGPMIL", "GVGPMIL", "VGPMILPR", "VGPMILPRI"])
def test_the_kernel_choice_side_by_side_gives_the_serial_fit_and_keeps_its_warnings_in(make, monkeypatch):
    monkeypatch.setattr(threadpools, "CONCURRENT_SWEEP_FLOPS", 0)  # side by side on these small bags too
    X, bag_ids, y, _ = make_toy_bags(n_bags=16, n_features=3, seed=0)
    coords = chain_coords(bag_ids)
    extra = {"coords": coords} if isinstance(make(), VGPMILPRI) else {}
    fits = {}
    for threads in (1, 2):  # 1: the serial loop (as in a Dask worker); 2: the splits side by side
        with threadpool_limits(limits=threads), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fits[threads] = make().fit(X, bag_ids, y, **extra)
        assert not [w for w in caught if "max_iter=50" in str(w.message)]  # the choice's budget is no failure
    serial, side_by_side = fits[1], fits[2]
    assert serial.kernel_ == side_by_side.kernel_ and serial.auto_max_iter_ == side_by_side.auto_max_iter_
    np.testing.assert_array_equal(serial.kernel_selection_, side_by_side.kernel_selection_)
    np.testing.assert_array_equal(serial.q_.mean, side_by_side.q_.mean)
    np.testing.assert_array_equal(serial.q_.cov, side_by_side.q_.cov)
    np.testing.assert_array_equal(serial.predict_bag_proba(X, bag_ids, **extra)[1], side_by_side.predict_bag_proba(X, bag_ids, **extra)[1])
