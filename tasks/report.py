"""Per-bag outputs of a prediction run: tables, evaluation metrics, figures and a Markdown report.

Plain functions over the store's ``predictions/<run>`` group and small in-memory tables; the Prefect
tasks in :mod:`tasks.prefect_tasks` wrap them and publish the results as UI artifacts.
"""

from __future__ import annotations

import html
import io
import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import zarr  # noqa: E402

from mil_core.persist import write_whole  # noqa: E402
from tasks.grid import fundamental_step, grid_step, neighbour_gaps  # noqa: E402
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
    "can_evaluate",
    "choices_text",
    "evaluate",
    "model_choices",
    "calibration_table",
    "plot_objective",
    "plot_roc",
    "plot_wsi_heatmap",
    "predicted",
    "most_likely_positive",
    "predicted_labels",
    "level0_tiles",
    "cohort_tile_side",
    "heatmap_canvas",
    "in_level0_pixels",
    "plot_ct_slices",
    "plot_ct_strip",
    "instance_scores",
    "write_csv",
    "write_tables",
    "summary_text",
    "instance_table",
    "original_label_text",
    "tile_geojson",
    "write_geojson",
    "Evaluation",
]


def original_label_text(value: Any) -> str:
    """An original label for a table cell: ``3``, ``tumor``, RSNA subtypes as compact JSON, "" for none."""
    if value is None:
        return ""
    return json.dumps(value, sort_keys=True, separators=(",", ":")) if isinstance(value, (dict, list)) else str(value)


def bag_table(store: str | Path, run: str, *, threshold: float = 0.5, top_k: int = 3) -> pd.DataFrame:
    """One row per bag: id, source, label (−1 unknown), the original label (the labels file's value,
    e.g. the ISUP grade; "" if none), probability, std, predicted label, and the ``top_k`` most
    suspicious instances (the store's ``row``, the ``instance`` index within the bag — the key of
    ``instance_predictions`` with the bag id —, coordinates, SOPInstanceUID where stored,
    probability or evidence) as JSON."""
    cohort = open_cohort(store)
    pred = read_predictions(store, run)
    p_inst, kind = instance_scores(pred)
    coords = zarr.open_group(str(store), mode="r", zarr_format=3)["instances/coords"][: cohort.n_instances]
    ids = cohort.instance_ids() if cohort.instance_id_kind else None
    suspicious = []
    for b in range(cohort.n_bags):
        rows = cohort.bag_slice(b)
        top = rows.start + np.argsort(-p_inst[rows], kind="stable")[:top_k]
        suspicious.append(json.dumps([
            {"row": int(r), "instance": int(r - rows.start), "coords": coords[r].tolist(),
             **({} if ids is None else {cohort.instance_id_kind: str(ids[r])}),
             kind: round(float(p_inst[r]), 6)} for r in top if np.isfinite(p_inst[r])  # a bag not predicted: none
        ], allow_nan=False))
    table = pd.DataFrame({
        "bag_id": np.asarray(cohort.bag_ids, dtype=str),
        "source": np.asarray(cohort.sources, dtype=str),
        "label": np.asarray(cohort.bag_labels, dtype=int),
        "original_label": [original_label_text(v) for v in cohort.original_labels],
        "probability": pred["bags/proba"],
        "std": pred["bags/std"],
    })
    table["predicted_label"] = predicted_labels(table["probability"], threshold)
    table["most_suspicious"] = suspicious
    return table


def predicted_labels(probability: pd.Series, threshold: float) -> pd.Series:
    """1 where ``probability ≥ threshold``, 0 below, empty (``<NA>``) for a bag not predicted (NaN):
    such a bag is neither positive nor negative."""
    return (probability >= threshold).astype("Int64").mask(probability.isna())


def predicted(table: pd.DataFrame) -> pd.DataFrame:
    """The bags of ``table`` that were predicted (a bag whose features gave NaN was not)."""
    return table[table["probability"].notna()]


def most_likely_positive(table: pd.DataFrame, n: int) -> pd.DataFrame:
    """The ``n`` predicted bags of ``table`` with the highest probability: a bag not predicted has
    no probability to rank, nor scores to draw."""
    return predicted(table).sort_values("probability", ascending=False).head(n)


def can_evaluate(table: pd.DataFrame) -> bool:
    """Whether the predicted bags of ``table`` include labelled bags of both classes (what
    :func:`evaluate` needs)."""
    labelled = predicted(table)
    return labelled.loc[labelled["label"] >= 0, "label"].nunique() == 2


