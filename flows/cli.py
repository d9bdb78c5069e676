"""The ``gpmil`` command line: run the Prefect flows from a YAML configuration.

    gpmil run CONFIG              ingest → train → predict → evaluate (reruns skip done work)
    gpmil ingest|train CONFIG     one stage
    gpmil predict CONFIG MODEL_DIR [--store STORE] [--source NEW_FOLDER [--labels FILE]]
    gpmil evaluate CONFIG MODEL_DIR PREDICTION_KEY [--store STORE]   STORE: the predicted cohort (default: the config's)
    gpmil serve CONFIG [--cron "0 2 * * *" [--timezone Europe/Berlin]]   a long-running served deployment (Prefect UI)
    gpmil demo [DIR]              synthetic WSI and CT cohorts: train, then evaluate on held-out cohorts
    gpmil cv CSV                  5-fold bag cross-validation on a MIL feature table
"""

import argparse
import ctypes
import functools
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

SERVER_START_S = 120
"""The least time the temporary Prefect server is given to start: its first start takes 10–60 s on a
loaded node, and Prefect's default wait (20 s) failed the run with a raw timeout traceback."""

CV_MODELS: tuple[str, ...] = ("VGPMIL", "GVGPMIL", "VGPMILPR")
"""The automatic defaults ``gpmil cv`` scores, after the pipeline's default model."""
CV_FOLDS = 5
"""``gpmil cv``'s stratified folds over bags."""


def _quiet_libraries(verbose: bool) -> None:
    """Library chatter (Prefect's task states, Dask's scheduler and workers) goes to the console
    only with ``-v``; warnings and errors always do, and the Prefect UI gets every log line.
    Set through the environment, before Prefect or Dask is imported, so that the flow-run
    processes of ``serve`` and the Dask worker processes inherit it."""
    level = "INFO" if verbose else "WARNING"
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", level)
    extra = [name for name in os.environ.get("PREFECT_LOGGING_EXTRA_LOGGERS", "").split(",") if name.strip()]
    os.environ["PREFECT_LOGGING_EXTRA_LOGGERS"] = ",".join(extra + ["gpmil"] * ("gpmil" not in extra))  # gpmil's own lines, UI too
    logging.getLogger("gpmil").setLevel(logging.INFO)  # the handlers' levels decide (console: WARNING without -v)
    os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", level.lower())
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per Prefect API request, even with -v
    for chatty in ("prefect.server", "uvicorn"):
        logging.getLogger(chatty).setLevel(logging.INFO if verbose else logging.WARNING)


@contextmanager
def _sigterm_as_exit_while_running() -> Iterator[None]:
    """SIGTERM (a scheduler's timeout, ``kill``) ends the command as Ctrl-C does: the flow is marked
    crashed and the interpreter exits normally, so the temporary Prefect server is stopped. With the
    default handler the process died at once and left the server running, one per killed run.
    Prefect's flow engine puts this handler back and calls it after recording the crash; the one
    before is back when the command returns (``main`` called in-process, by a test)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _sigterm_as_exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _sigterm_as_exit(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def _prefect_for_the_command() -> None:
    """Prefect set up for a command that runs flows, once its inputs are checked: input errors as one
    console line, and the temporary server in a session of its own."""
    _input_errors_without_traceback()
    _temporary_prefect_server_of_its_own()


def _temporary_prefect_server_of_its_own() -> None:
    """Start the temporary Prefect server (no ``PREFECT_API_URL``) as Prefect would, but in a session
    of its own and, on Linux, stopped by the kernel when gpmil dies. In gpmil's process group it
    took Ctrl-C from the terminal too, died first, and the run spent minutes retrying to report its
    crash; a gpmil killed by SIGKILL (the OOM killer) left it running. Prefect's client then finds
    it started (one server per port, as Prefect keeps them)."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_SERVER_ALLOW_EPHEMERAL_MODE,
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS,
    )

    server = SubprocessASGIServer()
    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value() or server.running:
        return
    popen = subprocess.Popen
    subprocess.Popen = functools.partial(popen, start_new_session=True,  # Prefect's own Popen call, this once
                                         preexec_fn=_stopped_with_parent if sys.platform == "linux" else None)
    try:
        server.start(timeout=max(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value(), SERVER_START_S))  # a longer setting holds
    finally:
        subprocess.Popen = popen


