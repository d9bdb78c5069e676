"""Learnt vs fixed Ising strength λ of VGPMIL-PR-I on synthetic tile grids whose lesions have a
known spatial correlation (seed 002, Sec. 2.3; its Sec. 4 leaves learning λ to future work).

Two layouts with the same features and the same number of positive tiles per positive bag:
``smooth`` (one compact lesion: the tiles nearest a random centre) and ``scattered`` (the same
number of tiles at random positions). A λ that measures spatial correlation should come out
larger on ``smooth`` than on ``scattered``. Compared, for both coupling forms (``ising``: the
paper's ``N(Σf, Σ)``; ``smoother``: ``N(Σf, I)``): the paper's fixed grid λ ∈ {0.1, 0.5, 1, 5}
and λ = 0 (VGPMIL-PR); λ learnt (``learn_lam=True``, started at 0.5) by the CAR likelihood of the
latent field (``lam_objective="field"``) and by the bound (``"bound"``); for the paper's form, λ
selected from {0, 0.1, 0.5, 1, 5} by validation bag AUC (``select_lam_by_validation``, the
fallback). Metrics on held-out bags: instance AUC (tile labels are known here), alone and in the
test bag's context (Eq. 24–25 with the test bag's Σ*), and bag AUC.

    python benchmarks/bench_ising_lambda.py [--seeds 3] [--bags 24] [--side 12] [--shift 1.5]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from sklearn.metrics import roc_auc_score
from sklearn.preprocessing import StandardScaler

from mil_core import VGPMILPRI
from mil_core.models.ising_hyper import select_lam_by_validation

GRID = (0.0, 0.1, 0.5, 1.0, 5.0)
FORMS = ("ising", "smoother")


def grid_bags(n_bags: int, side: int, layout: str, n_pos: int, seed: int, shift: float = 1.5, n_features: int = 4):
    """Bags of side×side tiles; every other bag positive with ``n_pos`` lesion tiles (``smooth``:
    the tiles nearest a random centre; ``scattered``: uniform at random). Features N(0, I), lesion
    tiles shifted by ``shift`` along the first axis. Returns X, bag ids, bag label per tile, tile
    labels, coords."""
    rng = np.random.default_rng(seed)
    r, c = np.meshgrid(np.arange(side), np.arange(side), indexing="ij")
    coords = np.column_stack([r.ravel(), c.ravel()])
    X, bags, y, h = [], [], [], []
    for b in range(n_bags):
        lesion = np.zeros(side * side, dtype=bool)
        if b % 2:
            if layout == "smooth":
                dist = np.hypot(*(coords - rng.uniform(1, side - 2, size=2)).T) + 1e-6 * rng.random(side * side)
                lesion[np.argsort(dist)[:n_pos]] = True
            else:
                lesion[rng.choice(side * side, n_pos, replace=False)] = True
        x = rng.normal(size=(side * side, n_features))
        x[:, 0] += shift * lesion
        X.append(x), bags.append(np.full(side * side, b)), y.append(np.full(side * side, b % 2)), h.append(lesion)
    return np.concatenate(X), np.concatenate(bags), np.concatenate(y), np.concatenate(h).astype(int), np.tile(coords, (n_bags, 1))


def scores(model: VGPMILPRI, X, bags, y, h, coords) -> tuple[float, float, float]:
    """Instance AUC alone (Σ* = 1) and in the test bag's context (Eq. 24–25 with Σ*), bag AUC."""
    keys, p_bag = model.predict_bag_proba(X, bags, coords=coords, rule="orthant")
    truth = np.array([y[bags == k][0] for k in keys])
    in_context = model.predict_instance_proba(X, bag_ids=bags, coords=coords)
    return roc_auc_score(h, model.predict_instance_proba(X)), roc_auc_score(h, in_context), roc_auc_score(truth, p_bag)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--bags", type=int, default=24, help="training bags (and as many test bags)")
    parser.add_argument("--side", type=int, default=12)
    parser.add_argument("--n-pos", type=int, default=16, help="lesion tiles per positive bag")
    parser.add_argument("--n-inducing", type=int, default=20)
    parser.add_argument("--max-iter", type=int, default=50)
    parser.add_argument("--shift", type=float, default=1.5, help="lesion tiles' shift on the first feature")
    args = parser.parse_args()
    common = dict(n_inducing=args.n_inducing, max_iter=args.max_iter, random_state=0, n_mc_samples=100, exact_orthant_max=0)
    print(f"{args.bags} train / {args.bags} test bags of {args.side}×{args.side} tiles, {args.n_pos} lesion tiles per positive bag, "
          f"shift {args.shift:g}, "
          f"M={args.n_inducing}, {args.max_iter} sweeps; mean ± sd over {args.seeds} data seeds\n")
    print("| layout | form | λ | how | λ used (per seed) | instance AUC | instance AUC, in context | bag AUC | fit s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for layout in ("smooth", "scattered"):
        rows: dict[tuple[str, str, str], list[tuple[float, ...]]] = {}  # λ, 3 AUCs, fit s
        for seed in range(args.seeds):
            X, bags, y, h, coords = grid_bags(args.bags, args.side, layout, args.n_pos, seed=2 * seed, shift=args.shift)
            Xt, bags_t, y_t, h_t, coords_t = grid_bags(args.bags, args.side, layout, args.n_pos, seed=2 * seed + 1, shift=args.shift)
            scaler = StandardScaler().fit(X)
            X, Xt = scaler.transform(X), scaler.transform(Xt)
            runs = [("ising", "0", "fixed (VGPMIL-PR)", dict(lam=0.0))]
            for form in FORMS:
                runs += [(form, f"{lam:g}", "fixed (paper grid)", dict(lam=lam, coupling_form=form)) for lam in GRID[1:]]
                runs += [(form, "learnt", f"{objective}, start 0.5", dict(lam=0.5, learn_lam=True, lam_objective=objective, coupling_form=form))
                         for objective in ("field", "bound")]
            for form, name, how, params in runs:
                start = time.perf_counter()
                model = VGPMILPRI(**common, **params).fit(X, bags, y, coords=coords)
                fit_s = time.perf_counter() - start
                rows.setdefault((form, name, how), []).append((model.lam_, *scores(model, Xt, bags_t, y_t, h_t, coords_t), fit_s))
            start = time.perf_counter()
            selection = select_lam_by_validation(VGPMILPRI(**common), X, bags, y, coords, grid=GRID, random_state=seed)
            fit_s = time.perf_counter() - start
            rows.setdefault(("ising", "selected", "validation bag AUC"), []).append(
                (selection.lam, *scores(selection.estimator, Xt, bags_t, y_t, h_t, coords_t), fit_s)
            )
        for (form, name, how), values in rows.items():
            v = np.asarray(values)
            lams = ", ".join(f"{x:.3g}" for x in v[:, 0])
            auc = " | ".join(f"{v[:, k].mean():.3f} ± {v[:, k].std():.3f}" for k in (1, 2, 3))
            print(f"| {layout} | {form} | {name} | {how} | {lams} | {auc} | {v[:, 4].mean():.1f} |", flush=True)


if __name__ == "__main__":
    main()
