"""Report outputs read back as their readers read them: tile squares, CSV tables, Prefect artifact
keys, the terminal summary, heatmap figures and the metrics table."""

from __future__ import annotations

import csv
import re

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from tasks import report
from tasks.paths import safe_filename
from tasks.prefect_tasks import ARTIFACT_KEY_CHARS, _metrics_frame, artifact_key

SLIDE_MEANING = "tile_row,tile_col,x,y (x, y: level-0 pixels of the tile's top-left corner)"
FORMULA_START = ("=", "+", "-", "@", "\t")


def slide_tiles(side: int, cells: list[tuple[int, int]]) -> np.ndarray:
    """A slide store's coordinates (tile_row, tile_col, x, y) of the grid ``cells`` with tile ``side``."""
    return np.array([[r, c, c * side, r * side] for r, c in cells], dtype=np.int64)


def test_a_one_tile_wide_strip_in_a_cohort_of_another_magnification_keeps_its_own_tile_side():
    """A 40x needle core one tile wide among 20x slides (``target_mpp``): its side was measured
    along rows only, it had none, and its QuPath squares and heatmap tiles got the 20x side (half)."""
    block_20x = slide_tiles(256, [(r, c) for r in range(3) for c in range(4)])
    strip_40x = slide_tiles(512, [(r, 7) for r in range(10)])
    lone_40x = slide_tiles(512, [(2, 3)])
    coords = np.concatenate([block_20x, strip_40x, lone_40x])
    offsets = np.cumsum([0, len(block_20x), len(strip_40x), len(lone_40x)])
    cohort_side = report.cohort_tile_side(coords, offsets, SLIDE_MEANING)
    assert cohort_side == pytest.approx(384.0)  # the median of the two slides that have a side: 256 and 512
    assert report.level0_tiles(strip_40x, SLIDE_MEANING, cohort_side)[1] == 512
    assert report.level0_tiles(strip_40x[:, [1, 0, 3, 2]], SLIDE_MEANING, cohort_side)[1] == 512  # the same strip lying down
    assert report.level0_tiles(block_20x, SLIDE_MEANING, cohort_side)[1] == 256
    assert report.level0_tiles(lone_40x, SLIDE_MEANING, cohort_side)[1] == cohort_side  # one tile: nothing to measure


def test_a_bag_id_with_a_bare_carriage_return_stays_one_quoted_cell_and_no_line_starts_a_formula(tmp_path):
    """A lone ``\\r`` in a bag id was written unquoted: pandas and the csv module read an extra row,
    and ``case\\r=2+5`` put ``=2+5`` at the start of a cell, past the formula escaping."""
    ids = ["case\r=2+5", "\r@SUM(1+1)", "slide\r7", "two\n+lines", "crlf\r\n-cmd", "ok"]
    table = pd.DataFrame({"bag_id": ids, "label": [0, 1, 1, 0, 1, 0], "probability": np.linspace(0.1, 0.6, len(ids))})
    path = tmp_path / "bags.csv"
    report.write_csv(table, path)
    shown = ["case\r'=2+5", "'\r'@SUM(1+1)", "slide\r7", "two\n'+lines", "crlf\r\n'-cmd", "ok"]
    read = pd.read_csv(path, keep_default_na=False)
    assert read["bag_id"].tolist() == shown and read["label"].tolist() == table["label"].tolist()
    with open(path, newline="") as file:
        rows = list(csv.reader(file))
    assert rows[0] == ["bag_id", "label", "probability"] and [row[0] for row in rows[1:]] == shown
    assert all(len(row) == 3 for row in rows)
    lines = re.split(r"\r\n|\r|\n", path.read_bytes().decode())  # a reader that breaks lines at every \r or \n
    assert not [line for line in lines if line.startswith(FORMULA_START)]


def test_two_bags_whose_figure_names_differ_only_in_their_hash_get_two_artifact_keys():
    """Keys were cut at 100 characters, which cut off the hash ``safe_filename`` adds: the heatmaps
    of two DICOM UIDs ``…637.1`` and ``…637.2`` shared one Prefect artifact key."""
    from prefect.types.names import raise_on_name_alphanumeric_dashes_only

    prefix = "1.2.840.113619.2.55.3.2831164355.245.1358745839.637"
    keys = [artifact_key("figure", "brca-her2-uni-features-vgpmil-nightly", "heatmaps", safe_filename(f"{prefix}.{k}"))
            for k in (1, 2)]
    assert keys[0] != keys[1]
    for key in keys:
        assert len(key) <= ARTIFACT_KEY_CHARS and raise_on_name_alphanumeric_dashes_only(key) == key
        assert key.startswith("figure-brca-her2-uni-features-vgpmil-nightly-heatmaps-1-2-840-113619")
    assert artifact_key("report", "gpmil_v2.1") == "report-gpmil-v2-1"  # a short key is as it was
    assert raise_on_name_alphanumeric_dashes_only(artifact_key("figure", "café-Straße")) == "figure-caf--stra-e"  # kept 'é': refused