def _stopped_with_parent() -> None:
    """In the server's process before it runs: SIGTERM when its parent, gpmil, dies (PR_SET_PDEATHSIG)."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


def _abs(path: Any) -> str | None:
    return None if path is None else str(Path(path).resolve())


def _positive_float(text: str) -> float:
    """A command-line number > 0 (µm/px)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and value < float("inf")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a number > 0")
    return value


def _model_arg(model_dir: str) -> str:
    """MODEL_DIR on the command line: ``latest`` as the word (the flow finds that model), else a path."""
    from tasks.retention import LATEST_MODEL

    return model_dir if model_dir == LATEST_MODEL else _abs(model_dir)


def _checked(args: argparse.Namespace, stage: str, **paths: str | None):
    """The configuration, validated, and the stage's inputs checked: before Prefect is imported."""
    from flows.checks import check_inputs
    from flows.config import load_config, new_cohort_labels, new_cohort_store

    def with_source(config):
        if not getattr(args, "source", None):
            return config
        return config.model_copy(update={"ingest": config.ingest.model_copy(update={"source": Path(_abs(args.source))})})

    new_cohort = stage == "predict" and getattr(args, "source", None)  # --store is then where the new store goes
    if new_cohort:
        paths["source"] = _abs(args.source)

    def as_the_flow_sees_it(config):  # a new cohort's store and labels, as predict_cohort sets them: refused here, not in the flow
        config = with_source(config)
        if not new_cohort:
            return config
        ingest = config.ingest.model_copy(update={"labels": new_cohort_labels(config.ingest.labels, _abs(args.labels))})
        new_store = Path(_abs(args.store)) if args.store else new_cohort_store(config.output_dir, _abs(args.source))
        prediction = config.prediction.model_copy(update={"store": new_store})  # not the config's prediction.store
        return config.model_copy(update={"ingest": ingest, "prediction": prediction})

    config = load_config(args.config, preflight=lambda config: check_inputs(as_the_flow_sees_it(config), stage, **paths),
                         **({"store": _abs(args.store)} if getattr(args, "store", None) and not new_cohort else {}))
    _prefect_for_the_command()
    return with_source(config)


class _WithoutInputTracebacks(logging.Formatter):
    """A console formatter that prints an input error (a bad slide, table or labels file, a store
    another run holds, a cohort the model cannot train on or predict) as its one line: the traceback of Prefect's 'Encountered exception' is of
    the pipeline's own frames and says nothing the message does not. Other errors keep theirs; the
    Prefect UI keeps every traceback."""

    def __init__(self, inner: logging.Formatter):
        super().__init__()
        self.inner = inner

    def format(self, record: logging.LogRecord) -> str:
        from tasks.cluster import ClusterSettingError
        from tasks.ingest.errors import IngestError
        from tasks.lease import StoreLockedError
        from tasks.training.errors import CohortError

        if not (record.exc_info and isinstance(record.exc_info[1], (IngestError, StoreLockedError, ClusterSettingError, CohortError))):
            return self.inner.format(record)
        saved = record.exc_info, record.exc_text
        record.exc_info, record.exc_text = None, None
        try:
            return self.inner.format(record)
        finally:
            record.exc_info, record.exc_text = saved


def _input_errors_without_traceback() -> None:
    """Wrap the formatter of Prefect's console handlers (set up here, as Prefect would at its first
    flow; its later set-ups are incremental and keep them)."""
    from prefect.logging.configuration import ensure_logging_setup
    from prefect.logging.handlers import PrefectConsoleHandler

    ensure_logging_setup()
    for name in ("prefect", ""):
        for handler in logging.getLogger(name).handlers:
            if isinstance(handler, PrefectConsoleHandler) and not isinstance(handler.formatter, _WithoutInputTracebacks):
                handler.setFormatter(_WithoutInputTracebacks(handler.formatter or logging.Formatter()))


