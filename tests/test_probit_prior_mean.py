"""VGPMIL-PR's learnt prior mean and bag-label start (issue 15: no default below chance on large bags)."""

import warnings

import numpy as np
import pytest
from sklearn.metrics import roc_auc_score

from mil_core import RBF, VGPMILPR, persist
from mil_core.bags import BagIndex
from mil_core.engine import BagBlock, GaussianQ, SparseGP, step_from_local
from mil_core.models.probit_updates import PriorMeanInputs, PriorMeanProbe, ProbitMILUpdates, ProbitQ


def large_bags(seed: int, n_bags: int = 16, sizes=(300, 900), rate=(0.003, 0.02), shift: float = 2.5):
    """Bags of 300–900 instances; a positive bag (every other) holds 0.3–2 % witnesses shifted by
    ``shift`` in two of four N(0, I) features: the WSI regime at a size a test can afford."""
    rng = np.random.default_rng(seed)
    X, bags, y, inst = [], [], [], []
    for b in range(n_bags):
        n, label = int(rng.integers(*sizes)), b % 2
        k = max(1, int(n * rng.uniform(*rate))) if label else 0
        x = rng.normal(size=(n, 4))
        x[:k, :2] += shift
        X.append(x); bags += [b] * n; y += [label] * n; inst += [1] * k + [0] * (n - k)
    return np.concatenate(X), np.array(bags), np.array(y), np.array(inst)