def test_the_summary_leaves_out_the_std_a_model_does_not_give():
    """AbSMIL gives no predictive std: the terminal summary printed ``p = 0.900 ± nan``."""
    table = pd.DataFrame({"bag_id": ["a", "b"], "label": [1, -1], "original_label": ["", ""],
                          "probability": [0.9, 0.6], "std": [np.nan, 0.05]})
    lines = report.summary_text(table).splitlines()
    assert "nan" not in "\n".join(lines)
    assert lines[2:4] == ["  a       p = 0.900  (label 1)", "  b       p = 0.600 ± 0.050"]


def test_heatmaps_are_drawn_for_predicted_bags_only():
    """With more heatmaps asked for than bags predicted, a bag not predicted (NaN features) got an
    empty heatmap titled ``p = nan``."""
    table = pd.DataFrame({"bag_id": ["a", "b", "c"], "probability": [0.4, np.nan, 0.8]})
    assert report.most_likely_positive(table, 16)["bag_id"].tolist() == ["c", "a"]
    assert report.most_likely_positive(table, 1)["bag_id"].tolist() == ["c"]


def heatmap_size(tmp_path, xy: np.ndarray, name: str, title: str = "") -> tuple[int, int]:
    """The width and height in pixels of the heatmap PNG of tiles at ``xy`` (side 256, no thumbnail)."""
    path = report.plot_wsi_heatmap(xy, 256.0, np.linspace(0, 1, len(xy)), tmp_path / f"{name}.png", title=title)
    with Image.open(path) as image:
        return image.size


def test_a_heatmap_of_a_thin_strip_keeps_a_bounded_size_and_a_readable_colourbar(tmp_path):
    """Without a slide thumbnail the figure was sized to the canvas: a 300-tile vertical core gave a
    414 × 80 746 px PNG, a horizontal strip a colourbar 113 px tall, and a 300-character bag id a
    title 2 496 px wide."""
    longest_px = report.HEATMAP_INCHES[1] * 90 + 200  # _save's 90 dpi, with the title and the colourbar's labels
    width, height = heatmap_size(tmp_path, np.array([[0, 256 * i] for i in range(300)], float), "vertical")
    assert max(width, height) <= longest_px
    width, height = heatmap_size(tmp_path, np.array([[256 * i, 0] for i in range(150)], float), "horizontal")
    assert width <= longest_px and height >= 0.8 * report.HEATMAP_INCHES[0] * 90
    width, _ = heatmap_size(tmp_path, np.array([[0, 0], [256, 0]], float), "long", title=f"{'x' * 300}: p = 0.53")
    assert width <= longest_px


def test_a_heatmap_without_a_thumbnail_covers_the_tiles_wherever_they_lie_on_the_slide(tmp_path):
    """The canvas started at the slide's corner: a strip far from it was a sliver at one edge of an
    empty canvas."""
    strip = np.array([[256 * (i % 2), 256 * i] for i in range(40)], float)
    near, far = (report.plot_wsi_heatmap(xy, 256.0, np.linspace(0, 1, 40), tmp_path / f"{name}.png")
                 for name, xy in (("near", strip), ("far", strip + [30_000, 9_000])))
    with Image.open(near) as first, Image.open(far) as second:
        np.testing.assert_array_equal(np.asarray(first), np.asarray(second))


def test_a_bag_id_with_dollar_signs_is_a_heatmap_title_not_mathtext(tmp_path):
    """matplotlib read ``$\\foo$`` in a bag id as mathtext and failed the report."""
    path = report.plot_wsi_heatmap(np.array([[0, 0], [256, 0]], float), 256.0, np.array([0.2, 0.8]), tmp_path / "d.png",
                                   title=r"x$\foo$: p = 0.50")
    assert path.stat().st_size > 0


def test_the_metrics_table_shows_counts_as_integers():
    """``n_bags | 16.000``: every metric was made a float before the table formatted it."""
    text = report.markdown_table(_metrics_frame({"n_bags": 16, "bag_auc": 0.8125, "n_instances_labelled": 340}))
    assert text.splitlines()[2:] == ["| n_bags | 16 |", "| bag_auc | 0.812 |", "| n_instances_labelled | 340 |"]