def instance_table(store: str | Path, run: str) -> pd.DataFrame:
    """One row per instance: ``bag_id``, ``instance`` (index in its bag), the level-0 ``x``, ``y``
    of its tile (slide and ``.h5`` cohorts) or its ``slice_index`` and ``sop_instance_uid`` (CT, read
    from the store: the DICOM folder is not needed) or its stored coordinates, the ``probability``
    (or ``evidence``) and its ``std``."""
    cohort = open_cohort(store)
    pred = read_predictions(store, run)
    scores, kind = instance_scores(pred)
    n = cohort.n_instances
    offsets = np.asarray(cohort.offsets)
    sizes = np.diff(offsets)
    bag_of_row = np.repeat(np.arange(cohort.n_bags), sizes)
    coords = zarr.open_group(str(store), mode="r", zarr_format=3)["instances/coords"][:n]
    meaning = str(cohort.attrs.get("coords_meaning", ""))
    columns: dict[str, Any] = {"bag_id": pd.Categorical.from_codes(bag_of_row, np.asarray(cohort.bag_ids, dtype=str)),
                               "instance": np.arange(n) - offsets[bag_of_row]}
    if (xy := _level0_xy(coords, meaning)) is not None:
        columns |= {"x": xy[:, 0], "y": xy[:, 1]}
    elif meaning == "slice_index":
        columns["slice_index"] = coords[:, 0]
        if cohort.instance_id_kind == "SOPInstanceUID":
            columns["sop_instance_uid"] = cohort.instance_ids()
    else:
        columns |= {f"coord_{j}": coords[:, j] for j in range(coords.shape[1])}
    columns |= {kind: scores[:n], "std": pred["instances/std"][:n]}
    return pd.DataFrame(columns)


def tile_geojson(xy: np.ndarray, side: float, scores: np.ndarray, std: np.ndarray, *,
                 kind: ScoreKind = "probability", bag_id: str | None = None) -> str:
    """A GeoJSON FeatureCollection QuPath imports, as compact JSON text: one square tile per
    instance in level-0 pixels, with its score and std as measurements (a value a model does not
    give — AbSMIL's std — is left out: JSON has no NaN). ``bag_id`` is kept as the collection's
    ``bag_id`` member (RFC 7946 §6.1), since the file name is a filesystem-safe form of it. Written
    as text, tile by tile (a slide of 10⁵ tiles built as dicts and dumped took 45 µs a tile)."""
    xy, side = np.asarray(xy, dtype=float), float(side)
    if not (np.isfinite(xy).all() and math.isfinite(side)):
        raise ValueError("tile corners and side must be finite numbers (JSON has no NaN or infinity)")
    names = (json.dumps(kind), '"std"')
    lines = []
    for (x, y), score, sd in zip(xy.tolist(), np.asarray(scores, dtype=float).tolist(), np.asarray(std, dtype=float).tolist()):
        right, bottom = x + side, y + side
        measurements = ",".join(f"{name}:{value!r}" for name, value in zip(names, (score, sd)) if math.isfinite(value))
        lines.append(f'{{"type":"Feature","geometry":{{"type":"Polygon","coordinates":[[[{x!r},{y!r}],[{right!r},{y!r}],'
                     f'[{right!r},{bottom!r}],[{x!r},{bottom!r}],[{x!r},{y!r}]]]}},"properties":{{"objectType":"tile",'
                     f'"isLocked":true,"classification":{{"name":"gpmil tile"}},"measurements":{{{measurements}}}}}}}')
    named = "" if bag_id is None else f',"bag_id":{json.dumps(str(bag_id))}'
    return f'{{"type":"FeatureCollection"{named},"features":[{",".join(lines)}]}}'


