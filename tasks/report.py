"""Per-bag outputs of a prediction run: tables, evaluation metrics, figures and a Markdown report.

Plain functions over the store's ``predictions/<run>`` group and small in-memory tables; the Prefect
tasks in :mod:`tasks.prefect_tasks` wrap them and publish the results as UI artifacts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import zarr  # noqa: E402
from sklearn.metrics import (  # noqa: E402
    accuracy_score,
    brier_score_loss,
    confusion_matrix,
    f1_score,
    roc_auc_score,
    roc_curve,
)

from tasks.store import open_cohort  # noqa: E402
from tasks.training import read_predictions  # noqa: E402

ScoreKind = Literal["probability", "evidence"]

__all__ = [
    "bag_table",
    "evaluate",
    "calibration_table",
    "plot_elbo",
    "plot_roc",
    "plot_wsi_heatmap",
    "plot_ct_slices",
    "instance_scores",
    "write_tables",
    "Evaluation",
]


def bag_table(store: str | Path, run: str, *, threshold: float = 0.5, top_k: int = 3) -> pd.DataFrame:
    """One row per bag: id, source, label (−1 unknown), probability, std, predicted label, and the
    ``top_k`` most suspicious instances (row, coordinates, probability or evidence) as JSON."""
    cohort = open_cohort(store)
    pred = read_predictions(store, run)
    p_inst, kind = instance_scores(pred)
    coords = zarr.open_group(str(store), mode="r")["instances/coords"][: cohort.n_instances]
    suspicious = []
    for b in range(cohort.n_bags):
        rows = cohort.bag_slice(b)
        top = rows.start + np.argsort(-p_inst[rows], kind="stable")[:top_k]
        suspicious.append(json.dumps([
            {"row": int(r), "coords": coords[r].tolist(), kind: round(float(p_inst[r]), 6)} for r in top
        ]))
    table = pd.DataFrame({
        "bag_id": np.asarray(cohort.bag_ids, dtype=str),
        "source": np.asarray(cohort.sources, dtype=str),
        "label": np.asarray(cohort.bag_labels, dtype=int),
        "probability": pred["bags/proba"],
        "std": pred["bags/std"],
    })
    table["predicted_label"] = (table["probability"] >= threshold).astype(int)
    table["most_suspicious"] = suspicious
    return table


def instance_scores(predictions: dict[str, np.ndarray]) -> tuple[np.ndarray, ScoreKind]:
    """Instance probabilities, or the evidences (real-valued, not probabilities: VWSGP) of models
    that have no instance probability, and which of the two they are."""
    if "instances/proba" in predictions:
        return predictions["instances/proba"], "probability"
    return predictions["instances/evidence"], "evidence"


@dataclass(frozen=True)
class Evaluation:
    """Bag metrics (and instance metrics where instance labels exist) of a prediction run."""

    metrics: dict[str, float]
    confusion: np.ndarray
    calibration: pd.DataFrame
    roc: tuple[np.ndarray, np.ndarray]


def evaluate(table: pd.DataFrame, *, threshold: float = 0.5, instance_labels: np.ndarray | None = None,
             instance_proba: np.ndarray | None = None, n_bins: int = 10) -> Evaluation:
    """AUC, accuracy, F1, Brier score and expected calibration error on the labelled, predicted
    bags; the same for instances whose label is known (``instance_labels`` ≥ 0) and predicted."""
    labelled = table[(table["label"] >= 0) & table["probability"].notna()]  # a bag not predicted (NaN) is not scored
    if labelled["label"].nunique() < 2:
        raise ValueError(f"evaluation needs labelled bags of both classes; found labels {sorted(labelled['label'].unique())}")
    y, p = labelled["label"].to_numpy(), labelled["probability"].to_numpy()
    predicted = (p >= threshold).astype(int)
    calibration = calibration_table(y, p, n_bins)
    metrics = {
        "n_bags": int(len(labelled)),
        "bag_auc": float(roc_auc_score(y, p)),
        "bag_accuracy": float(accuracy_score(y, predicted)),
        "bag_f1": float(f1_score(y, predicted, zero_division=0.0)),
        "bag_brier": float(brier_score_loss(y, p)),
        "bag_ece": float(np.sum(calibration["count"] * np.abs(calibration["mean_predicted"] - calibration["fraction_positive"])) / len(y)),
    }
    if instance_labels is not None and instance_proba is not None:
        known = (instance_labels >= 0) & np.isfinite(instance_proba)
        if known.any() and np.unique(instance_labels[known]).size == 2:
            yi, pi = instance_labels[known], instance_proba[known]
            metrics |= {
                "n_instances_labelled": int(known.sum()),
                "instance_auc": float(roc_auc_score(yi, pi)),
                "instance_accuracy": float(accuracy_score(yi, pi >= threshold)),
                "instance_f1": float(f1_score(yi, pi >= threshold, zero_division=0.0)),
            }
    fpr, tpr, _ = roc_curve(y, p)
    return Evaluation(metrics=metrics, confusion=confusion_matrix(y, predicted, labels=[0, 1]), calibration=calibration, roc=(fpr, tpr))


def calibration_table(y: np.ndarray, p: np.ndarray, n_bins: int = 10) -> pd.DataFrame:
    """Reliability table: equal-width probability bins with count, mean predicted probability and
    observed fraction of positives (empty bins left out)."""
    bins = np.clip((p * n_bins).astype(int), 0, n_bins - 1)
    rows = [
        {"bin": f"[{k / n_bins:.1f}, {(k + 1) / n_bins:.1f})", "count": int(m.sum()), "mean_predicted": float(p[m].mean()),
         "fraction_positive": float(y[m].mean())}
        for k in range(n_bins) if (m := bins == k).any()
    ]
    return pd.DataFrame(rows)


def write_tables(table: pd.DataFrame, out_dir: str | Path, name: str = "bag_predictions") -> list[Path]:
    """The per-bag table as CSV and Parquet."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.csv", out_dir / f"{name}.parquet"]
    table.to_csv(paths[0], index=False)
    table.to_parquet(paths[1], index=False)
    return paths


