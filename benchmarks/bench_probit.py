"""Evidence for the probit family (issue 3): MUSK 5-fold bag AUC, and a synthetic tissue
experiment with spatially contiguous lesions comparing VGPMIL-PR and VGPMIL-PR-I (λ grid,
diagonal vs mean-field moments), after seed 002's Tables 1–3. Prints Markdown tables.

    python benchmarks/bench_probit.py --part musk
    python benchmarks/bench_probit.py --part tissue   # 3 min 24 s on 2 shared cores (3 draws × 9 fits)
    python benchmarks/bench_probit.py --part defaults # VGPMILPR() / VGPMILPRI() on tissue bags of varying size
"""

from __future__ import annotations

import argparse
import platform
import time
from pathlib import Path

import numpy as np
from sklearn.metrics import accuracy_score, f1_score, roc_auc_score
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


def tissue(n_bags: int, side: int, shift: float, seed: int, n_features: int = 8):
    """Synthetic tissue after seed 002 Sec. 3: bags = side×side tile grids, every other bag positive
    with 1–2 disc lesions (centre uniform in the grid, radius uniform in [1.5, 3.5], so spatially
    contiguous blobs), negative bags none. Tile features: N(0, I) in ``n_features`` dimensions,
    lesion tiles shifted by ``shift`` along the first axis (so a single tile is ambiguous and its
    neighbours carry information). Returns X, bag ids, bag label per tile, tile labels, coords."""
    rng = np.random.default_rng(seed)
    r, c = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    grid = np.column_stack([r.ravel(), c.ravel()])
    lesions = []
    for b in range(n_bags):
        lesion = np.zeros(side * side, dtype=bool)
        for _ in range(rng.integers(1, 3) if b % 2 else 0):
            centre, radius = rng.uniform(1.5, side - 2.5, size=2), rng.uniform(1.5, 3.5)
            lesion |= np.hypot(*(grid - centre).T) <= radius
        lesions.append(lesion)
    h = np.concatenate(lesions).astype(int)
    X = rng.normal(size=(h.shape[0], n_features))
    X[:, 0] += shift * h
    bags = np.repeat(np.arange(n_bags), side * side)
    return X, bags, bags % 2, h, np.tile(grid, (n_bags, 1))


def tissue_of_varying_size(n_bags: int, sides: tuple[int, int], shift: float, seed: int, n_features: int = 8):
    """:func:`tissue` with each bag's grid side uniform in ``sides`` (so bag sizes vary ~6×; the
    lesions do not grow with the bag, so a larger positive bag is relatively less positive)."""
    rng = np.random.default_rng(seed)
    X, bags, h, coords = [], [], [], []
    for b in range(n_bags):
        side = int(rng.integers(sides[0], sides[1] + 1))
        r, c = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
        grid = np.column_stack([r.ravel(), c.ravel()])
        lesion = np.zeros(side * side, dtype=bool)
        for _ in range(rng.integers(1, 3) if b % 2 else 0):
            centre, radius = rng.uniform(1.5, side - 2.5, size=2), rng.uniform(1.5, 3.5)
            lesion |= np.hypot(*(grid - centre).T) <= radius
        x = rng.normal(size=(side * side, n_features))
        x[:, 0] += shift * lesion
        X.append(x), bags.append(np.full(side * side, b)), h.append(lesion.astype(int)), coords.append(grid)
    bags = np.concatenate(bags)
    return np.concatenate(X), bags, bags % 2, np.concatenate(h), np.concatenate(coords)