def write_geojson(text: str, path: str | Path) -> Path:
    """Write :func:`tile_geojson`'s text (its parent folders made as needed)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


ARD_FEATURES_SHOWN = 5  # features (0-based columns) with the shortest learnt ARD length scales, in model.json and the report


def model_choices(model: Any) -> dict[str, Any]:
    """What a fit chose from its training bags, for ``model.json`` and the report: the kernel
    variance (``kernel=None``: chosen; learnt kernels: learnt) and its length scale when scalar
    (an ARD kernel: the features with the shortest scales, ``shortest_length_scales``),
    the mean held-out bag AUC of each variance the choice tried (``kernel_selection_``), the
    bag rule in use (``bag_rule_``; ``bag_rule="auto"`` chose it) and the logistic family's
    bag-likelihood odds (``H_``; with ``H="auto"`` the choice's best AUC per H). EmbeddedGPMIL: each
    member GP's, under ``"members"``, and the representation they see with the two out-of-fold AUCs
    that chose it. Empty for a model that has none of these."""
    members = getattr(model, "gps_", None)
    if members is not None:
        choices = {"members": [model_choices(gp) for gp in members]}
        if hasattr(model, "representation_auc_"):
            choices["representation"] = model.representation_
            choices["representation_held_out_auc"] = {k: None if np.isnan(v) else round(float(v), 4)
                                                      for k, v in model.representation_auc_.items()}
        return choices
    choices: dict[str, Any] = {}
    kernel = getattr(model, "kernel_", None)
    if kernel is not None and hasattr(kernel, "variance"):
        choices["kernel_variance"] = float(kernel.variance)
        if getattr(kernel, "bias", 0.0):
            choices["kernel_bias"] = float(kernel.bias)
        scales = np.asarray(kernel.length_scale, dtype=np.float64)  # resolved: a number, or one per feature (ARD)
        if scales.ndim == 0:
            choices["length_scale"] = float(scales)
        else:  # the shortest learnt scales are the features the kernel weighs most
            shortest = np.argsort(scales, kind="stable")[:ARD_FEATURES_SHOWN]
            choices["shortest_length_scales"] = {str(int(d)): round(float(scales[d]), 4) for d in shortest}
    selection = np.asarray(getattr(model, "kernel_selection_", np.empty((0, 2))), dtype=np.float64)
    if selection.size:
        choices["held_out_auc_by_variance"] = _aucs_by_value(selection)
    if getattr(model, "bag_rule_", None) is not None:
        choices["bag_rule"] = str(model.bag_rule_)
        choices["bag_rule_chosen"] = getattr(model, "bag_rule", None) == "auto"
    tried = getattr(model, "setting_selection_", [])
    if getattr(model, "H_", None) is not None:
        choices["H"] = float(model.H_)
        if any("H" in setting for setting, _ in tried):  # H="auto": the choice's best mean held-out bag AUC with each H
            choices["held_out_auc_by_H"] = _aucs_by_value(_best_per_value(tried, "H", None))
    if any("kernel_bias" in setting for setting, _ in tried):  # the constant kernel, b/v: 0 (none) or 1, with ℓ = √D
        isotropic = [(setting, auc) for setting, auc in tried if "relevance" not in setting]
        choices["held_out_auc_by_kernel_bias"] = _aucs_by_value(_best_per_value(isotropic, "kernel_bias", 0.0))
    if any("relevance" in setting for setting, _ in tried):  # per-feature length scales from the bag labels: none or a weighting
        choices["held_out_auc_by_relevance"] = _aucs_by_value(_best_per_value(tried, "relevance", "none"))
    return choices


def _best_per_value(tried: list[tuple[dict[str, Any], float]], name: str, absent: Any) -> list[tuple[float | str, float]]:
    """The best of ``setting_selection_``'s AUCs per value of one setting (``absent``: a setting
    that does not name it); nan only where every setting with that value was degenerate."""
    best: dict[float | str, float] = {}
    for setting, auc in tried:
        value = setting.get(name, absent)
        best[value] = auc if np.isnan(best.get(value, np.nan)) else float(np.nanmax([best[value], auc]))
    return list(best.items())


def _aucs_by_value(pairs: Iterable[tuple[float | str, float]]) -> dict[str, float | None]:
    """The kernel choice's best mean held-out AUC per value it tried (a variance, an H, a relevance
    weighting), for ``model.json``: keyed by the value (a number as ``:g``), rounded; ``None`` where
    every checkpoint was degenerate."""
    return {value if isinstance(value, str) else f"{value:g}": None if np.isnan(auc) else round(float(auc), 4) for value, auc in pairs}


def _aucs_text(aucs: dict[str, float | None]) -> str:
    """:func:`_aucs_by_value` as the report writes it."""
    return ", ".join(f"{value}: {'degenerate' if auc is None else f'{auc:.3f}'}" for value, auc in aucs.items())


def choices_text(choices: dict[str, Any], chosen_sweeps: int | None = None) -> str:
    """One sentence of the report on :func:`model_choices` (and the sweeps ``kernel=None`` chose)."""
    if "representation" in choices:
        aucs = {k: "not measured" if v is None else f"{v:.3f}" for k, v in choices["representation_held_out_auc"].items()}
        kept = ("Its GPs see the input features, not the networks' embeddings"
                if choices["representation"] == "features" else "Its GPs see the networks' embeddings")
        rest = choices_text({k: v for k, v in choices.items() if not k.startswith("representation")}, chosen_sweeps)
        return (f"{kept} (out-of-fold bag AUC of the networks {aucs['embedding']}, of GPs on the input features "
                f"{aucs['features']}). {rest}").strip()
    if "members" in choices:
        members = choices["members"]
        variances = ", ".join(f"{c['kernel_variance']:g}" for c in members if "kernel_variance" in c)
        rules = ", ".join(c["bag_rule"] for c in members if "bag_rule" in c)
        odds = ", ".join(f"{c['H']:g}" for c in members if "H" in c)
        parts = [f"kernel variances {variances}" * bool(variances), f"bag rules {rules}" * bool(rules),
                 f"bag-likelihood odds H {odds}" * bool(odds)]
        shown = "; ".join(p for p in parts if p)
        return f"Its {len(members)} member GPs chose from their training bags: {shown}." if shown else ""
    parts = []
    if "kernel_variance" in choices:
        scale = f", length scale {choices['length_scale']:.3g}" if "length_scale" in choices else ""
        bias = f", plus a constant kernel b = {choices['kernel_bias']:g}" if "kernel_bias" in choices else ""
        parts.append(f"kernel variance {choices['kernel_variance']:g}{scale}{bias}")
    if "shortest_length_scales" in choices:
        shortest = ", ".join(f"{d} ({ell:.3g})" for d, ell in choices["shortest_length_scales"].items())
        parts.append(f"one length scale per feature, the shortest (the features it weighs most) at columns {shortest}")
    if "held_out_auc_by_variance" in choices:
        tried = _aucs_text(choices["held_out_auc_by_variance"])
        parts.append(f"chosen by held-out bag AUC on splits of the training bags (per variance {tried})")
    if chosen_sweeps is not None:
        parts.append(f"{chosen_sweeps} sweeps, chosen with it")
    if "bag_rule" in choices:
        how = " (`bag_rule=\"auto\"`: `top_fraction` unless another rule is clearly better there)" if choices.get("bag_rule_chosen") else ""
        parts.append(f"bag rule `{choices['bag_rule']}`{how}")
    if "H" in choices:
        tried = _aucs_text(choices.get("held_out_auc_by_H", {}))
        parts.append(f"bag-likelihood odds H = {choices['H']:g}" + (f" (`H=\"auto\"`, chosen with the kernel: {tried})" if tried else ""))
    if "held_out_auc_by_kernel_bias" in choices:
        kept = "the constant kernel" if "kernel_bias" in choices else "no constant kernel"
        parts.append(f"{kept} after trying b = v near the chosen variance (best per b/v {_aucs_text(choices['held_out_auc_by_kernel_bias'])})")
    if "held_out_auc_by_relevance" in choices:
        kept = "per-feature length scales" if "shortest_length_scales" in choices else "one length scale"
        parts.append(f"{kept} after trying features weighed by their bag-label evidence near the chosen variance "
                     f"(best per weighting {_aucs_text(choices['held_out_auc_by_relevance'])})")
    return ("Fitted with " + "; ".join(parts) + ".") if parts else ""


def scoring_text(bag_kwargs: dict[str, Any] | None, instance_kwargs: dict[str, Any] | None, choices: dict[str, Any]) -> str:
    """How a prediction scored its bags, as its group recorded it (``bag_kwargs``: ``prediction.rule``
    where the configuration set one, else the model's own rule; ``prediction.method``); empty for a
    prediction written before it recorded them."""
    if bag_kwargs is None:
        return ""
    parts = []
    own = choices.get("bag_rule")
    if "rule" in bag_kwargs:
        instead = f", not the model's own `{own}`" if own and own != bag_kwargs["rule"] else ""
        parts.append(f"rule `{bag_kwargs['rule']}` (`prediction.rule`{instead})")
    elif own:
        parts.append(f"the model's bag rule `{own}`")
    elif "members" in choices:  # EmbeddedGPMIL: its calibrated ensemble score, not a rule on instance probabilities
        parts.append("the ensemble's calibrated score (`rule=\"ensemble\"`)")
    if method := bag_kwargs.get("method") or (instance_kwargs or {}).get("method"):
        parts.append(f"method `{method}` (`prediction.method`)")
    return ("Bag probabilities of this prediction: " + "; ".join(parts) + ".") if parts else ""


def summary_text(table: pd.DataFrame, *, threshold: float = 0.5, top: int = 5, metrics: dict[str, Any] | None = None,
                 where: dict[str, str] | None = None) -> str:
    """A few lines for a terminal: counts, the most likely positive bags, the least certain ones,
    metrics where labels exist and where the outputs are."""
    scored = predicted(table)
    n_pos = int((scored["probability"] >= threshold).sum())
    missing = f"; {len(table) - len(scored)} not predicted" if len(scored) < len(table) else ""
    lines = [f"{len(scored)} bags predicted: {n_pos} positive, {len(scored) - n_pos} negative (threshold {threshold:g}){missing}"]

    def rows(frame: pd.DataFrame) -> list[str]:
        width = max([len(str(b)) for b in frame["bag_id"]] + [6])
        def label(r: Any) -> str:
            original = getattr(r, "original_label", "")
            shown = [f"label {r.label}"] * (r.label >= 0) + [f"original {original}"] * bool(original)
            return f"  ({', '.join(shown)})" if shown else ""

        def spread(r: Any) -> str:  # AbSMIL gives no std: none shown rather than "± nan"
            return f" ± {r.std:.3f}" if np.isfinite(r.std) else ""

        return [f"  {str(r.bag_id):<{width}}  p = {r.probability:.3f}{spread(r)}{label(r)}" for r in frame.itertuples()]

    lines += ["most likely positive:"] + rows(most_likely_positive(scored, top))
    if (with_std := scored[scored["std"].notna()]).size:  # AbSMIL gives no std
        lines += ["least certain (highest std):"] + rows(with_std.sort_values("std", ascending=False).head(min(top, 3)))
    if metrics:
        shown = {k: metrics[k] for k in ("bag_auc", "bag_accuracy", "bag_f1", "bag_brier", "instance_auc") if k in metrics}
        lines.append("metrics: " + ", ".join(f"{k} {v:.3f}" for k, v in shown.items()))
    for name, path in (where or {}).items():
        lines.append(f"{name}: {path}")
    return "\n".join(lines)


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
    labelled = predicted(table)
    labelled = labelled[labelled["label"] >= 0]
    if not can_evaluate(table):
        raise ValueError(f"evaluation needs labelled bags of both classes; found labels {sorted(labelled['label'].unique())}")
    y, p = labelled["label"].to_numpy(), labelled["probability"].to_numpy()
    hard = (p >= threshold).astype(int)
    calibration = calibration_table(y, p, n_bins)
    metrics = {
        "n_bags": int(len(labelled)),
        "bag_auc": float(roc_auc_score(y, p)),
        "bag_accuracy": float(accuracy_score(y, hard)),
        "bag_f1": float(f1_score(y, hard, zero_division=0.0)),
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
    return Evaluation(metrics=metrics, confusion=confusion_matrix(y, hard, labels=[0, 1]), calibration=calibration, roc=(fpr, tpr))


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
    """The per-bag table as CSV (:func:`write_csv`) and Parquet (every id exact)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"{name}.csv", out_dir / f"{name}.parquet"]
    write_csv(table, paths[0])
    table.to_parquet(paths[1], index=False)
    return paths