# ------------------------------------------------------------------------------------- figures
def _save(fig: plt.Figure, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_elbo(objective: np.ndarray, path: str | Path) -> Path:
    fig, ax = plt.subplots(figsize=(4.5, 3))
    ax.plot(np.arange(1, len(objective) + 1), objective, marker=".")
    ax.set(xlabel="iteration", ylabel="ELBO", title="Training objective")
    return _save(fig, path)


def plot_roc(evaluation: Evaluation, path: str | Path) -> Path:
    fpr, tpr = evaluation.roc
    fig, ax = plt.subplots(figsize=(3.5, 3.5))
    ax.plot(fpr, tpr, label=f"AUC {evaluation.metrics['bag_auc']:.3f}")
    ax.plot([0, 1], [0, 1], ls=":", c="grey")
    ax.set(xlabel="false positive rate", ylabel="true positive rate", title="Bag ROC")
    ax.legend(loc="lower right")
    return _save(fig, path)


def _colour_scale(scores: np.ndarray, kind: ScoreKind) -> dict[str, Any]:
    """Probabilities on [0, 1]; evidences on a diverging scale symmetric about 0 (their sign is
    what says "towards positive")."""
    if kind == "probability":
        return dict(cmap="inferno", vmin=0.0, vmax=1.0)
    bound = float(np.max(np.abs(scores))) or 1.0
    return dict(cmap="RdBu_r", vmin=-bound, vmax=bound)


SCORE_LABELS = {"probability": "p(tile positive)", "evidence": "instance evidence (not a probability)"}


def plot_wsi_heatmap(coords: np.ndarray, scores: np.ndarray, path: str | Path, *, kind: ScoreKind = "probability",
                     thumbnail: np.ndarray | None = None, tile_px_on_thumbnail: float | None = None, title: str = "") -> Path:
    """Tile probabilities (or evidences, ``kind``) painted on the tile grid (``coords`` = tile
    row, col), over the slide thumbnail when one is given (``tile_px_on_thumbnail`` = one tile's
    size in thumbnail pixels)."""
    rows, cols = coords[:, 0], coords[:, 1]
    grid = np.full((rows.max() + 1, cols.max() + 1), np.nan)
    grid[rows, cols] = scores
    fig, ax = plt.subplots(figsize=(5, 5 * grid.shape[0] / max(grid.shape[1], 1)))
    extent = None
    if thumbnail is not None and tile_px_on_thumbnail:
        ax.imshow(thumbnail)
        extent = (0, grid.shape[1] * tile_px_on_thumbnail, grid.shape[0] * tile_px_on_thumbnail, 0)
    image = ax.imshow(grid, **_colour_scale(scores, kind), alpha=0.6 if thumbnail is not None else 1.0, extent=extent,
                      interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.046, label=SCORE_LABELS[kind])
    ax.set_axis_off()
    ax.set_title(title)
    return _save(fig, path)


def plot_ct_slices(slice_index: np.ndarray, scores: np.ndarray, std: np.ndarray, path: str | Path, *,
                   kind: ScoreKind = "probability", instance_labels: np.ndarray | None = None, title: str = "") -> Path:
    """Slice probabilities (or evidences, ``kind``) with a ±1 std band along the scan, and the
    known slice labels where they exist (like seed 000, Fig. 10; on the probability scale only)."""
    order = np.argsort(slice_index)
    z, p, s = slice_index[order], scores[order], std[order]
    fig, ax = plt.subplots(figsize=(6, 2.8))
    if kind == "probability":
        ax.plot(z, p, c="C0", label="p(slice positive)")
        ax.fill_between(z, np.clip(p - s, 0, 1), np.clip(p + s, 0, 1), color="C0", alpha=0.25, label="± 1 std")
        if instance_labels is not None and np.any(instance_labels[order] >= 0):
            known = instance_labels[order] >= 0
            ax.scatter(z[known], instance_labels[order][known], marker="|", c="C3", label="slice label")
        ax.set(ylabel="probability", ylim=(-0.05, 1.05))
    else:
        ax.plot(z, p, c="C0", label="slice evidence")
        ax.fill_between(z, p - s, p + s, color="C0", alpha=0.25, label="± 1 std")
        ax.axhline(0.0, ls=":", c="grey")
        ax.set(ylabel="evidence (not a probability)")
    ax.set(xlabel="slice", title=title)
    ax.legend(loc="upper right", fontsize="small")
    return _save(fig, path)


def markdown_table(frame: pd.DataFrame, float_format: str = "{:.3f}") -> str:
    """A small DataFrame as a Markdown table (no tabulate dependency)."""
    def cell(v: Any) -> str:
        return float_format.format(v) if isinstance(v, (float, np.floating)) else str(v)

    header = "| " + " | ".join(map(str, frame.columns)) + " |"
    rule = "|" + "---|" * len(frame.columns)
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *body])
