"""Validation at the boundary, per item: the error names the file, the bag, the row and the reason,
and nothing committed before is lost."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest
import zarr

from tasks.ingest.errors import NonFiniteFeaturesError
from tasks.store import BagData, CohortSpec, StagingWriter, append_bags, create_cohort, open_cohort, read_staged


def _store(tmp_path, n_features=3):
    path = tmp_path / "c.zarr"
    create_cohort(path, CohortSpec(name="c", n_features=n_features, coords_dim=1, coords_meaning="index"))
    return path


def _bag(bag_id, features, label=1):
    n = len(features)
    return BagData(bag_id=bag_id, label=label, source=f"/data/{bag_id}.csv", features=np.asarray(features, dtype=float),
                   coords=np.arange(n)[:, None], instance_labels=np.full(n, -1))


def test_nan_features_are_refused_naming_bag_file_row_and_column_and_nothing_is_committed(tmp_path):
    store = _store(tmp_path)
    append_bags(store, [_bag("good", np.ones((2, 3)))])
    bad = np.ones((7, 3))
    bad[4, 1] = np.nan
    with pytest.raises(NonFiniteFeaturesError, match=r"rows \[4\] of the bag, feature columns \[1\] \(0-based among the features\).*path='/data/bad.csv', bag='bad'"):
        append_bags(store, [_bag("ok2", np.zeros((2, 3))), _bag("bad", bad)])
    assert list(open_cohort(store).bag_ids) == ["good"]  # the earlier bag stays, the call commits nothing


def test_float32_overflow_counts_as_infinite(tmp_path):
    store = _store(tmp_path)
    with pytest.raises(NonFiniteFeaturesError, match=r"rows \[0\].*float32 overflow"):
        append_bags(store, [_bag("big", [[1e39, 0.0, 0.0]])])


def test_the_staging_writer_rejects_or_drops_nonfinite_rows_by_policy(tmp_path):
    store = _store(tmp_path)
    X = np.arange(12.0).reshape(4, 3)
    X[1, 0], X[3, 2] = np.inf, np.nan
    rejecting = StagingWriter(store, "s1", 1, "/slides/s1.tiff")
    rejecting.write(np.ones((5, 3)), np.zeros((5, 1)), np.full(5, -1))
    with pytest.raises(NonFiniteFeaturesError, match=r"2 instance row\(s\).*rows \[6, 8\] of the bag"):
        rejecting.write(X, np.zeros((4, 1)), np.full(4, -1))  # rows counted across batches

    dropping = StagingWriter(store, "s2", 1, "/slides/s2.tiff", nonfinite="drop")
    dropping.write(X, np.arange(4)[:, None], np.full(4, -1))
    assert dropping.finish() == 2 and dropping.n_dropped == 2
    staged = read_staged(zarr.open_group(str(store), mode="r"), "s2")
    np.testing.assert_array_equal(staged.coords[:, 0], [0, 2])
    assert np.isfinite(staged.features).all()

    empty = StagingWriter(store, "s3", 1, "/slides/s3.tiff", nonfinite="drop")
    empty.write(np.full((2, 3), np.nan), np.zeros((2, 1)), np.full(2, -1))
    with pytest.raises(NonFiniteFeaturesError, match="all 2 instances have NaN"):
        empty.finish()


def test_a_name_from_non_utf8_bytes_is_refused_for_that_item_with_a_readable_reason(tmp_path):
    from tasks.ingest.errors import IngestError

    store = _store(tmp_path)
    name = os.fsdecode(b"slide\xff")  # what os.listdir gives for a Latin-1 file name
    with pytest.raises(IngestError, match=r"bag id is not valid UTF-8 \(slide\\xff\); rename the file"):
        StagingWriter(store, name, 1, str(tmp_path / f"{name}.tiff"))
    with pytest.raises(IngestError, match="source path is not valid UTF-8"):
        append_bags(store, [replace(_bag("fine", np.ones((1, 3))), source=f"/data/{name}.csv")])


def _csv(tmp_path, rows):
    path = tmp_path / "table.csv"
    path.write_text("\n".join(",".join(map(str, r)) for r in rows) + "\n")
    return path


TABLE_ROWS = [[1, "a", 0.1, 0.2], [1, "a", 0.3, 0.4], [0, "b", 0.5, "nan"], [0, "b", 0.7, 0.8], [0, "c", 0.9, 1.0]]


def test_a_feature_table_bag_with_nan_is_skipped_naming_the_file_row_and_the_others_are_committed(tmp_path):
    from tasks.ingest.tables import ingest_table, read_mil_csv

    report = ingest_table(tmp_path / "c.zarr", read_mil_csv(_csv(tmp_path, TABLE_ROWS)))
    assert report.added == ("a", "c")
    (skip,) = report.skipped
    assert skip.bag_id == "b" and skip.error == "NonFiniteFeaturesError" and "lines [3] of the file, feature columns [1] (0-based among the features)" in skip.reason
    assert skip.path.endswith("table.csv")
    padded = tmp_path / "padded.csv"  # a blank first line and a line of spaces: read as before, counted as lines
    padded.write_text("\n  \n" + _csv(tmp_path, TABLE_ROWS).read_text())
    report = ingest_table(tmp_path / "p.zarr", read_mil_csv(padded))
    assert report.added == ("a", "c") and "lines [5] of the file" in report.skipped[0].reason


def test_with_nonfinite_drop_the_instance_is_left_out_and_counted(tmp_path):
    from tasks.ingest.tables import ingest_table, read_mil_csv

    report = ingest_table(tmp_path / "c.zarr", read_mil_csv(_csv(tmp_path, TABLE_ROWS)), nonfinite="drop")
    assert report.added == ("a", "b", "c") and report.dropped_nonfinite == {"b": 1} and not report.skipped
    cohort = open_cohort(tmp_path / "c.zarr")
    assert np.diff(np.asarray(cohort.offsets)).tolist() == [2, 1, 1]


def test_run_ingest_with_nonfinite_drop_counts_dropped_instances_per_bag(tmp_path):
    from tasks.ingest.driver import IngestItem, run_ingest

    def writer(item, staging):
        X = np.ones((4, 3))
        X[: item.payload, 0] = np.inf
        staging.write(X, np.arange(4)[:, None], np.full(4, -1))

    spec = CohortSpec(name="c", n_features=3, coords_dim=1, coords_meaning="index")
    items = [IngestItem(f"s{k}", f"/s{k}.tiff", k % 2, k) for k in range(3)]
    report = run_ingest(tmp_path / "c.zarr", spec, items, writer, nonfinite="drop")
    assert report.added == ("s0", "s1", "s2") and report.dropped_nonfinite == {"s1": 1, "s2": 2}
    rejected = run_ingest(tmp_path / "d.zarr", spec, items, writer)
    assert rejected.added == ("s0",) and [s.bag_id for s in rejected.skipped] == ["s1", "s2"]
    assert "rows [0] of the bag" in rejected.skipped[0].reason


def test_a_store_with_a_nan_row_predicts_every_good_bag_and_names_the_bad_one(tmp_path):
    """A store written by another tool (or before this validation) with a NaN feature: the good
    bags get exactly their model predictions, the bad bag NaN and a reason."""
    from distributed import Client, LocalCluster

    from mil_core import VGPMIL
    from tasks.training import predict_cohort, read_predictions
    from tests.conftest import make_toy_bags
    from tests.test_distributed import write_store

    X, bags, y, _ = make_toy_bags(n_bags=10, seed=5)
    X = X.astype(np.float32).astype(np.float64)
    store = write_store(tmp_path / "c.zarr", X, bags, y)
    model = VGPMIL(n_inducing=5, max_iter=5, random_state=0).fit(X, bags, y)
    cohort = open_cohort(store)
    bad_row = cohort.bag_slice(3).start + 1
    zarr.open_group(store, mode="a")["instances/features"][bad_row, 0] = np.nan  # behind the writer's back
    with LocalCluster(n_workers=1, processes=False, dashboard_address=":0") as cluster, Client(cluster) as client:
        predict_cohort(model, store, client, run="p", partition_bytes=1_000,
                       instance_kwargs={"method": "probit"}, bag_kwargs={"method": "probit", "rule": "max"})
    out = read_predictions(store, "p")
    _, expected = model.predict_bag_proba(X, bags, method="probit", rule="max")
    good = np.arange(10) != 3
    np.testing.assert_allclose(out["bags/proba"][good], expected[good], rtol=1e-10)
    assert np.isnan(out["bags/proba"][3]) and np.isnan(out["instances/proba"][cohort.bag_slice(3)]).all()
    reason = zarr.open_group(store, mode="r")["predictions/p"].attrs["not_predicted"]
    assert list(reason) == [str(cohort.bag_ids[3])] and f"store row {bad_row}" in reason[str(cohort.bag_ids[3])]

    # Its table row: no predicted label (it was 0, a negative) and no NaN in the JSON of its instances.
    import json

    from tasks.report import bag_table

    table = bag_table(store, "p")
    assert table["predicted_label"].isna().tolist() == [b == 3 for b in range(10)]
    assert json.loads(table["most_suspicious"][3]) == [] and all(json.loads(t) for t in table["most_suspicious"][good])


def _edit(paths, **tags):
    import pydicom

    for path in paths:
        ds = pydicom.dcmread(path)
        for tag, value in tags.items():
            if value is None:
                delattr(ds, tag)
            else:
                setattr(ds, tag, value)
        ds.save_as(path)


def _break_mr(root, hu, write):
    _, _, paths = write(root / "bad", hu, series_key="bad")
    _edit(paths, Modality="MR")
    return "Modality 'MR', not CT"


def _break_rescale(root, hu, write):
    _, _, paths = write(root / "bad", hu, series_key="bad")
    _edit(paths[2:3], RescaleIntercept=None)
    return f"no usable RescaleIntercept in {paths[2].name}: Hounsfield units cannot be computed"


def _break_missing_slice(root, hu, write):
    _, _, paths = write(root / "bad", hu, series_key="bad")
    paths[3].write_bytes(paths[3].read_bytes()[:100])  # an unreadable slice in the middle
    return "gap of 10.00 mm between slices .* \\(median spacing 5.00 mm\\): a slice is missing or unreadable"


def _break_duplicate_position(root, hu, write):
    _, _, paths = write(root / "bad", hu, series_key="bad")
    _edit(paths[4:5], ImagePositionPatient=[-125.0, -125.0, 15.0])  # where slice 3 is
    return "are at the same position \\(15.00 mm along the slice normal\\)"


def _break_screen_capture(root, hu, write):
    _, _, paths = write(root / "bad", hu[:1], series_key="bad")
    _edit(paths, ImageType=["ORIGINAL", "SECONDARY", "SCREEN SAVE"])  # a dose page saved as a CT image
    return "is a screen capture \\(ImageType SCREEN SAVE: a dose page, a saved view\\), not a slice"


@pytest.mark.parametrize("break_series", [_break_mr, _break_rescale, _break_missing_slice, _break_duplicate_position,
                                          _break_screen_capture], ids=lambda f: f.__name__[7:])
def test_a_ct_series_that_is_not_one_complete_ct_scan_is_skipped_naming_series_and_reason(tmp_path, break_series):
    import re

    from tasks.ingest.ct import ingest_ct
    from tasks.ingest.synthetic import write_ct_series

    hu = np.random.default_rng(0).normal(40.0, 30.0, size=(6, 16, 16))
    root = tmp_path / "dicom"
    good, _, _ = write_ct_series(root / "good", hu, series_key="good")
    reason = break_series(root, hu, write_ct_series)
    report = ingest_ct(tmp_path / "ct.zarr", root)
    assert report.added == (good,)  # the good series is ingested whatever the bad one does
    refused = [s for s in report.skipped if s.error == "InvalidSeriesError"]
    assert refused and all(re.search(reason, s.reason) and s.bag_id and s.path.endswith("bad") for s in refused)


def _slide_folder(tmp_path, names, labels_rows):
    from tasks.ingest.synthetic import BACKGROUND, TISSUE, write_slide

    folder = tmp_path / "slides"
    folder.mkdir()
    label_map = np.full((16, 16), BACKGROUND, dtype=np.uint8)
    label_map[2:14, 2:14] = TISSUE
    for k, name in enumerate(names):
        write_slide(folder / os.fsdecode(name) if isinstance(name, bytes) else folder / name, label_map, seed=k, tile=64)
    (folder / "labels.csv").write_text("image_id,data_provider,isup_grade,gleason_score\n" +
                                       "".join(f"{i},x,{g},0+0\n" for i, g in labels_rows))
    return folder


def test_slides_missing_on_disk_ambiguous_stems_and_undecodable_names_are_reported_per_slide(tmp_path):
    from tasks.ingest.wsi import TilingParams, plan_slides

    folder = _slide_folder(tmp_path, ["a.tiff", "b.tif", "b.tiff", b"caf\xe9.tiff"],
                           [("a", 0), ("b", 3), ("gone", 1)])
    plan = plan_slides(tmp_path / "s.zarr", folder, labels_csv=folder / "labels.csv", params=TilingParams(tile_size=64))
    assert [i.bag_id for i in plan.items] == ["a"]
    by_id = {s.bag_id: s for s in plan.skipped}
    assert by_id["b"].error == "DuplicateIdError"  # each file by its path (two sites' sub-folders: the same name twice)
    assert by_id["b"].reason == f"2 files for one slide id: {folder / 'b.tif'}, {folder / 'b.tiff'}; keep one"
    assert by_id["gone"].reason.startswith("listed in") and "no slide file gone.*" in by_id["gone"].reason
    (undecodable,) = [s for s in plan.skipped if s.bag_id is None]
    assert "not valid UTF-8" in undecodable.reason and undecodable.path.endswith("caf\\xe9.tiff")
    json_safe = [str(s.path).encode("utf-8") for s in plan.skipped]  # every entry can go into the JSON report
    assert len(json_safe) == 3


@pytest.mark.parametrize("content, message", [
    ("", "the labels file is empty"),
    ("\n\n", "the labels file is empty"),
    ("image_id,data_provider,isup_grade,gleason_score\n", "has a header .* but no rows"),
    ("image_id,isup_grade\n\"unterminated,1\n", "cannot read the labels CSV"),
])
def test_an_empty_or_header_only_labels_file_is_a_clear_error_naming_it(tmp_path, content, message):
    from tasks.ingest.errors import IngestError
    from tasks.ingest.labels import read_panda_labels

    path = tmp_path / "labels.csv"
    path.write_text(content)
    with pytest.raises(IngestError, match=rf"{message}.*labels\.csv"):
        read_panda_labels(path)


def test_an_empty_rsna_labels_file_stops_a_ct_ingest_before_anything_is_written(tmp_path):
    from tasks.ingest.ct import ingest_ct
    from tasks.ingest.errors import IngestError
    from tasks.ingest.synthetic import make_ct_cohort

    make_ct_cohort(tmp_path / "dicom", 1, n_slices=3, size=16, seed=0)
    (tmp_path / "labels.csv").write_text("ID,Label\n")
    with pytest.raises(IngestError, match="header .*ID, Label.* but no rows"):
        ingest_ct(tmp_path / "ct.zarr", tmp_path / "dicom", labels_csv=tmp_path / "labels.csv")
    assert not (tmp_path / "ct.zarr").exists()


def test_a_text_cell_in_a_feature_table_skips_its_bag_naming_row_column_and_value(tmp_path):
    from tasks.ingest.tables import ingest_table, read_mil_csv

    rows = [[1, "a", 0.1, 0.2], [0, "b", "n/a?", 0.8], [0, "b", 0.7, 0.8], [0, "c", 0.9, 1.0]]
    report = ingest_table(tmp_path / "c.zarr", read_mil_csv(_csv(tmp_path, rows)))
    assert report.added == ("a", "c")
    (skip,) = report.skipped
    assert skip.error == "BadValueError" and skip.reason == "line 2, column 3: 'n/a?' is not a number"
    dropped = ingest_table(tmp_path / "d.zarr", read_mil_csv(_csv(tmp_path, rows)), nonfinite="drop")
    assert dropped.added == ("a", "b", "c") and dropped.dropped_nonfinite == {"b": 1}


def test_a_dicom_file_with_a_non_utf8_name_is_reported_and_does_not_abort_the_ct_ingest(tmp_path):
    from tasks.ingest.ct import ingest_ct
    from tasks.ingest.synthetic import write_ct_series

    hu = np.random.default_rng(1).normal(40.0, 30.0, size=(4, 16, 16))
    good, _, _ = write_ct_series(tmp_path / "dicom" / "good", hu, series_key="good")
    _, _, paths = write_ct_series(tmp_path / "dicom" / "latin1", hu, series_key="latin1")
    os.rename(paths[0], os.path.join(os.fsencode(paths[0].parent), b"slice\xe9.dcm"))
    report = ingest_ct(tmp_path / "ct.zarr", tmp_path / "dicom")
    assert good in report.added
    assert any(s.error == "UnreadableFileError" and s.path.endswith("slice\\xe9.dcm") and "not valid UTF-8" in s.reason
               for s in report.skipped)