def _fit_and_score(seed: int, prior_mean):
    X, bags, y, _ = large_bags(2 * seed)
    X_test, bags_test, y_test, inst_test = large_bags(2 * seed + 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a fixed sweep budget
        model = VGPMILPR(kernel=RBF(4.0), standardize=False, n_inducing=20, max_iter=200, prior_mean=prior_mean,
                         random_state=0).fit(X, bags, y)
    index = BagIndex.from_ids(bags_test)
    truth = y_test[index.order][index.offsets[:-1]]
    bag_auc = roc_auc_score(truth, model.predict_bag_proba(X_test, bags_test)[1])
    return model, bag_auc, roc_auc_score(inst_test, model.predict_instance_proba(X_test))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_learnt_prior_mean_finds_the_witnesses_of_large_bags_where_the_zero_mean_does_not(seed):
    """With a zero mean a positive bag of hundreds of instances is "surely positive", its label pulls no
    instance up and the field drifts flat (the cause of the large-bag draw at bag AUC 0.33); the learnt mean
    lowers the field until the bag likelihood points at the witnesses."""
    zero, zero_bag, zero_inst = _fit_and_score(seed, 0.0)
    learnt, bag_auc, inst_auc = _fit_and_score(seed, None)
    assert learnt.q_.prior_mean < -2.0  # witnesses are rare: a low prior instance probability
    assert bag_auc > 0.8 and inst_auc > 0.85
    assert inst_auc > zero_inst + 0.05 and bag_auc > zero_bag + 0.1


def test_prior_mean_terms_are_the_derivatives_of_the_bag_log_normalisers():
    """Value, gradient and curvature of Σ log Z_b(b) (closed form, log space) against finite differences,
    with bags in every regime: negative, positive with P(all negative) ≈ 0, ≈ ½ and ≈ 1 (underflowing)."""
    rng = np.random.default_rng(0)
    X = rng.normal(size=(60, 2))
    offsets = np.array([0, 10, 30, 45, 60])
    labels = np.array([0, 1, 1, 1])
    gp = SparseGP.build(RBF(1.0, 1.0), X[:6])
    updates = ProbitMILUpdates(gp=gp)
    block = updates.prepare(BagBlock(X=X, offsets=offsets, labels=labels))
    q = GaussianQ(mean=rng.normal(size=6), cov=np.eye(6))
    for b in (3.0, 0.0, -2.5, -9.0, -40.0):
        terms = [updates.partition_step(block, updates.init_local(block), PriorMeanProbe(q=q, prior_mean=b + h))[0] for h in (-1e-4, 0.0, 1e-4)]
        assert np.isfinite(terms[1].value)
        np.testing.assert_allclose(terms[1].grad, (terms[2].value - terms[0].value) / 2e-4, rtol=1e-4, atol=1e-8)
        np.testing.assert_allclose(terms[1].curvature, (terms[2].grad - terms[0].grad) / 2e-4, rtol=1e-3, atol=1e-6)


def test_the_probes_and_the_next_sweep_share_one_latent_product_and_a_stale_one_is_never_used():
    """A learnt b probes Σ log Z_b at several b with one q(v), then sweeps with that q(v): ``A'm`` is computed
    once for them (cached in the local state), and a probe after the first needs no block. The cache answers
    only for the q(v) it was computed at: with a cache of another q(v), or after a checkpoint (which drops
    it), the statistics equal those from scratch."""
    X, bags, y, _ = large_bags(0, n_bags=6, sizes=(40, 60))
    index = BagIndex.from_ids(bags)
    updates = ProbitMILUpdates(gp=SparseGP.build(RBF(1.0, 2.0), X[:8]), learn_prior_mean=True)
    block = updates.prepare(BagBlock(X=X[index.order], offsets=index.offsets, labels=y[index.order][index.offsets[:-1]]))
    rng = np.random.default_rng(0)
    q, other = (ProbitQ(mean=rng.normal(size=8), cov=np.eye(8), prior_mean=-1.0) for _ in range(2))
    scratch = updates.init_local(block)

    assert step_from_local(updates, scratch, PriorMeanProbe(q=q, prior_mean=-0.5)) is None  # nothing cached yet
    probe, local = updates.partition_step(block, scratch, PriorMeanProbe(q=q, prior_mean=-0.5))
    again, kept = step_from_local(updates, local, PriorMeanProbe(q=q, prior_mean=-0.5))  # no block
    assert kept is local and again == probe
    assert updates.partition_step(block, local, PriorMeanProbe(q=q, prior_mean=0.3))[0] == \
        updates.partition_step(block, scratch, PriorMeanProbe(q=q, prior_mean=0.3))[0]
    stats, after = updates.partition_step(block, local, q)
    assert after.inputs is local.inputs  # the sweep with the same q(v) reused the product
    fresh = updates.partition_step(block, scratch, q)[0]
    assert np.array_equal(stats.shift, fresh.shift) and stats.elbo == fresh.elbo
    assert step_from_local(updates, after, q) is None  # a sweep needs the block

    assert step_from_local(updates, after, PriorMeanProbe(q=other, prior_mean=-0.5)) is None
    stale_probe, renewed = updates.partition_step(block, after, PriorMeanProbe(q=other, prior_mean=-0.5))
    assert stale_probe == updates.partition_step(block, scratch, PriorMeanProbe(q=other, prior_mean=-0.5))[0]
    assert renewed.inputs.is_for(other) and not renewed.inputs.is_for(q)

    restored = persist.loads(persist.dumps(after))  # a checkpoint keeps the warm start, not the cache
    assert restored.inputs is None and np.array_equal(restored.warm, after.warm, equal_nan=True)
    assert updates.partition_step(block, restored, q)[0].elbo == stats.elbo


def test_each_bags_moments_and_prior_mean_terms_are_its_own_whatever_bags_share_its_partition():
    """The positive bags' terms are computed on their rows only: a partition's E[m], log Z_b and Σ log Z_b(b)
    terms equal those of its bags taken one at a time (all-negative and all-positive partitions included)."""
    rng = np.random.default_rng(3)
    sizes, labels = np.array([5, 9, 1, 7, 4]), np.array([0, 1, 1, 0, 1])
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    X = rng.normal(size=(offsets[-1], 3))
    updates = ProbitMILUpdates(gp=SparseGP.build(RBF(1.0, 1.0), X[:6]), learn_prior_mean=True)
    q = ProbitQ(mean=rng.normal(size=6), cov=np.eye(6), prior_mean=-1.5)

    def moments(rows, offs, labs):
        block = updates.prepare(BagBlock(X=X[rows], offsets=offs, labels=labs))
        mu = PriorMeanInputs.at(block, q).latent - 1.5 * block.ones_smoothed
        expected, log_z, _ = updates.truncated_means(block, mu, np.zeros(offs[-1]))
        return expected, log_z, updates.partition_step(block, updates.init_local(block), PriorMeanProbe(q=q, prior_mean=-0.7))[0]

    whole = moments(slice(None), offsets, labels)
    alone = [moments(slice(a, z), np.array([0, z - a]), labels[[b]]) for b, (a, z) in enumerate(zip(offsets[:-1], offsets[1:]))]
    np.testing.assert_allclose(whole[0], np.concatenate([m[0] for m in alone]), rtol=1e-12)
    np.testing.assert_allclose(whole[1], np.concatenate([m[1] for m in alone]), rtol=1e-12)
    for field in ("value", "grad", "curvature"):
        np.testing.assert_allclose(getattr(whole[2], field), sum(getattr(m[2], field) for m in alone), rtol=1e-10)
