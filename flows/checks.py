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
    if problems:
        raise ConfigError("; ".join(problems))