def defaults_experiment(n_bags: int, sides: tuple[int, int], shift: float, seeds: int) -> None:
    """Default ``VGPMILPR()`` and ``VGPMILPRI()`` (kernel choice, ``bag_rule="auto"``) against
    the paper's setting (``kernel=RBF(1)``, 200 sweeps, orthant rule), every rule scored on each fit:
    bag AUC, within-class Spearman correlation of bag score with bag size, instance AUC (PR-I: in
    context), fit seconds; mean ± sd over ``seeds`` train/test draws."""
    from scipy.stats import spearmanr

    from mil_core.models.probit import PROBIT_BAG_RULES

    configs = {
        "VGPMILPR()": lambda seed: VGPMILPR(random_state=seed),
        "VGPMILPRI()": lambda seed: VGPMILPRI(random_state=seed),
        "VGPMILPRI(kernel=RBF(1), bag_rule='orthant')": lambda seed: VGPMILPRI(kernel=RBF(1.0), bag_rule="orthant", random_state=seed),
    }
    rows: dict[tuple[str, str], list[tuple[float, ...]]] = {}
    chosen: dict[str, list[str]] = {}
    for seed in range(seeds):
        data = tissue_of_varying_size(n_bags, sides, shift, 2 * seed)
        test = tissue_of_varying_size(n_bags, sides, shift, 2 * seed + 1)
        scaler = StandardScaler().fit(data[0])
        X, Xt = scaler.transform(data[0]), scaler.transform(test[0])
        bags_t, h_t, coords_t = test[1], test[3], test[4]
        truth = np.unique(bags_t) % 2
        sizes = np.bincount(bags_t)
        for name, make in configs.items():
            model = make(seed)
            coupled = isinstance(model, VGPMILPRI)
            start = time.perf_counter()
            model.fit(X, data[1], data[2], coords=data[4] if coupled else None)
            fit_s = time.perf_counter() - start
            context = dict(coords=coords_t) if coupled else {}
            p_inst = model.predict_instance_proba(Xt, bag_ids=bags_t, **context) if coupled else model.predict_instance_proba(Xt)
            for rule in ("default", *PROBIT_BAG_RULES):
                p = model.predict_bag_proba(Xt, bags_t, **context, **({} if rule == "default" else {"rule": rule}))[1]
                rho = np.mean([spearmanr(p[truth == c], sizes[truth == c])[0] for c in (0, 1)])
                rows.setdefault((name, rule), []).append((roc_auc_score(truth, p), rho, roc_auc_score(h_t, p_inst), fit_s, model.kernel_.variance))
            chosen.setdefault(name, []).append(model.bag_rule_)
        print(f"seed {seed} done", flush=True)
    print(f"\n{seeds} draws × ({n_bags} training + {n_bags} test bags of {sides[0]}²–{sides[1]}² tiles, lesion shift {shift})\n")
    print("| model | bag rule | bag AUC | size ρ (within class) | instance AUC | fit s | chosen v |\n|---|---|---|---|---|---|---|")
    for (name, rule), values in rows.items():
        a = np.array(values)
        print(f"| {name} | {rule} | {a[:, 0].mean():.3f} ± {a[:, 0].std():.3f} | {a[:, 1].mean():+.2f} | {a[:, 2].mean():.3f} | "
              f"{a[:, 3].mean():.1f} | {np.median(a[:, 4]):g} |", flush=True)
    print("\nrule of each draw (bag_rule_): " + "; ".join(f"{name} {', '.join(rules)}" for name, rules in chosen.items()))


INSTANCE_COLUMNS = {
    "inst. AUC": "inst_auc", "inst. acc": "inst_acc", "inst. F1": "inst_f1",
    "AUC, Σ*": "ctx_auc", "acc, Σ*": "ctx_acc", "F1, Σ*": "ctx_f1",
}
BAG_COLUMNS = {
    "bag AUC": "bag_auc", "bag acc": "bag_acc", "bag F1": "bag_f1", "FP bags": "fp_bags", "FN bags": "fn_bags",
    "AUC, Σ*=I": "bag_auc_indep", "FP, Σ*=I": "fp_bags_indep", "fit s": "fit_s", "predict s": "predict_s",
}


def tissue_run(model, data: tuple, test: tuple, lam: float | None) -> dict[str, float]:
    """Fit on ``data`` (VGPMILPR if ``lam`` is None), score on ``test``: AUCs and metrics at 0.5.
    ``ctx_*``: instance metrics with Eq. 25 in bag context (``predict_instance_proba(..., coords=)``);
    ``*_indep``: bag predictions of the same fit with ``Σ* = I`` (test coords withheld), to separate
    what the coupling does in training from what it does in the bag probability (Eq. 26)."""
    X, bags, y, _, coords = data
    Xt, bags_t, _, h_t, coords_t = test
    coupled = lam is not None
    start = time.perf_counter()
    model.fit(X, bags, y, coords=coords if coupled else None)
    fit_s = time.perf_counter() - start
    start = time.perf_counter()
    keys, p_bag = model.predict_bag_proba(Xt, bags_t, coords=coords_t if coupled else None, rule="orthant")
    p_inst = model.predict_instance_proba(Xt)
    predict_s = time.perf_counter() - start
    truth = keys % 2
    p_ctx = model.predict_instance_proba(Xt, bag_ids=bags_t, coords=coords_t) if coupled else p_inst
    p_bag_indep = model.predict_bag_proba(Xt, bags_t, rule="orthant")[1] if coupled else p_bag
    hat_inst, hat_ctx, hat_bag = p_inst > 0.5, p_ctx > 0.5, p_bag > 0.5
    return dict(
        inst_auc=roc_auc_score(h_t, p_inst),
        inst_acc=accuracy_score(h_t, hat_inst),
        inst_f1=f1_score(h_t, hat_inst, zero_division=0.0),
        ctx_auc=roc_auc_score(h_t, p_ctx),
        ctx_acc=accuracy_score(h_t, hat_ctx),
        ctx_f1=f1_score(h_t, hat_ctx, zero_division=0.0),
        bag_auc=roc_auc_score(truth, p_bag),
        bag_acc=accuracy_score(truth, hat_bag),
        bag_f1=f1_score(truth, hat_bag, zero_division=0.0),
        fp_bags=float(np.sum(hat_bag & (truth == 0))),
        fn_bags=float(np.sum(~hat_bag & (truth == 1))),
        bag_auc_indep=roc_auc_score(truth, p_bag_indep),
        fp_bags_indep=float(np.sum((p_bag_indep > 0.5) & (truth == 0))),
        fit_s=fit_s,
        predict_s=predict_s,
    )