_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_LINE_STARTS = re.compile(r"(?<=[\r\n])(?=[^\r\n])")  # where a line of a multi-line text cell begins


def write_csv(table: pd.DataFrame, path: str | Path) -> None:
    """``table`` as CSV for a spreadsheet: a text cell that Excel or LibreOffice would run as a
    formula (it starts with ``= + - @``, a tab or a carriage return and is not a number; a bag id
    or slide name is whatever the file was called, ``=HYPERLINK(…)`` included) is written with a
    leading ``'``, which the spreadsheet shows as text (OWASP's CSV injection advice), and so is
    each line of a cell that starts so after a line break (``case\\r=2+5``), for a reader that
    splits lines inside a cell. Rows end in CRLF (RFC 4180), so that a cell holding a bare ``\\r``
    is quoted like one holding ``\\n``: unquoted, it split its row in two and put ``=2+5`` at the
    start of a cell. The Parquet tables keep every value exact."""
    safe = table.copy()
    for column in safe.columns:
        if pd.api.types.is_object_dtype(safe[column]) or pd.api.types.is_string_dtype(safe[column]):
            safe[column] = safe[column].map(_as_text_cell)
    safe.to_csv(path, index=False, lineterminator="\r\n")


def _as_text_cell(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    if "\r" not in value and "\n" not in value:  # nearly every cell: one line
        return _as_text_line(value)
    return "".join(_as_text_line(line) for line in _LINE_STARTS.split(value))


def _as_text_line(line: str) -> str:
    if not line.startswith(_FORMULA_START):
        return line
    try:
        float(line)
        return line  # -0.5, +3: a number, no formula
    except ValueError:
        return "'" + line


# ------------------------------------------------------------------------------------- figures
def _save(fig: plt.Figure, path: str | Path) -> Path:
    """``fig`` written whole at ``path`` (a model folder's is shared: never through a link there)."""
    path = Path(path)
    buffer = io.BytesIO()
    fig.savefig(buffer, format=path.suffix.lstrip(".") or "png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return write_whole(path, buffer.getvalue())


def plot_objective(objective: np.ndarray, path: str | Path, name: str = "ELBO") -> Path:
    """The training objective per iteration, labelled with what it is (the estimator's
    ``objective_name``: ELBO, a sampler's log joint, a loss)."""
    fig, ax = plt.subplots(figsize=(4.5, 3))
    ax.plot(np.arange(1, len(objective) + 1), objective, marker=".")
    ax.set(xlabel="iteration", ylabel=name, title=f"Training objective: {name}")
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


def level0_tiles(coords: np.ndarray, coords_meaning: str, side: float | None = None) -> tuple[np.ndarray, float]:
    """Tile top-left corners ``(x, y)`` in level-0 pixels and the tile side there, from the stored
    coordinates: slide stores (``tile_row,tile_col,x,y``), CLAM/TRIDENT ``.h5`` and named table
    columns (``x,y``; the side is ``side`` — the cohort's, :func:`cohort_tile_side` — else the grid
    step of these coordinates), else a grid (row, col) in tile units (side 1)."""
    xy = _level0_xy(np.asarray(coords), coords_meaning)
    if xy is None:
        return np.asarray(coords)[:, 1::-1][:, :2].astype(np.float64), 1.0
    own = _slide_tile_side(np.asarray(coords)) if coords_meaning.startswith(SLIDE_TILES) else None
    return xy.astype(np.float64), own or side or grid_step(xy) or 1.0


SLIDE_TILES = "tile_row,tile_col,x,y"
"""How a slide store's coordinates start: the tile's grid row and column, then its level-0 corner."""


def _slide_tile_side(coords: np.ndarray) -> float | None:
    """A slide's own tile side in level-0 pixels, from its tiles' grid rows, columns and corners: the
    median over rows of Δx / Δcol between a row's first and last tile and over columns of Δy / Δrow
    (a one-tile-wide strip, a needle core, has only columns). Exact where the level-0 footprint is
    fractional (``target_mpp``: corners 256 and 257 px apart alternately) and per slide in a cohort
    of several magnifications. None for a slide of one tile (nothing to measure): it takes the
    cohort's side, which may be another magnification's."""
    steps = np.concatenate([_steps_along_lines(coords[:, [0, 1, 2]]), _steps_along_lines(coords[:, [1, 0, 3]])])
    return float(np.median(steps)) if len(steps) else None


def _steps_along_lines(lines: np.ndarray) -> np.ndarray:
    """Per grid line of ``lines`` (columns: the line — a row or a column —, the tile's place along
    it, its level-0 coordinate along it) with two tiles or more, the level-0 pixels per grid step
    between its first and last tile."""
    ordered = lines[np.lexsort((lines[:, 1], lines[:, 0]))].astype(np.float64)  # by line, then place along it
    _, first = np.unique(ordered[:, 0], return_index=True)
    last = np.append(first[1:], len(ordered)) - 1
    spans = ordered[last, 1] - ordered[first, 1]  # the grid steps between a line's first and last tile
    measured = spans > 0
    return (ordered[last, 2] - ordered[first, 2])[measured] / spans[measured]


def cohort_tile_side(coords: np.ndarray, offsets: np.ndarray, coords_meaning: str) -> float | None:
    """The tile side of a cohort whose coordinates are level-0 pixels: the grid step of the gaps
    between neighbouring tiles in a row or column, over all bags (one patch size per cohort,
    :func:`tasks.grid.fundamental_step`), so that a bag of one tile, or of scattered tiles, gets squares of
    the patch size rather than of its own spacing, and two tissue pieces whose grids CLAM started a
    few pixels apart do not make every square a few pixels wide; None for other coordinates or when
    no bag has two tiles in a row or column."""
    xy = _level0_xy(np.asarray(coords), coords_meaning)
    if xy is None:
        return None
    if coords_meaning.startswith(SLIDE_TILES):  # each slide knows its own: the median slide's, for one-tile slides
        sides = [side for start, stop in zip(offsets[:-1], offsets[1:])
                 if (side := _slide_tile_side(np.asarray(coords[start:stop]))) is not None]
        return float(np.median(sides)) if sides else None
    found = [neighbour_gaps(xy[start:stop]) for start, stop in zip(offsets[:-1], offsets[1:])]
    return fundamental_step(np.concatenate(found) if found else np.zeros(0))


def in_level0_pixels(coords_meaning: str) -> bool:
    """Whether a store's coordinates hold each tile's level-0 corner (slides, ``.h5``, a table's x, y)."""
    return coords_meaning.startswith((SLIDE_TILES, "x,y"))


def _level0_xy(coords: np.ndarray, coords_meaning: str) -> np.ndarray | None:
    if not in_level0_pixels(coords_meaning):
        return None
    return coords[:, 2:4] if coords_meaning.startswith(SLIDE_TILES) else coords[:, :2]


def heatmap_canvas(xy: np.ndarray, side: float, scores: np.ndarray, shape: tuple[int, int] | None = None,
                   downsample: float | None = None, max_side: int = 1024) -> tuple[np.ndarray, float]:
    """Tile scores painted on a canvas of thumbnail resolution (NaN where there is no tile):
    ``shape``/``downsample`` of a slide thumbnail, else at most ``max_side`` pixels over the tiles'
    extent. Memory is the canvas, whatever the coordinates' range."""
    if shape is None or downsample is None:
        extent = float(max(xy[:, 0].max(), xy[:, 1].max()) + side) if len(xy) else side
        downsample = max(extent / max_side, 1e-9)
        shape = (int(np.ceil((xy[:, 1].max() + side) / downsample)), int(np.ceil((xy[:, 0].max() + side) / downsample)))
    canvas = np.full(shape, np.nan)
    y0 = np.clip(np.floor(xy[:, 1] / downsample).astype(np.int64), 0, shape[0] - 1)
    x0 = np.clip(np.floor(xy[:, 0] / downsample).astype(np.int64), 0, shape[1] - 1)
    y1 = np.maximum(np.ceil((xy[:, 1] + side) / downsample).astype(np.int64), y0 + 1)
    x1 = np.maximum(np.ceil((xy[:, 0] + side) / downsample).astype(np.int64), x0 + 1)
    for a, b, c, d, s in zip(y0, y1, x0, x1, scores):
        canvas[a:b, c:d] = s
    return canvas, downsample


HEATMAP_INCHES = (2.5, 8.0)
"""A heatmap figure's shortest and longest side: a needle core's strip of tiles neither becomes a
figure metres long nor squeezes its colourbar unreadably thin."""

TITLE_CHARS = 60
"""The most characters a figure title shows: a longer one (a 300-character bag id) is cut in its
middle; the tables and the figure's file name carry the whole id."""


def _figure_title(title: str) -> str:
    """``title`` as a figure shows it: at most :data:`TITLE_CHARS` characters, cut in the middle so
    that its end (the score, the distinguishing tail of a DICOM UID) stays, and each ``$`` shown
    as itself (matplotlib read ``$\\foo$`` in a bag id as mathtext and failed the report)."""
    if len(title) > TITLE_CHARS:
        tail = (TITLE_CHARS - 1) // 3
        title = title[: TITLE_CHARS - 1 - tail] + "…" + title[-tail:]
    return title.replace("$", r"\$")


def _heatmap_figsize(canvas_shape: tuple[int, int]) -> tuple[float, float]:
    """Inches for a heatmap of ``canvas_shape``: 5 wide at the canvas's aspect, scaled down to a
    longer side of at most ``HEATMAP_INCHES[1]``, each side at least ``HEATMAP_INCHES[0]`` (the image
    keeps its aspect inside; the colourbar gets the height)."""
    shortest, longest = HEATMAP_INCHES
    width, height = 5.0, 5.0 * canvas_shape[0] / max(canvas_shape[1], 1)
    scale = min(1.0, longest / max(width, height))
    return max(width * scale, shortest), max(height * scale, shortest)


def plot_wsi_heatmap(xy: np.ndarray, side: float, scores: np.ndarray, path: str | Path, *,
                     kind: ScoreKind = "probability", thumbnail: np.ndarray | None = None,
                     thumb_downsample: float | None = None, title: str = "") -> Path:
    """Tile probabilities (or evidences, ``kind``) of tiles at level-0 ``xy`` with level-0 ``side``
    (:func:`level0_tiles`), at thumbnail resolution, over the slide thumbnail when one is given;
    without one, over the tiles' extent only (from the slide's corner, a strip far from it was
    mostly empty canvas)."""
    if thumbnail is None:
        xy = xy - xy.min(axis=0)
    canvas, _ = heatmap_canvas(xy, side, scores, None if thumbnail is None else thumbnail.shape[:2], thumb_downsample)
    fig, ax = plt.subplots(figsize=_heatmap_figsize(canvas.shape))
    if thumbnail is not None:
        ax.imshow(thumbnail)
    image = ax.imshow(canvas, **_colour_scale(scores, kind), alpha=0.6 if thumbnail is not None else 1.0,
                      interpolation="nearest")
    fig.colorbar(image, ax=ax, fraction=0.046, label=SCORE_LABELS[kind])
    ax.set_axis_off()
    ax.set_title(_figure_title(title))
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
    ax.set(xlabel="slice", title=_figure_title(title))
    ax.legend(loc="upper right", fontsize="small")
    return _save(fig, path)


def plot_ct_strip(windows: np.ndarray, slice_index: np.ndarray, scores: np.ndarray, std: np.ndarray, path: str | Path, *,
                  sop_uids: list[str] | None = None, kind: ScoreKind = "probability", title: str = "") -> Path:
    """A strip of windowed CT slices (``windows`` (k, H, W, 3) in [0, 1]; the brain, blood and
    soft-tissue windows shown as the three colour channels) each titled with its slice index,
    score ± std and the end of its SOPInstanceUID, framed in the score's colour."""
    k = len(windows)
    fig, axes = plt.subplots(1, k, figsize=(1.9 * k, 2.4), squeeze=False)
    scale = _colour_scale(scores, kind)
    cmap = plt.get_cmap(scale["cmap"])
    for ax, image, z, s, sd, j in zip(axes[0], windows, slice_index, scores, std, range(k)):
        ax.imshow(np.clip(image, 0, 1))
        ax.set_xticks([])
        ax.set_yticks([])
        colour = cmap((s - scale["vmin"]) / (scale["vmax"] - scale["vmin"]))
        for spine in ax.spines.values():
            spine.set_edgecolor(colour)
            spine.set_linewidth(4)
        uid = "" if sop_uids is None else f"\n…{sop_uids[j][-10:]}"
        ax.set_title(f"slice {int(z)}\n{'p' if kind == 'probability' else 'e'} = {s:.2f} ± {sd:.2f}{uid}", fontsize=8)
    fig.suptitle(_figure_title(title), fontsize=9)
    return _save(fig, path)


def strip_slices(scores: np.ndarray, n: int = 8) -> np.ndarray:
    """Up to ``n`` slice positions for a strip: evenly spread over the scan, always with the most
    positive slice and its neighbours."""
    count = len(scores)
    top = int(np.argmax(scores))
    chosen = set(np.linspace(0, count - 1, num=min(n, count)).round().astype(int).tolist())
    chosen |= {i for i in (top - 1, top, top + 1) if 0 <= i < count}
    return np.array(sorted(chosen))


def markdown_table(frame: pd.DataFrame, float_format: str = "{:.3f}") -> str:
    """A small DataFrame as a Markdown table (no tabulate dependency). Cells are text: an id with
    ``|`` or a newline stays one cell, and HTML in one (``<img onerror=…>`` as a bag id) is shown,
    not rendered, in the report and the Prefect UI's artifact."""
    def cell(v: Any) -> str:
        text = float_format.format(v) if isinstance(v, (float, np.floating)) else str(v)
        text = html.escape(text.replace("\\", "\\\\").replace("|", "\\|"), quote=False)
        return " ".join(text.split())

    header = "| " + " | ".join(cell(c) for c in frame.columns) + " |"
    rule = "|" + "---|" * len(frame.columns)
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)]
    return "\n".join([header, rule, *body])
