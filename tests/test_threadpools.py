"""Small fits run on one native thread (BLAS, OpenMP), whatever the process's setting: on a busy
machine a threaded BLAS made a default MUSK2 fit 20× slower (mil_core.threadpools). Large fits
keep the process's threads."""

from __future__ import annotations

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from mil_core import RBF, VGPMIL, VGPMILPRGibbs
from mil_core.threadpools import SMALL_SWEEP_FLOPS, threads_for


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


class _Recording:
    """Records the thread count in force whenever a fit (the kernel choice's included) builds its updates."""

    seen: list[int] = []

    def _make_updates(self, gp):
        _Recording.seen.append(most_threads())
        return super()._make_updates(gp)


class RecordingVGPMIL(_Recording, VGPMIL):
    pass


class RecordingGibbs(_Recording, VGPMILPRGibbs):
    pass


@pytest.mark.parametrize("model", [
    RecordingVGPMIL(n_inducing=8, max_iter=5, random_state=0),  # kernel=None: the choice's fits too
    RecordingGibbs(n_inducing=8, kernel=RBF(1.0), n_samples=5, burn_in=2, random_state=0),
], ids=["VGPMIL", "Gibbs"])
def test_a_small_fit_and_its_kernel_choice_run_on_one_thread(model):
    rng = np.random.default_rng(0)
    bag_ids = np.repeat(np.arange(12), 6)
    y = np.repeat(np.arange(12) % 2, 6)
    X = rng.normal(size=(72, 3)) + y[:, None] * (rng.random((72, 1)) < 0.3)
    _Recording.seen = []
    with threadpool_limits(limits=2):
        model.fit(X, bag_ids, y)
        assert most_threads() == 2  # restored afterwards
    # 5 variances x 2 H (H="auto"), then b = v with each H at the chosen variance, x 3 repeats x 2 halves
    expected_fits = 1 + ((5 * 2 + 2) * 6 if model.kernel is None else 0)
    assert len(_Recording.seen) == expected_fits
    assert set(_Recording.seen) == {1}
