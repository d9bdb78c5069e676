"""VWSGP and AbSMIL evidence (issue 4). Prints Markdown tables for docs/BENCHMARKS.md.

1. MUSK1/MUSK2: stratified 5-fold CV over bags (features standardised per training fold) —
   VWSGP bag AUC/accuracy (seed 001), AbSMIL bag accuracy (seed 004).
2. Tilted digits (seed 004, Sec. V-A with scikit-learn digits for MNIST): 0s and 1s tilted
   right are the positive relevant instances, tilted left the negative ones, 2s tilted either
   way are irrelevant; bag accuracy and instance attribute accuracy on held-out bags built from
   held-out images.
3. Runtime per Pegasos epoch against n_max (seed 004, Fig. 4(a)): d = 30, C = 2,
   λ_q = 1e-6, λ_e = 1e-2.

    python benchmarks/bench_vwsgp_absmil.py            # everything (~5 min on 2 cores)
    python benchmarks/bench_vwsgp_absmil.py --parts digits runtime --quick
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np
from scipy.ndimage import rotate, zoom
from sklearn.datasets import load_digits
from sklearn.preprocessing import StandardScaler

from mil_core import RBF, VWSGP, AbSMIL
from mil_core.model_selection import cross_validate_bags

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def load_musk(name: str):
    table = np.loadtxt(DATA / f"{name}.csv", delimiter=",")
    return table[:, 2:], table[:, 1].astype(int), table[:, 0].astype(int)


def mean_std(values) -> str:
    values = np.asarray(values, dtype=float)
    return f"{values.mean():.3f} ± {values.std():.3f}"


def musk_table(quick: bool) -> None:
    models = {
        "VWSGP M=50": VWSGP(n_inducing=50, max_iter=50, random_state=0),
        "VWSGP M=100": VWSGP(n_inducing=100, max_iter=50, random_state=0),
        "VWSGP M=100 v=5": VWSGP(n_inducing=100, kernel=RBF(variance=5.0), max_iter=50, random_state=0),
        "AbSMIL n_max=10%": AbSMIL(n_max=0.1, lambda_q=1e-3, max_iter=100, random_state=0),
        "AbSMIL no constraint": AbSMIL(n_max=None, lambda_q=1e-3, max_iter=100, random_state=0),
    }
    if quick:
        models = {k: v for k, v in models.items() if k in ("VWSGP M=50", "AbSMIL no constraint")}
    print("| dataset | model | bag_auc | bag_accuracy | fit_time s |\n|---|---|---|---|---|")
    for dataset in ("musk1", "musk2"):
        X, bags, y = load_musk(dataset)
        for name, model in models.items():
            folds = cross_validate_bags(model, X, bags, y, n_splits=5, random_state=0)
            print(
                f"| {dataset} | {name} | {mean_std([f['bag_auc'] for f in folds])} | "
                f"{mean_std([f['bag_accuracy'] for f in folds])} | {np.mean([f['fit_time'] for f in folds]):.1f} |",
                flush=True,
            )


def tilted_digit_pools(seed: int, angle: float = 25.0):
    """Images of 0, 1 (relevant) and 2 (irrelevant), upsampled to 16×16, split in halves
    (train / test pools); each image tilted right (−angle, clockwise) and left (+angle)."""
    digits = load_digits()
    rng = np.random.default_rng(seed)
    pools = {"train": {}, "test": {}}
    for digit in (0, 1, 2):
        idx = rng.permutation(np.flatnonzero(digits.target == digit))
        half = idx.shape[0] // 2
        for split, chosen in (("train", idx[:half]), ("test", idx[half:])):
            images = [zoom(digits.images[i], 2, order=1) for i in chosen]
            right = np.array([rotate(im, -angle, reshape=False, order=1).ravel() for im in images])
            left = np.array([rotate(im, angle, reshape=False, order=1).ravel() for im in images])
            pools[split][digit] = (right, left)
    return pools


def tilted_digit_bags(pools, n_bags: int, bag_size: int, seed: int):
    """Balanced bags: 1–5 relevant 0/1s tilted right (positive) or left (negative), the rest 2s
    tilted at random. Returns X, bag ids, bag label per instance, attribute group (0, 1 = +, 2 = −)."""
    rng = np.random.default_rng(seed)
    X, bags, y, group = [], [], [], []
    for b in range(n_bags):
        label, n_rel = b % 2, int(rng.integers(1, 6))
        side = 0 if label else 1  # right-tilted images are the positive attribute
        for _ in range(n_rel):
            images = pools[int(rng.integers(0, 2))][side]
            X.append(images[rng.integers(images.shape[0])])
        for _ in range(bag_size - n_rel):
            images = pools[2][int(rng.integers(0, 2))]
            X.append(images[rng.integers(images.shape[0])])
        bags += [b] * bag_size
        y += [label] * bag_size
        group += [1 if label else 2] * n_rel + [0] * (bag_size - n_rel)
    return np.array(X), np.array(bags), np.array(y), np.array(group)


def digits_table(quick: bool) -> None:
    seeds = (0,) if quick else (0, 1, 2)
    configs = {
        "n_max=5 (true max)": dict(n_max=5),
        "n_max=25%": dict(n_max=0.25),
        "no constraint": dict(n_max=None),
        "n_max=5, C=4": dict(n_max=5, n_attributes=4),
        "n_max=5, Pegasos": dict(n_max=5, solver="pegasos", max_iter=20),
        "n_max=5, RFF k=300": dict(n_max=5, n_random_features=300, rff_scale=0.5 / np.sqrt(256)),
    }
    if quick:
        configs = {k: v for k, v in configs.items() if k in ("n_max=5 (true max)", "no constraint")}
    print("| AbSMIL | bag_accuracy | instance attribute accuracy (Eq. 1 argmax) | instance attribute accuracy (bag posterior) | relevant-instance recall | fit_time s |")
    print("|---|---|---|---|---|---|")
    for name, config in configs.items():
        rows = []
        for seed in seeds:
            pools = tilted_digit_pools(seed)
            X, bags, y, _ = tilted_digit_bags(pools["train"], 200, 20, seed)
            X_test, bags_test, y_test, group_test = tilted_digit_bags(pools["test"], 200, 20, seed + 100)
            scaler = StandardScaler().fit(X)
            params = dict(lambda_q=1e-3, lambda_e=1e-2, max_iter=300, random_state=seed) | config
            start = time.perf_counter()
            model = AbSMIL(**params).fit(scaler.transform(X), bags, y)
            fit_time = time.perf_counter() - start
            Xt = scaler.transform(X_test)
            keys, p = model.predict_bag_proba(Xt, bags_test)
            truth = np.array([y_test[bags_test == k][0] for k in keys])
            half = model.n_attributes // 2
            to_group = lambda z: np.where(z == 0, 0, np.where(z <= half, 1, 2))  # noqa: E731
            prior_groups = to_group(model.predict_attributes(Xt))
            bag_groups = to_group(model.predict_attributes(Xt, bags_test))
            relevant = group_test > 0
            rows.append(
                (np.mean((p >= 0.5) == truth), np.mean(prior_groups == group_test), np.mean(bag_groups == group_test),
                 np.mean(prior_groups[relevant] == group_test[relevant]), fit_time)
            )
        rows = np.array(rows)
        print(f"| {name} | " + " | ".join(mean_std(rows[:, i]) for i in range(4)) + f" | {rows[:, 4].mean():.1f} |", flush=True)


def runtime_table(quick: bool) -> None:
    """Seconds per Pegasos epoch (B bags, one bag per step) against n_max, d = 30 first pixels."""
    sizes = (500, 1000) if quick else (500, 1000, 2000)
    grid = (2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    n_bags = 10
    pools = tilted_digit_pools(0)["train"]
    print("| n_b | " + " | ".join(f"n_max={n}" for n in grid) + " |\n|---|" + "---|" * len(grid))
    for n_b in sizes:
        X, bags, y, _ = tilted_digit_bags(pools, n_bags, n_b, seed=0)
        X = StandardScaler().fit_transform(X[:, 100:130])  # 30 pixels from the image's middle rows
        cells = []
        for n_max in grid:
            if n_max > n_b:
                cells.append("—")
                continue
            model = AbSMIL(n_max=n_max, solver="pegasos", lambda_q=1e-6, lambda_e=1e-2, max_iter=2, tol=0.0, random_state=0)
            start = time.perf_counter()
            model.fit(X, bags, y)
            cells.append(f"{(time.perf_counter() - start) / model.n_iter_:.3f}")
        print(f"| {n_b} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["musk", "digits", "runtime"], choices=["musk", "digits", "runtime"])
    parser.add_argument("--quick", action="store_true", help="fewer configurations and seeds")
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, python {platform.python_version()}")
    start = time.perf_counter()
    for part in args.parts:
        {"musk": musk_table, "digits": digits_table, "runtime": runtime_table}[part](args.quick)
        print(f"\n({part}: {time.perf_counter() - start:.0f} s so far)\n", flush=True)


if __name__ == "__main__":
    main()
