"""The ``gpmil`` command line: run the Prefect flows from a YAML configuration.

    gpmil run CONFIG              ingest → train → predict → evaluate (reruns skip done work)
    gpmil ingest|train CONFIG     one stage
    gpmil predict CONFIG MODEL_DIR [--store STORE]
    gpmil evaluate CONFIG MODEL_DIR PREDICTION_KEY
    gpmil serve CONFIG [--cron "0 2 * * *"]   a long-running served deployment (Prefect UI)
    gpmil demo [DIR]              synthetic WSI and CT cohorts: train, then evaluate on held-out cohorts
    gpmil cv CSV                  5-fold bag cross-validation on a MIL feature table
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


def _run(args: argparse.Namespace) -> int:
    from flows.pipeline import pipeline

    results = pipeline(str(args.config), store=args.store, source=args.source)
    for stage, result in results.items():
        print(f"{stage:8s} {'reused ' if result.reused else 'done   '} {result.path}")
    return 0


def _ingest(args: argparse.Namespace) -> int:
    from flows.pipeline import ingest_cohort

    print(ingest_cohort(str(args.config), store=args.store, source=args.source))
    return 0


def _train(args: argparse.Namespace) -> int:
    from flows.pipeline import train_model

    result = train_model(str(args.config), store=args.store)
    print(f"model {'reused' if result.reused else 'trained'}: {result.path}")
    return 0


def _predict(args: argparse.Namespace) -> int:
    from flows.pipeline import predict_cohort

    result = predict_cohort(str(args.config), str(args.model_dir), store=args.store)
    print(f"predictions {'reused' if result.reused else 'written'}: {result.path} (key {result.key})")
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    from flows.pipeline import evaluate_run

    result = evaluate_run(str(args.config), str(args.model_dir), args.prediction_key, store=args.store)
    print(f"report: {result.path}")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from flows.config import load_config
    from flows.pipeline import pipeline

    config = load_config(args.config)  # fail now, not at the first scheduled run
    pipeline.serve(name=f"gpmil-{config.name}", cron=args.cron, parameters={"config": str(Path(args.config).resolve())})
    return 0


def _demo(args: argparse.Namespace) -> int:
    from flows.demo import demo

    for name, report in demo(str(args.workdir)).items():
        print(f"{name}: report at {report}")
    return 0


def _cv(args: argparse.Namespace) -> int:
    import numpy as np

    from mil_core import GVGPMIL, VGPMIL
    from mil_core.model_selection import cross_validate_bags

    if not args.csv.is_file():
        print(f"gpmil cv: {args.csv} not found; pass a MIL table (label, bag id, features…)", file=sys.stderr)
        return 2
    table = np.loadtxt(args.csv, delimiter=",")
    X, bags, y = table[:, 2:], table[:, 1].astype(int), table[:, 0].astype(int)
    print(f"{args.csv}: {X.shape[0]} instances, {np.unique(bags).size} bags, {X.shape[1]} features")
    for model in (VGPMIL(n_inducing=args.inducing, random_state=0), GVGPMIL(n_inducing=args.inducing, random_state=0)):
        folds = cross_validate_bags(model, X, bags, y, predict_kwargs={"method": "probit"})  # the estimator's bag rule
        auc = np.array([f["bag_auc"] for f in folds])
        print(f"{type(model).__name__:8s} M={args.inducing}: bag AUC {auc.mean():.3f} ± {auc.std():.3f} (5-fold)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpmil", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def with_config(name: str, help: str, handler) -> argparse.ArgumentParser:
        p = commands.add_parser(name, help=help, description=help)
        p.add_argument("config", type=Path, help="pipeline configuration (YAML, see docs/PIPELINE.md)")
        p.set_defaults(handler=handler)
        return p

    p = with_config("run", "ingest, train, predict and evaluate (reruns skip what is done)", _run)
    p.add_argument("--store", help="cohort store (overrides the config)")
    p.add_argument("--source", help="raw data folder / feature table (overrides ingest.source)")
    p = with_config("ingest", "tile + featurise new slides/scans into the cohort store", _ingest)
    p.add_argument("--store")
    p.add_argument("--source")
    p = with_config("train", "train the configured model on the store", _train)
    p.add_argument("--store")
    p = with_config("predict", "predict a cohort with a saved model", _predict)
    p.add_argument("model_dir", type=Path, help="a model folder written by `gpmil train` (<output_dir>/models/<key>)")
    p.add_argument("--store", help="cohort to predict (default: prediction.store, else the training store)")
    p = with_config("evaluate", "tables, metrics, figures and report of a prediction run", _evaluate)
    p.add_argument("model_dir", type=Path)
    p.add_argument("prediction_key", help="the key printed by `gpmil predict`")
    p.add_argument("--store")
    p = with_config("serve", "serve the pipeline as a Prefect deployment (runs until stopped)", _serve)
    p.add_argument("--cron", default=None, help='schedule, e.g. "0 2 * * *" (default: run on demand from the UI)')
    p = commands.add_parser("demo", help="synthetic WSI and CT cohorts: train on one cohort, evaluate on a held-out one (about a minute on 2 cores)",
                            description="Generate a training and a held-out cohort of synthetic slides and of synthetic head-CT "
                                        "scans, train VGPMIL on each training cohort, predict the held-out cohort with the stored "
                                        "model and write a report with held-out metrics. Rerun: every stage is reused.")
    p.add_argument("workdir", type=Path, nargs="?", default=Path("gpmil-demo"), help="where raw data, stores, models and reports go (default: ./gpmil-demo)")
    p.set_defaults(handler=_demo)
    p = commands.add_parser("cv", help="5-fold bag cross-validation of VGPMIL and G-VGPMIL on a MIL CSV table")
    p.add_argument("csv", type=Path, help="MIL table: label, bag id, features… (e.g. ../shared/data/musk1.csv)")
    p.add_argument("--inducing", type=int, default=50)
    p.set_defaults(handler=_cv)

    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    for chatty in ("httpx", "distributed", "prefect.server"):
        logging.getLogger(chatty).setLevel(logging.WARNING)
    from flows.config import ConfigError

    try:
        return args.handler(args)
    except ConfigError as error:
        print(f"gpmil: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
