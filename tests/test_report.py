"""Report figures: probabilities and VWSGP evidences are drawn on their own scales."""

import numpy as np
import pytest

from tasks import report


def test_instance_scores_say_whether_they_are_probabilities_or_evidences():
    proba = {"instances/proba": np.array([0.2, 0.9]), "instances/std": np.zeros(2)}
    evidence = {"instances/evidence": np.array([-3.0, 5.0]), "instances/std": np.zeros(2)}
    assert report.instance_scores(proba)[1] == "probability"
    scores, kind = report.instance_scores(evidence)
    assert kind == "evidence" and scores.tolist() == [-3.0, 5.0]


def test_probabilities_use_the_unit_scale_and_evidences_a_scale_symmetric_about_zero():
    assert report._colour_scale(np.array([0.1, 0.3]), "probability") == dict(cmap="inferno", vmin=0.0, vmax=1.0)
    scale = report._colour_scale(np.array([-3.0, 5.0, 0.5]), "evidence")
    assert (scale["vmin"], scale["vmax"]) == (-5.0, 5.0)
    assert report._colour_scale(np.zeros(3), "evidence")["vmax"] == 1.0  # all-zero evidence still draws


@pytest.mark.parametrize("kind", ["probability", "evidence"])
def test_heatmap_and_slice_plot_are_written_for_both_kinds(tmp_path, kind):
    rng = np.random.default_rng(0)
    coords = np.array([(r, c) for r in range(4) for c in range(5)])
    scores = rng.uniform(size=20) if kind == "probability" else rng.normal(scale=4.0, size=20)
    heatmap = report.plot_wsi_heatmap(coords, scores, tmp_path / "h.png", kind=kind)
    slices = report.plot_ct_slices(np.arange(20), scores, np.full(20, 0.1), tmp_path / "s.png", kind=kind,
                                   instance_labels=np.zeros(20, dtype=int))
    assert heatmap.stat().st_size > 0 and slices.stat().st_size > 0