def summary(stage: str, result: Any) -> str:
    """One line per stage: what it did (or reused) and where its output is."""
    info, state = result.info, "reused" if result.reused else "done"
    if stage == "ingest":
        what = (f"{len(info.get('added', []))} bags added ({info.get('n_instances_added', 0)} instances), "
                f"{len(info.get('already_done', []))} already in the store"
                + (f" ({len(info['labelled'])} of them labelled now)" if info.get("labelled") else "")
                + f", {len(info.get('skipped', []))} skipped"
                + (f"; {len(info['unconfirmed'])} in the store not confirmed, still used" if info.get("unconfirmed") else ""))
    elif stage == "train":
        stop = ("" if info.get("converged") else " (the sweeps chosen with the kernel)"
                if info.get("n_iter") == info.get("chosen_sweeps") else " (not converged)")
        rule = info.get("choices", {}).get("bag_rule")
        what = f"{info.get('model')} on {info.get('n_bags')} bags, {info.get('n_iter')} iterations{stop}" + f", bag rule {rule}" * bool(rule)
    elif stage == "predict":
        what = f"{info['n_bags']} bags" if "n_bags" in info else "predictions"
    else:
        metrics = ", ".join(f"{k} {info[k]:.3f}" for k in ("bag_auc", "bag_accuracy", "bag_f1") if isinstance(info.get(k), float))
        what = metrics or "no labelled bags of both classes: no metrics"
    return f"{stage:8s}{state:7s} {what} -> {result.path}"


def _run(args: argparse.Namespace) -> int:
    _checked(args, "run", store=_abs(args.store))
    from flows.pipeline import pipeline

    for stage, result in pipeline(str(args.config), store=_abs(args.store), source=_abs(args.source)).items():
        print(summary(stage, result))
    return 0


def _ingest(args: argparse.Namespace) -> int:
    _checked(args, "ingest", store=_abs(args.store))
    from flows.pipeline import ingest_cohort

    print(summary("ingest", ingest_cohort(str(args.config), store=_abs(args.store), source=_abs(args.source))))
    return 0


def _train(args: argparse.Namespace) -> int:
    _checked(args, "train", store=_abs(args.store))
    from flows.pipeline import train_model

    print(summary("train", train_model(str(args.config), store=_abs(args.store))))
    return 0


def _predict(args: argparse.Namespace) -> int:
    if args.base_mpp is not None and not args.source:
        print("gpmil predict: --base-mpp gives the µm/px of a --source folder's slides; a store's bags are tiled already",
              file=sys.stderr)
        return 2
    if args.labels and not args.source:
        print("gpmil predict: --labels gives the labels of a --source folder; a store's bags keep the labels they were "
              "ingested with", file=sys.stderr)
        return 2
    config = _checked(args, "predict", store=None if args.source else _abs(args.store), model_dir=_model_arg(args.model_dir))
    from flows.pipeline import predict_cohort
    from tasks import report
    from tasks.ingest.driver import Skipped, left_out_lines

    result = predict_cohort(str(args.config), _model_arg(args.model_dir), store=_abs(args.store), source=_abs(args.source),
                            labels=_abs(args.labels), base_mpp=args.base_mpp)
    store = result.info.get("store") or str(_abs(args.store) or config.prediction.store or config.store)
    where = {"store": store, "predictions": f"{result.path} (key {result.key})"}
    if "report" in result.info:
        folder = Path(result.info["report"]).parent
        where |= {"report": result.info["report"], "bag table": str(folder / "bag_predictions.csv"),
                  "instance table": str(folder / "instance_predictions.parquet")}
        if (folder / "geojson").is_dir():
            where["QuPath GeoJSON"] = str(folder / "geojson")
    table = report.bag_table(store, result.key, threshold=config.prediction.threshold)
    print(report.summary_text(table, threshold=config.prediction.threshold, metrics=result.info.get("metrics"), where=where))
    for line in left_out_lines([Skipped(**skipped) for skipped in result.info.get("skipped", [])], result.info.get("ingest_report")):
        print(line)
    return 0


