"""Evidence for the probit family (issue 3): MUSK 5-fold bag AUC, and a synthetic tissue
experiment with spatially contiguous lesions comparing VGPMIL-PR and VGPMIL-PR-I (λ grid,
diagonal vs mean-field moments), after seed 002's Tables 1–3. Prints Markdown tables.

    python benchmarks/bench_probit.py                 # both parts (~6 min on 2 cores)
    python benchmarks/bench_probit.py --part musk     # or --part tissue
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np
from sklearn.metrics import accuracy_score, f1_score
from sklearn.preprocessing import StandardScaler

from mil_core import RBF, VGPMIL, VGPMILPR, VGPMILPRI
from mil_core.model_selection import cross_validate_bags

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def musk(folds: int, n_inducing: int, max_iter: int) -> None:
    print("| dataset | model | M | bag AUC | bag accuracy | fit s/fold |\n|---|---|---|---|---|---|")
    for name in ("musk1", "musk2"):
        table = np.loadtxt(DATA / f"{name}.csv", delimiter=",")
        X, bags, y = table[:, 2:], table[:, 1].astype(int), table[:, 0].astype(int)
        for label, model, kwargs in (
            ("VGPMIL", VGPMIL(n_inducing=n_inducing, kernel=RBF(1.0), max_iter=max_iter, random_state=0), {"method": "probit"}),
            ("VGPMILPR", VGPMILPR(n_inducing=n_inducing, kernel=RBF(1.0), max_iter=max_iter, random_state=0), {}),
        ):
            res = cross_validate_bags(model, X, bags, y, n_splits=folds, predict_kwargs=kwargs)
            auc = np.array([r["bag_auc"] for r in res])
            acc = np.array([r["bag_accuracy"] for r in res])
            fit = np.mean([r["fit_time"] for r in res])
            print(f"| {name} | {label} | {n_inducing} | {auc.mean():.3f} ± {auc.std():.3f} | {acc.mean():.3f} ± {acc.std():.3f} | {fit:.1f} |", flush=True)


def tissue(n_bags: int, side: int, seed: int):
    """Bags = side×side tile grids; half the bags hold 1–2 disc lesions (radius 2–4). Tile
    features: 8-D N(0, I), lesion tiles shifted by 1.5 along the first axis (noisy, so that
    neighbours carry information). Returns X, bag ids, bag labels per tile, tile labels, coords."""
    rng = np.random.default_rng(seed)
    r, c = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    coords = np.column_stack([r.ravel(), c.ravel()])
    X, bags, y, h, xy = [], [], [], [], []
    for b in range(n_bags):
        label = b % 2
        lesion = np.zeros(side * side, dtype=bool)
        for _ in range(rng.integers(1, 3) if label else 0):
            centre, radius = rng.integers(3, side - 3, size=2), rng.integers(2, 5)
            lesion |= np.hypot(*(coords - centre).T) <= radius
        x = rng.normal(size=(side * side, 8))
        x[:, 0] += 1.5 * lesion
        X.append(x), bags.append(np.full(side * side, b)), y.append(np.full(side * side, label)), h.append(lesion), xy.append(coords)
    return np.concatenate(X), np.concatenate(bags), np.concatenate(y), np.concatenate(h).astype(int), np.concatenate(xy)


def tissue_experiment(n_inducing: int, max_iter: int, lams: list[float], n_mc: int) -> None:
    X, bags, y, h, coords = tissue(40, 20, seed=0)
    Xt, bags_t, y_t, h_t, coords_t = tissue(20, 20, seed=1)
    scaler = StandardScaler().fit(X)
    X, Xt = scaler.transform(X), scaler.transform(Xt)
    truth = np.array([y_t[bags_t == k][0] for k in np.unique(bags_t)])
    print(
        f"train {len(np.unique(bags))} bags / test {len(truth)} bags of {X.shape[0] // 40} tiles; lesion tiles in positive test bags: {h_t[y_t == 1].mean():.2f}\n"
    )
    print("| model | λ | E[m] | inst. acc | inst. F1 | bag acc | bag F1 | FP bags / neg | FN bags / pos | fit s | predict s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    configs = [("VGPMILPR", None, "—")] + [("VGPMILPRI", lam, mom) for mom in ("diagonal", "mean_field") for lam in lams]
    for name, lam, moments in configs:
        common = dict(n_inducing=n_inducing, max_iter=max_iter, random_state=0, n_mc_samples=n_mc)
        start = time.perf_counter()
        if lam is None:
            model = VGPMILPR(**common).fit(X, bags, y)
            fit_s = time.perf_counter() - start
            start = time.perf_counter()
            _, p_bag = model.predict_bag_proba(Xt, bags_t)
        else:
            model = VGPMILPRI(lam=lam, moments=moments, **common).fit(X, bags, y, coords=coords)
            fit_s = time.perf_counter() - start
            start = time.perf_counter()
            _, p_bag = model.predict_bag_proba(Xt, bags_t, coords=coords_t)
        p_inst = model.predict_instance_proba(Xt)
        pred_s = time.perf_counter() - start
        hat_inst, hat_bag = p_inst > 0.5, p_bag > 0.5
        fp = int(np.sum(hat_bag & (truth == 0)))
        fn = int(np.sum(~hat_bag & (truth == 1)))
        print(
            f"| {name} | {'—' if lam is None else lam} | {moments} | {accuracy_score(h_t, hat_inst):.4f} | {f1_score(h_t, hat_inst):.4f} | "
            f"{accuracy_score(truth, hat_bag):.3f} | {f1_score(truth, hat_bag):.3f} | {fp}/{np.sum(truth == 0)} | {fn}/{np.sum(truth == 1)} | {fit_s:.1f} | {pred_s:.1f} |",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["musk", "tissue", "all"], default="all")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--inducing", type=int, default=50)
    parser.add_argument("--max-iter", type=int, default=100)
    parser.add_argument("--lams", nargs="+", type=float, default=[0.1, 0.5, 1.0, 5.0])
    parser.add_argument("--mc", type=int, default=100, help="Monte Carlo draws per bag for PR-I orthant probabilities")
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}\n")
    if args.part in ("musk", "all"):
        musk(args.folds, args.inducing, args.max_iter)
        print()
    if args.part in ("tissue", "all"):
        tissue_experiment(args.inducing, args.max_iter, args.lams, args.mc)


if __name__ == "__main__":
    main()
