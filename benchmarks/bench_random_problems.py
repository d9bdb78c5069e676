"""Held-out bag AUC of the defaults on randomly drawn MIL problems (issue 15: "data you don't have").

The curated sets of ``bench_accuracy.py`` were added one by one, each for a regime someone thought
of. Here every problem is drawn from a seed: a witness concept (``linear``: beyond a threshold
along a direction; ``cluster``: a blob away from the background; ``norm``: outside a sphere;
``xor``: a sign pattern of two features; ``shift``: a mean shift), 5–200 features of which 1–10
carry it (``xor``: two), bags of 2–8 … 50–200 instances, 1–60 % witnesses in a positive bag, 20 or 50 %
positive bags, 60–200 bags, with or without distractor blobs in every bag, and bag size
unrelated to the label, larger in positive bags or larger in negative ones (``size_link``).
Each method sees the same stratified 5-fold CV over bags (features standardised on the training
fold) through ``bench_accuracy``'s methods; one JSON line per problem and CV seed, then a table.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD:/tmp/vgpmil_deps python benchmarks/bench_random_problems.py \
        --problems 0 20 --methods lr_mean_max vgpmil_2017 vgpmil gvgpmil --reference /tmp/vgpmil_ref
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_accuracy  # noqa: E402

CONCEPTS = ("linear", "cluster", "norm", "xor", "shift")
SIZE_LINKS = ("none", "positive_larger", "negative_larger")


def draw_problem(seed: int) -> tuple[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray], dict]:
    """``(X, bags, y, instance labels)`` and the settings drawn from ``seed`` (the concept cycles
    with the seed, so any 5 consecutive seeds hold each once)."""
    rng = np.random.default_rng(seed)
    settings = dict(problem=seed, concept=CONCEPTS[seed % len(CONCEPTS)], D=int(rng.choice([5, 20, 60, 200])),
                    informative=int(rng.choice([1, 2, 3, 5, 10])),
                    size=[(2, 8), (5, 25), (20, 80), (50, 200)][int(rng.integers(4))],
                    witnesses=[(0.01, 0.05), (0.05, 0.2), (0.2, 0.6)][int(rng.integers(3))],
                    positive=float(rng.choice([0.2, 0.5])), bags=int(rng.choice([60, 120, 200])),
                    size_link=SIZE_LINKS[int(rng.integers(3))], distractors=int(rng.choice([0, 3])))
    D, concept = settings["D"], settings["concept"]
    k = settings["informative"] = min(D, settings["informative"])  # the features that carry it (xor: the first two)
    centres = 3.0 * rng.standard_normal((settings["distractors"], D))
    direction = rng.standard_normal(k)
    direction /= np.linalg.norm(direction)
    blob = 2.5 * rng.standard_normal(k)

    def instances(witness: np.ndarray) -> np.ndarray:
        n, w = witness.size, witness == 1
        x = rng.standard_normal((n, D))
        if settings["distractors"]:
            which = rng.integers(-1, settings["distractors"], n)
            x[which >= 0] += centres[which[which >= 0]]
        part = x[:, :k]  # a view: the concept is written into x
        if concept == "linear":
            along = part @ direction
            target = np.where(w, 1.3 + np.abs(rng.standard_normal(n)), np.minimum(along, 1.0))
            part += np.outer(target - along, direction)
        elif concept == "cluster":
            part[w] = blob + 0.7 * rng.standard_normal((w.sum(), k))
        elif concept == "norm":
            radius = np.linalg.norm(part, axis=1) + 1e-9
            target = np.where(w, 1.6 + 0.5 * np.abs(rng.standard_normal(n)), np.minimum(radius / np.sqrt(k), 1.2)) * np.sqrt(k)
            part *= (target / radius)[:, None]
        elif concept == "xor" and D >= 2:
            wrong = (np.sign(x[:, 0] * x[:, 1]) > 0) != w
            x[wrong, 0] *= -1
        elif concept == "shift":
            part[w] += 1.5
        return x

    lo, hi = settings["size"]
    middle = lo + (hi - lo) // 2
    labels = (rng.random(settings["bags"]) < settings["positive"]).astype(int)
    labels[:4] = [0, 1, 0, 1]
    X, bags, y, inst = [], [], [], []
    for b, label in enumerate(labels):
        larger = {"positive_larger": label == 1, "negative_larger": label == 0}.get(settings["size_link"], False)
        n = int(rng.integers(middle if larger else lo, hi))
        n_witness = max(1, int(round(n * rng.uniform(*settings["witnesses"])))) if label else 0
        witness = np.r_[np.ones(n_witness, int), np.zeros(n - n_witness, int)]
        X.append(instances(witness))
        bags.append(np.full(n, b))
        y.append(np.full(n, label))
        inst.append(witness)
    return (np.concatenate(X), np.concatenate(bags), np.concatenate(y), np.concatenate(inst)), settings


def evaluate(seed: int, methods: list[str], cv_seed: int) -> dict:
    """Bag AUC (each method's own default rule) per fold of one problem."""
    problem, settings = draw_problem(seed)
    aucs: dict[str, list[float]] = {m: [] for m in methods}
    seconds = dict.fromkeys(methods, 0.0)
    for _, train, test in bench_accuracy.stratified_folds(*problem, 5, cv_seed):
        for method in methods:
            start = time.perf_counter()
            prediction = bench_accuracy.METHODS[method](train, test)
            seconds[method] += time.perf_counter() - start
            aucs[method].append(bench_accuracy.primary_bag_auc(prediction, test))
    return dict(settings, cv_seed=cv_seed, auc={m: float(np.mean(a)) for m, a in aucs.items()}, folds=aucs,
                seconds={m: round(s, 1) for m, s in seconds.items()})


def print_table(rows: list[dict], methods: list[str]) -> None:
    """Mean bag AUC per method over the problems, by how bag size relates to the label."""
    print("\n| problems | n | " + " | ".join(methods) + " |")
    print("|---|---|" + "---|" * len(methods))
    for link in (None, *SIZE_LINKS):
        chosen = [r for r in rows if link is None or r["size_link"] == link]
        if chosen:
            print(f"| {link or 'all'} | {len(chosen)} | " + " | ".join(f"{np.mean([r['auc'][m] for r in chosen]):.3f}" for m in methods) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problems", type=int, nargs=2, default=(0, 20), metavar=("FIRST", "STOP"))
    parser.add_argument("--methods", nargs="+", default=["lr_mean_max", "vgpmil", "gvgpmil"])
    parser.add_argument("--cv-seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--reference", type=Path, help="folder with the public 2017 vgpmil.py (adds vgpmil_2017)")
    args = parser.parse_args()
    if args.reference is not None:
        bench_accuracy.METHODS["vgpmil_2017"] = bench_accuracy.reference_method(args.reference)
    unknown = sorted(set(args.methods) - set(bench_accuracy.METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown} (vgpmil_2017 needs --reference)")
    rows = []
    for seed in range(*args.problems):
        for cv_seed in args.cv_seeds:
            rows.append(evaluate(seed, args.methods, cv_seed))
            print(json.dumps(rows[-1]), flush=True)
    print_table(rows, args.methods)


if __name__ == "__main__":
    main()