def _evaluate(args: argparse.Namespace) -> int:
    _checked(args, "evaluate", store=_abs(args.store), model_dir=_model_arg(args.model_dir), prediction_key=args.prediction_key)
    from flows.pipeline import evaluate_run

    print(summary("report", evaluate_run(str(args.config), _model_arg(args.model_dir), args.prediction_key, store=_abs(args.store))))
    return 0


def _serve(args: argparse.Namespace) -> int:
    from prefect.settings import PREFECT_API_URL

    schedules = _serve_schedules(args.cron, args.timezone)
    if isinstance(schedules, str):
        print(f"gpmil serve: {schedules}", file=sys.stderr)
        return 2
    if not PREFECT_API_URL.value():  # Prefect's runner only warns, and no scheduled run ever comes
        print("gpmil serve: no Prefect server to serve on (PREFECT_API_URL is not set): a deployment on gpmil's temporary "
              "server goes with it, and Prefect schedules no run there. Start one (`prefect server start`) and set "
              "PREFECT_API_URL (`prefect config set PREFECT_API_URL=http://127.0.0.1:4200/api`): docs/PIPELINE.md, "
              "'Watching it in the Prefect UI'", file=sys.stderr)
        return 2
    config = _checked(args, "run")  # fail now, not at the first scheduled run
    from prefect.runner import Runner

    from flows.pipeline import pipeline

    Runner.handle_sigterm = _sigterm_as_ctrl_c  # this process only serves

    pipeline.serve(name=f"gpmil-{config.name}", schedules=schedules, parameters={"config": str(Path(args.config).resolve())})
    return 0


def _serve_schedules(cron: str | None, timezone: str | None) -> list[Any] | str:
    """``--cron`` in ``--timezone`` (an IANA name: a hospital's 2 am, daylight saving included;
    Prefect's default is UTC) as the deployment's schedules, or what is wrong with them, read as
    Prefect's server reads them: Prefect's client took a timezone its server refuses and crons
    the server cannot schedule (30 February: no run ever came) or schedules every second (a sixth
    field is seconds), and raised a traceback for a bad cron only once serving began."""
    import asyncio

    from prefect.schedules import Cron
    from prefect.server.schemas.schedules import CronSchedule

    if cron is None:
        return "--timezone needs --cron (the schedule it is the timezone of)" if timezone else []
    if not cron.startswith("@") and len(cron.split()) != 5:
        return (f"--cron {cron!r} has {len(cron.split())} fields, not five (minute hour day-of-month month day-of-week, "
                f"e.g. \"0 2 * * *\"; a sixth is read as seconds: a run every second)")
    try:
        asyncio.run(CronSchedule(cron=cron, timezone=timezone).get_dates(1))
    except ValueError as error:  # pydantic's validation error, croniter's date that never comes
        reason = getattr(error, "errors", lambda: [{"msg": str(error)}])()[0]["msg"].removeprefix("Value error, ")
        if type(error).__name__ == "CroniterBadDateError":
            reason = "no date matches it: it would never run"
        what = "--timezone" if timezone and "timezone" in reason else "--cron"
        return f"{what} {timezone if what == '--timezone' else cron!r}: {reason}"
    return [Cron(cron, timezone=timezone)]