def print_table(results: dict[tuple, list[dict[str, float]]], columns: dict[str, str]) -> None:
    """One Markdown row per model configuration: mean ± sd over the draws."""
    print("| model | λ | E[m] | " + " | ".join(columns) + " |")
    print("|---|---|---|" + "---|" * len(columns))
    for (name, lam, moments), runs in results.items():
        cells = []
        for metric in columns.values():
            values = np.array([run[metric] for run in runs])
            digits = 1 if metric in ("fp_bags", "fn_bags", "fp_bags_indep", "fit_s", "predict_s") else 3
            cells.append(f"{values.mean():.{digits}f} ± {values.std():.{digits}f}")
        print(f"| {name} | {'—' if lam is None else lam} | {moments} | " + " | ".join(cells) + " |", flush=True)


def tissue_experiment(
    n_bags: int, side: int, shift: float, seeds: int, n_inducing: int, variance: float, max_iter: int, lams: list[float], n_mc: int
) -> None:
    """VGPMILPR and VGPMILPRI (λ grid × diagonal / mean-field moments) on ``seeds`` independent
    train/test draws (``n_bags`` bags each); mean ± sd over the draws."""
    configs = [("VGPMILPR", None, "—")] + [("VGPMILPRI", lam, mom) for mom in ("diagonal", "mean_field") for lam in lams]
    results: dict[tuple, list[dict[str, float]]] = {config: [] for config in configs}
    for seed in range(seeds):
        data, test = tissue(n_bags, side, shift, 2 * seed), tissue(n_bags, side, shift, 2 * seed + 1)
        scaler = StandardScaler().fit(data[0])
        data, test = (scaler.transform(data[0]), *data[1:]), (scaler.transform(test[0]), *test[1:])
        common = dict(n_inducing=n_inducing, kernel=RBF(variance), max_iter=max_iter, random_state=seed, n_mc_samples=n_mc)
        for name, lam, moments in configs:
            model = VGPMILPR(**common) if lam is None else VGPMILPRI(lam=lam, moments=moments, **common)
            results[(name, lam, moments)].append(tissue_run(model, data, test, lam))
        print(f"seed {seed}: lesion tiles in positive test bags {test[3][test[2] == 1].mean():.3f}", flush=True)
    print(
        f"\n{seeds} draws × ({n_bags} training + {n_bags} test bags of {side}×{side} tiles); mean ± sd over draws; "
        f"FP per {n_bags - n_bags // 2} negative, FN per {n_bags // 2} positive test bags\n\nInstances (Table 1 pattern):\n"
    )
    print_table(results, INSTANCE_COLUMNS)
    print("\nBags (Tables 2–3 pattern):\n")
    print_table(results, BAG_COLUMNS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["musk", "tissue", "defaults", "all"], default="all")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--inducing", type=int, default=50)
    parser.add_argument("--max-iter", type=int, default=100)
    parser.add_argument("--lams", nargs="+", type=float, default=[0.1, 0.5, 1.0, 5.0])
    parser.add_argument("--mc", type=int, default=256, help="GHK draws per bag for PR-I orthant probabilities")
    parser.add_argument("--tissue-bags", type=int, default=60, help="training (and test) bags per draw")
    parser.add_argument("--tissue-side", type=int, default=12, help="tiles per bag = side²")
    parser.add_argument("--tissue-shift", type=float, default=2.5, help="lesion feature shift (noise sd 1)")
    parser.add_argument("--tissue-seeds", type=int, default=3, help="independent train/test draws")
    parser.add_argument("--tissue-variance", type=float, default=1.0, help="RBF variance for the tissue part")
    parser.add_argument("--defaults-sides", nargs=2, type=int, default=[8, 20], help="grid sides of the defaults part's bags")
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, python {platform.python_version()}\n")
    if args.part in ("musk", "all"):
        musk(args.folds, args.inducing, args.max_iter)
        print()
    if args.part in ("tissue", "all"):
        tissue_experiment(
            args.tissue_bags, args.tissue_side, args.tissue_shift, args.tissue_seeds, args.inducing,
            args.tissue_variance, args.max_iter, args.lams, args.mc,
        )
    if args.part == "defaults":
        defaults_experiment(args.tissue_bags, tuple(args.defaults_sides), args.tissue_shift, args.tissue_seeds)


if __name__ == "__main__":
    main()
