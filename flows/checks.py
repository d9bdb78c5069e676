"""A run's inputs checked before anything starts (no Prefect server, no cluster, no retries):
every file and folder the stage reads exists and is of the right kind.

The CLI calls :func:`check_inputs` right after loading the configuration; each flow calls it
again first thing, so a deployment's run with a missing input fails at once too. Problems raise
:class:`~flows.config.ConfigError` naming the field and the path.
"""

from pathlib import Path
from typing import Literal

from flows.config import ConfigError, PipelineConfig

__all__ = ["check_inputs", "Stage"]

Stage = Literal["run", "ingest", "train", "predict", "evaluate"]


def _problem(field: str, path: Path | str | None, kind: Literal["file", "dir", "any"]) -> str | None:
    if path is None:
        return None
    path = Path(path)
    if not path.exists():
        return f"{field}: {path} does not exist"
    if kind == "file" and not path.is_file():
        return f"{field}: {path} is not a file"
    if kind == "dir" and not path.is_dir():
        return f"{field}: {path} is not a folder"
    return None


def _original_label_column_problem(path: Path | str | None, column: str | int | None) -> str | None:
    """The feature table at ``path`` lacks ``ingest.original_label_column``: read from its
    header only (a Parquet schema, a CSV's first row)."""
    if column is None or path is None or not Path(path).is_file():
        return None
    path, field = Path(path), "ingest.original_label_column"
    try:
        if path.suffix.lower() == ".parquet":
            import pyarrow.parquet as pq

            columns: list[str | int] = list(pq.read_schema(path).names)
        elif path.suffix.lower() == ".csv":
            import pandas as pd

            columns = list(range(2, pd.read_csv(path, header=None, nrows=1).shape[1]))  # 0, 1: bag label, bag id
        else:
            return f"{field}: {path} is not a .parquet or .csv table (an .npz gives the array 'original_labels')"
    except Exception as error:  # the ingest names the unreadable file with the full reason
        return f"{field}: cannot read the columns of {path}: {type(error).__name__}: {error}"
    if column not in columns or isinstance(column, bool):
        shown = ", ".join(map(str, columns[:20])) + (", …" if len(columns) > 20 else "")
        return f"{field}: {path} has no column {column!r} (its columns: {shown})"
    return None


def check_inputs(config: PipelineConfig, stage: Stage, *, store: str | None = None, model_dir: str | None = None,
                 source: str | None = None) -> None:
    """Raise :class:`ConfigError` listing every missing input of ``stage`` (``store`` and
    ``model_dir``: the command line's overrides and arguments; ``source``: a new cohort's folder
    that ``predict`` ingests first, whose store need not exist yet)."""
    ing = config.ingest
    checks: list[tuple[str, Path | str | None, Literal["file", "dir", "any"]]] = []
    ingests = stage == "ingest" or (stage == "run" and ing.kind != "none")
    if ingests:
        if ing.kind == "none":
            raise ConfigError("ingest.kind: is 'none': nothing to ingest (set wsi, ct, features, h5 or npy)")
        checks += [("ingest.source", ing.source, "file" if ing.kind == "features" else "dir"),
                   ("ingest.labels", getattr(ing.labels, "file", ing.labels), "file"),
                   ("ingest.extractor_from", ing.extractor_from, "dir")]
    if stage in ("run", "train") and not ingests:
        checks.append(("--store" if store else "store", store or config.store, "dir"))
    if stage == "run":
        checks.append(("prediction.store", config.prediction.store, "dir"))
    if stage == "predict" and source is not None:
        checks += [("--source", source, "file" if ing.kind == "features" else "dir"), ("MODEL_DIR", model_dir, "dir")]
        if model_dir is not None and Path(model_dir).is_dir():
            checks.append(("MODEL_DIR", Path(model_dir) / "model.json", "file"))
    elif stage in ("predict", "evaluate"):
        target = store or config.prediction.store or config.store
        field = "--store" if store else "prediction.store" if config.prediction.store else "store"
        checks += [("MODEL_DIR", model_dir, "dir"), (field, target, "dir")]
        if model_dir is not None and Path(model_dir).is_dir():
            checks.append(("MODEL_DIR", Path(model_dir) / "model.json", "file"))
    problems = [p for p in (_problem(*check) for check in checks) if p]
    if ing.kind == "features" and (ingests or (stage == "predict" and source is not None)):
        problems.append(_original_label_column_problem(source if stage == "predict" else ing.source, ing.original_label_column))
        problems = [p for p in problems if p]
    if problems:
        raise ConfigError("; ".join(problems))