def _sigterm_as_ctrl_c(runner: Any, *args: Any) -> None:
    """SIGTERM (systemd, a scheduler, ``kill``) stops ``gpmil serve`` with the deployment's schedule
    paused: the runner's own stop (``astop``: its runs cancelled, its loops ended, then the schedules
    paused as the runner exits) is put on its event loop. Prefect's handler called the synchronous
    ``stop``, which never awaited it, and left the schedule active: runs piled up as Late with
    nothing to serve them. A Ctrl-C emulated by SIGINT was lost when it came as a run was being
    taken up (its cancellation absorbed there): serve went on. Before the loop runs: as Ctrl-C."""
    import asyncio

    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        os.kill(os.getpid(), signal.SIGINT)
        return
    loop.call_soon_threadsafe(lambda: loop.create_task(runner.astop()))


def _demo(args: argparse.Namespace) -> int:
    from flows.demo import demo

    _prefect_for_the_command()
    for name, report in demo(str(args.workdir)).items():
        print(f"{name}: report at {report}")
    return 0


def _mil_table(path: Path, n_splits: int) -> tuple[Any, Any, Any]:
    """Features (float64), bag ids (any text) and labels of a MIL CSV table (label, bag id,
    features…; no header), or a ``ValueError`` that names the file and the row, bag or field at
    fault: a cell that is not a number, NaN/inf features, labels other than 0/1 (or −1/1) or not
    constant within a bag, fewer than ``n_splits`` bags of a class."""
    import numpy as np

    from mil_core.validation import check_mil_data, label_problem
    from tasks.ingest.tables import read_mil_csv

    table = read_mil_csv(path, dtype=np.float64)  # an unreadable, empty or featureless file: an IngestError naming it
    if table.row_problems:
        first = min(table.row_problems)
        raise ValueError(f"{path}: {table.row_problems[first]} ({len(table.row_problems)} such line(s))")
    nonfinite = np.flatnonzero(~np.isfinite(table.X).all(axis=1))
    if nonfinite.size:
        raise ValueError(f"{path}: {table.where(nonfinite[0])} (bag {table.bag_ids[nonfinite[0]]!r}) has empty, NaN or "
                         f"infinite features ({nonfinite.size} such line(s))")
    problem = label_problem(table.labels)
    if problem is not None and len(problem) == 1:
        row = problem[0]
        first = table.labels[row]
        blank = first is None or (isinstance(first, float) and np.isnan(first))
        cell = "no bag label (an empty cell)" if blank else f"bag label {first:g}" if isinstance(first, (int, float, np.number)) else (
            f"bag label {first!r}")
        bad = sum(label_problem([v]) is not None for v in table.labels)
        raise ValueError(f"{path}: {table.where(row)} (bag {table.bag_ids[row]!r}) has {cell}: bag labels are 0 or 1 "
                         f"(or -1 and 1; 1 is positive) ({bad} such line(s))")
    if problem is not None:  # two conventions in one table: which is the negative label?
        minus, zero = problem
        raise ValueError(f"{path}: bag labels mix -1 ({table.where(minus)}, bag {table.bag_ids[minus]!r}) and 0 "
                         f"({table.where(zero)}, bag {table.bag_ids[zero]!r}): a table's negative bags are all 0 or all -1")
    try:
        _, _, bag_labels = check_mil_data(table.X, table.bag_ids, table.labels)
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from error
    counts = np.bincount(bag_labels, minlength=2)
    if counts.min() < n_splits:
        raise ValueError(f"{path}: {n_splits}-fold CV needs at least {n_splits} bags of each class; the table has "
                         f"{counts[0]} negative and {counts[1]} positive bags")
    return table.X, table.bag_ids, table.labels


