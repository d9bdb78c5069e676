"""The ``gpmil`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

DEFAULT_MUSK1 = Path("../shared/data/musk1.csv")


def demo(args: argparse.Namespace) -> int:
    """Stratified 5-fold bag cross-validation of VGPMIL and G-VGPMIL on a MIL CSV table."""
    from mil_core import GVGPMIL, VGPMIL
    from mil_core.model_selection import cross_validate_bags

    if not args.csv.is_file():
        print(f"gpmil demo: {args.csv} not found; pass --csv PATH to a MIL table (label, bag id, features…)", file=sys.stderr)
        return 2
    table = np.loadtxt(args.csv, delimiter=",")
    X, bags, y = table[:, 2:], table[:, 1].astype(int), table[:, 0].astype(int)
    print(f"{args.csv}: {X.shape[0]} instances, {np.unique(bags).size} bags, {X.shape[1]} features")
    for model in (VGPMIL(n_inducing=args.inducing, random_state=0), GVGPMIL(n_inducing=args.inducing, random_state=0)):
        folds = cross_validate_bags(model, X, bags, y, predict_kwargs={"method": "probit", "rule": "max"})
        auc = np.array([f["bag_auc"] for f in folds])
        fit = np.mean([f["fit_time"] for f in folds])
        print(f"{type(model).__name__:8s} M={args.inducing}: bag AUC {auc.mean():.3f} ± {auc.std():.3f} (5-fold), mean fit {fit:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpmil", description="Gaussian-process multiple-instance learning pipelines.")
    commands = parser.add_subparsers(dest="command", required=True)
    p_demo = commands.add_parser("demo", help="cross-validate VGPMIL and G-VGPMIL on MUSK1 and print bag AUC")
    p_demo.add_argument("--csv", type=Path, default=DEFAULT_MUSK1, help=f"MIL CSV table (default: {DEFAULT_MUSK1})")
    p_demo.add_argument("--inducing", type=int, default=50, help="number of inducing points (default: 50)")
    p_demo.set_defaults(handler=demo)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