def _cv(args: argparse.Namespace) -> int:
    import numpy as np

    from flows.config import MODEL_CLASSES, ModelConfig
    from mil_core.model_selection import cross_validate_bags

    if not args.csv.is_file():
        print(f"gpmil cv: {args.csv} not found; pass a MIL table (label, bag id, features…)", file=sys.stderr)
        return 2
    try:
        X, bags, y = _mil_table(args.csv, CV_FOLDS)
    except ValueError as error:
        print(f"gpmil cv: {error}", file=sys.stderr)
        return 2
    print(f"{args.csv}: {X.shape[0]} instances, {np.unique(bags).size} bags, {X.shape[1]} features")
    default = ModelConfig().name
    names = [default] + [name for name in CV_MODELS if name != default]  # the pipeline's default model first
    for model in (MODEL_CLASSES[name] for name in names):  # each with its automatic defaults
        folds = cross_validate_bags(model(n_inducing=args.inducing, random_state=0), X, bags, y, n_splits=CV_FOLDS)  # its own bag rule
        auc = np.array([f["bag_auc"] for f in folds])
        print(f"{model.__name__:8s} M={args.inducing}: bag AUC {auc.mean():.3f} ± {auc.std():.3f} ({CV_FOLDS}-fold)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpmil", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="show Prefect's and Dask's log lines on the console")
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
    p.add_argument("model_dir", help="a model folder written by `gpmil train` (<output_dir>/models/<key>), or `latest`: the model "
                                     "of the configuration's newest completed `gpmil run` (a folder named latest: ./latest)")
    p.add_argument("--store", help="cohort to predict (default: prediction.store, else the training store); with "
                                   "--source, where the new cohort's store goes")
    p.add_argument("--source", type=Path, help="a folder of new slides/scans/feature files: ingest it with the training "
                                               "store's extractor, predict, write the report and tables")
    p.add_argument("--labels", type=Path, help="labels of the --source cohort (optional; for metrics)")
    p.add_argument("--base-mpp", type=_positive_float, help="level-0 µm/px of the --source slides where their metadata gives "
                                                          "none or a wrong one (the training config's base_mpp is not used)")
    p = with_config("evaluate", "tables, metrics, figures and report of a prediction run", _evaluate)
    p.add_argument("model_dir", help="the model folder the prediction was made with")
    p.add_argument("prediction_key", help="the key printed by `gpmil predict`")
    p.add_argument("--store")
    p = with_config("serve", "serve the pipeline as a Prefect deployment (runs until stopped)", _serve)
    p.add_argument("--cron", default=None, help='schedule, e.g. "0 2 * * *" (default: run on demand from the UI)')
    p.add_argument("--timezone", default=None, help="the cron's timezone, an IANA name such as Europe/Berlin (default: UTC)")
    p = commands.add_parser("demo", help="synthetic WSI and CT cohorts: train on one cohort, evaluate on a held-out one (about a minute on 2 cores)",
                            description="Generate a training and a held-out cohort of synthetic slides and of synthetic head-CT "
                                        "scans, train VGPMIL on each training cohort, predict the held-out cohort with the stored "
                                        "model and write a report with held-out metrics. Rerun: every stage is reused.")
    p.add_argument("workdir", type=Path, nargs="?", default=Path("gpmil-demo"), help="where raw data, stores, models and reports go (default: ./gpmil-demo)")
    p.set_defaults(handler=_demo)
    p = commands.add_parser("cv", help="5-fold bag cross-validation of the automatic defaults (VGPMIL, the pipeline's default; G-VGPMIL; VGPMIL-PR) on a MIL CSV table")
    p.add_argument("csv", type=Path, help="MIL table: label, bag id, features… (e.g. ../shared/data/musk1.csv)")
    p.add_argument("--inducing", type=int, default=50)
    p.set_defaults(handler=_cv)

    args = parser.parse_args(argv)
    _quiet_libraries(args.verbose)
    from flows.config import ConfigError

    with _sigterm_as_exit_while_running():
        return _handled(args, ConfigError)


def _handled(args: argparse.Namespace, config_error: type[Exception]) -> int:
    """The command's exit code: 2 for a bad configuration or input (one line), 130 for Ctrl-C,
    1 for a failure (one line; ``-v`` re-raises it)."""
    try:
        return args.handler(args)
    except config_error as error:
        print(f"gpmil: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except Exception as error:  # the flow's logs above hold the traceback; -v re-raises it here too
        if args.verbose:
            raise
        print(f"gpmil {args.command} failed: {type(error).__name__}: {error}", file=sys.stderr)
        return 1

if __name__ == "__main__":
    sys.exit(main())
