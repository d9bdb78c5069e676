"""The original label (ISUP grade, class name, RSNA subtypes) is kept per bag beside the binary
target, through every ingest path, and stays consistent across reruns and appends."""

from __future__ import annotations

from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest
import zarr

from tasks.ingest.driver import IngestItem, run_ingest
from tasks.ingest.errors import StoreMismatchError
from tasks.ingest.labels import LabelSpec
from tasks.store import (
    BagData,
    CohortSpec,
    append_bags,
    create_cohort,
    decode_original_label,
    encode_original_label,
    open_cohort,
    write_cohort_from_arrays,
)


@pytest.mark.parametrize("value, text, decoded", [
    (3, "3", 3), (np.int64(3), "3", 3), (3.0, "3", 3), (np.float32(2.5), "2.5", 2.5), ("tumor", '"tumor"', "tumor"),
    ({"subdural": 1, "any": np.int8(1)}, '{"any": 1, "subdural": 1}', {"any": 1, "subdural": 1}),
    (None, "", None), (float("nan"), "", None), ("élan", '"élan"', "élan"),
])
def test_original_labels_are_stored_as_plain_json_text(value, text, decoded):
    assert encode_original_label(value) == text
    assert decode_original_label(text) == decoded


def test_arrays_and_appended_bags_keep_their_original_labels_and_an_old_store_gets_the_array(tmp_path):
    X = np.arange(12, dtype=np.float32).reshape(6, 2)
    bags = np.array(["a", "a", "b", "b", "c", "c"])
    cohort = write_cohort_from_arrays(tmp_path / "c.zarr", X, bags, np.array([0, 0, 1, 1, 1, 1]),
                                      original_labels=np.array([0, 0, 4, 4, "5", "5"], dtype=object))
    assert cohort.original_labels.tolist() == [0, 4, "5"] and cohort.bag_labels.tolist() == [0, 1, 1]
    with pytest.raises(ValueError, match="original_labels differ within bag 'a'"):
        write_cohort_from_arrays(tmp_path / "d.zarr", X, bags, np.array([0, 0, 1, 1, 1, 1]),
                                 original_labels=np.array([0, 1, 4, 4, 5, 5]))
    # A store written before bags/original_label existed: readers see None, an append adds the array.
    del zarr.open_group(str(tmp_path / "c.zarr"), mode="a")["bags/original_label"]
    assert open_cohort(tmp_path / "c.zarr").original_labels.tolist() == [None, None, None]
    append_bags(tmp_path / "c.zarr", [BagData("d", 1, "x", X[:2], np.zeros((2, 1)), np.full(2, -1),
                                              original_label=encode_original_label({"grade": 2}))])
    assert open_cohort(tmp_path / "c.zarr").original_labels.tolist() == [None, None, None, {"grade": 2}]


def _writer(item, writer):
    writer.write(np.full((2, 3), float(len(item.bag_id)), dtype=np.float32), np.zeros((2, 1)), np.full(2, -1))


def test_the_staging_path_keeps_original_labels_and_a_rerun_neither_mixes_nor_overwrites_them(tmp_path):
    spec = CohortSpec("c", n_features=3, coords_dim=1, coords_meaning="instance_index",
                      labels={"file": "l.csv", "column": "grade", "target": "grade > 0", "positive": None})
    items = [IngestItem(f"s{k}", f"/s{k}", int(k > 0), None, encode_original_label(k)) for k in range(3)]
    store = tmp_path / "c.zarr"
    # An interrupted run left s2 staged with grade 2; the labels file now says grade 3: staged again.
    from tasks.store import StagingWriter

    create_cohort(store, spec)
    staged = StagingWriter(store, "s2", 1, "/s2", original_label=encode_original_label(2))
    _writer(items[2], staged)
    staged.finish()
    items[2] = IngestItem("s2", "/s2", 1, None, encode_original_label(3))
    report = run_ingest(store, spec, items, _writer, max_workers=1)
    cohort = open_cohort(store)
    assert report.added == ("s0", "s1", "s2") and cohort.original_labels.tolist() == [0, 1, 3]
    assert cohort.attrs["labels"]["column"] == "grade"
    # A rerun with the same labels: all done; with a changed grade: that bag is reported, the store keeps its label.
    assert run_ingest(store, spec, items, _writer).already_done == ("s0", "s1", "s2")
    changed = [items[0], IngestItem("s1", "/s1", 1, None, encode_original_label(4)), items[2]]
    report = run_ingest(store, spec, changed, _writer)
    assert [(s.bag_id, s.error) for s in report.skipped] == [("s1", "LabelChangedError")]
    assert "original 1" in report.skipped[0].reason and "original 4" in report.skipped[0].reason
    assert open_cohort(store).original_labels.tolist() == [0, 1, 3]
    # An unlabelled rerun of the same files makes no claim on the labels: done.
    unlabelled = [IngestItem(i.bag_id, i.source, -1) for i in items]
    assert run_ingest(store, spec, unlabelled, _writer).already_done == ("s0", "s1", "s2")
    # Appending bags whose labels come from another column would give the originals two meanings.
    other = CohortSpec("c", n_features=3, coords_dim=1, coords_meaning="instance_index",
                       labels={"file": "m.csv", "column": "gleason", "target": None, "positive": ["4+4"]})
    with pytest.raises(StoreMismatchError, match="column, target, positive differ"):
        run_ingest(store, other, [IngestItem("s9", "/s9", 1, None, encode_original_label("4+4"))], _writer)
    assert open_cohort(store).n_bags == 3


def test_labels_that_arrive_after_an_unlabelled_ingest_label_those_bags_and_only_those(tmp_path):
    """A cohort ingested unlabelled to be predicted, then its labels: a rerun with them labelled
    every bag a LabelChangedError. Now an unlabelled bag takes the label (and original label); a
    labelled bag still keeps its own."""
    from flows.cli import summary
    from tasks.prefect_tasks import StageResult

    spec = CohortSpec("c", n_features=3, coords_dim=1, coords_meaning="instance_index")
    store = tmp_path / "c.zarr"
    unlabelled = [IngestItem(f"s{k}", f"/s{k}", -1) for k in range(3)]
    assert run_ingest(store, spec, unlabelled, _writer).added == ("s0", "s1", "s2")
    labelled = [IngestItem(f"s{k}", f"/s{k}", int(k > 0), None, encode_original_label(2 * k)) for k in range(3)]
    report = run_ingest(store, spec, labelled, _writer)
    assert report.labelled == ("s0", "s1", "s2") and report.already_done == ("s0", "s1", "s2") and not report.skipped
    cohort = open_cohort(store)
    assert cohort.bag_labels.tolist() == [0, 1, 1] and cohort.original_labels.tolist() == [0, 2, 4]
    line = summary("ingest", StageResult("c", str(store), True, report.to_json()))
    assert "3 already in the store (3 of them labelled now), 0 skipped" in line
    relabelled = [IngestItem("s1", "/s1", 0, None, encode_original_label(0))]
    assert [s.error for s in run_ingest(store, spec, relabelled, _writer).skipped] == ["LabelChangedError"]
    assert open_cohort(store).bag_labels.tolist() == [0, 1, 1]
    from tasks.ingest.tables import FeatureTable, ingest_table  # a table's -1 bags the same way

    X, ids = np.arange(8, dtype=np.float32).reshape(4, 2), np.array(["a", "a", "b", "b"], dtype=object)
    ingest_table(tmp_path / "t.zarr", FeatureTable(X=X, bag_ids=ids, labels=np.array([-1, -1, 1, 1]), source="t.npz"))
    report = ingest_table(tmp_path / "t.zarr", FeatureTable(X=X, bag_ids=ids, labels=np.array([0, 0, 1, 1]), source="t.npz"))
    assert report.labelled == ("a",) and open_cohort(tmp_path / "t.zarr").bag_labels.tolist() == [0, 1]


def test_slides_keep_the_isup_grade_and_a_label_spec_keeps_a_class_name(tmp_path):
    from tasks.ingest.synthetic import make_slide_cohort
    from tasks.ingest.wsi import TilingParams, ingest_slides

    slides = make_slide_cohort(tmp_path / "slides", 3, map_shape=(16, 24), seed=4)
    params = TilingParams(tile_size=128, mask_max_side=256)
    report = ingest_slides(tmp_path / "a.zarr", tmp_path / "slides", labels_csv=tmp_path / "slides" / "labels.csv",
                           params=params, fit_tiles=64)
    cohort = open_cohort(tmp_path / "a.zarr")
    grades = {s.image_id: s.isup_grade for s in slides}
    assert len(report.added) == 3
    assert dict(zip(cohort.bag_ids, cohort.original_labels)) == grades
    assert dict(zip(cohort.bag_ids, cohort.bag_labels)) == {k: int(g > 0) for k, g in grades.items()}
    assert cohort.attrs["labels"]["target"] == "isup_grade > 0"
    names = pd.DataFrame({"slide": [s.image_id for s in slides],
                          "diagnosis": ["tumor" if s.isup_grade else "benign" for s in slides]})
    names.to_csv(tmp_path / "names.csv", index=False)
    spec = LabelSpec(str(tmp_path / "names.csv"), id_column="slide", label_column="diagnosis", positive=["tumor"])
    ingest_slides(tmp_path / "b.zarr", tmp_path / "slides", labels_csv=spec, params=params, fit_tiles=64)
    named = open_cohort(tmp_path / "b.zarr")
    assert dict(zip(named.bag_ids, named.original_labels)) == dict(zip(names["slide"], names["diagnosis"]))


def test_h5_npy_and_table_sources_keep_their_original_labels(tmp_path):
    from tasks.ingest.h5 import ingest_h5_features
    from tasks.ingest.npy import ingest_bag_files
    from tasks.ingest.tables import ingest_table, read_npz_table, read_parquet_table

    rng = np.random.default_rng(0)
    (tmp_path / "h5").mkdir()
    for k in range(3):
        with h5py.File(tmp_path / "h5" / f"s{k}.h5", "w") as f:
            f["features"] = rng.normal(size=(4, 5)).astype(np.float32)
            f["coords"] = np.arange(8).reshape(4, 2) * 256
    pd.DataFrame({"slide_id": ["s0", "s1", "s2"], "grade": [0, 3, 5]}).to_csv(tmp_path / "g.csv", index=False)
    ingest_h5_features(tmp_path / "h5.zarr", tmp_path / "h5", tmp_path / "g.csv", label_column="grade", target="grade > 2")
    h5 = open_cohort(tmp_path / "h5.zarr")
    assert h5.original_labels.tolist() == [0, 3, 5] and h5.bag_labels.tolist() == [0, 1, 1]

    for sub in ("features", "labels"):
        (tmp_path / "npy" / sub).mkdir(parents=True)
    for k in range(2):
        np.save(tmp_path / "npy" / "features" / f"b{k}.npy", rng.normal(size=(3, 5)).astype(np.float32))
        np.save(tmp_path / "npy" / "labels" / f"b{k}.npy", np.array([float(k)]))
    ingest_bag_files(tmp_path / "npy.zarr", tmp_path / "npy" / "features", labels_dir=tmp_path / "npy" / "labels")
    assert open_cohort(tmp_path / "npy.zarr").original_labels.tolist() == [0, 1]

    X = rng.normal(size=(6, 4)).astype(np.float32)
    frame = pd.DataFrame(X, columns=[f"f{j}" for j in range(4)])
    frame["bag_id"], frame["label"] = ["a", "a", "b", "b", "c", "c"], [0, 0, 1, 1, -1, -1]
    frame["isup_grade"] = [0, 0, 4, 4, None, None]
    frame.to_parquet(tmp_path / "t.parquet")
    ingest_table(tmp_path / "pq.zarr", read_parquet_table(tmp_path / "t.parquet", original_label_column="isup_grade"))
    assert open_cohort(tmp_path / "pq.zarr").original_labels.tolist() == [0, 4, None]
    ingest_table(tmp_path / "plain.zarr", read_parquet_table(tmp_path / "t.parquet", feature_columns=["f0", "f1", "f2", "f3"]))  # the label itself
    assert open_cohort(tmp_path / "plain.zarr").original_labels.tolist() == [0, 1, None]
    np.savez(tmp_path / "t.npz", X=X, bag_ids=frame["bag_id"].to_numpy(str), labels=frame["label"].to_numpy(),
             original_labels=np.array(["benign", "benign", "tumor", "tumour", "", ""]))
    report = ingest_table(tmp_path / "npz.zarr", read_npz_table(tmp_path / "t.npz"))
    assert [(s.bag_id, s.error) for s in report.skipped] == [("b", "MissingLabelError")]
    assert "original label must be equal on all rows" in report.skipped[0].reason
    assert open_cohort(tmp_path / "npz.zarr").original_labels.tolist() == ["benign", ""]


def test_ct_scans_keep_the_rsna_subtypes_of_their_slices(tmp_path):
    from tasks.ingest.ct import ingest_ct
    from tasks.ingest.synthetic import make_ct_cohort

    scans = make_ct_cohort(tmp_path / "dicom", 3, n_slices=6, size=32, positive_fraction=0.5, seed=7)
    ingest_ct(tmp_path / "ct.zarr", tmp_path / "dicom", labels_csv=tmp_path / "dicom" / "labels.csv")
    cohort = open_cohort(tmp_path / "ct.zarr")
    by_uid = {s.series_uid: s for s in scans}
    for uid, original, label in zip(cohort.bag_ids, cohort.original_labels, cohort.bag_labels):
        y = by_uid[uid].label
        assert original == {"any": y, "epidural": 0, "intraparenchymal": y, "intraventricular": 0,
                            "subarachnoid": 0, "subdural": 0} and label == y
    assert {s.label for s in scans} == {0, 1}


def test_the_terminal_summary_shows_the_original_label_beside_the_target():
    from tasks.report import original_label_text, summary_text

    table = pd.DataFrame({"bag_id": ["a", "b", "c"], "probability": [0.9, 0.2, 0.5], "std": [0.1, 0.1, 0.3],
                          "label": [1, 0, -1],
                          "original_label": [original_label_text(3), original_label_text({"any": 0}), ""]})
    text = summary_text(table)
    assert "a       p = 0.900 ± 0.100  (label 1, original 3)" in text
    assert '(label 0, original {"any":0})' in text and "c       p = 0.500 ± 0.300\n" in text + "\n"


def test_a_config_names_the_original_label_column_of_a_parquet_or_csv_table(tmp_path):
    """``ingest.original_label_column`` goes from the YAML through the ingest task to the store; a
    column the table lacks, or a setting that does not fit the source, fails before anything is written."""
    from flows.checks import check_inputs
    from flows.config import ConfigError, load_config
    from tasks.prefect_tasks import ingest_table as ingest_task

    rng = np.random.default_rng(3)
    frame = pd.DataFrame(rng.normal(size=(6, 3)).astype(np.float32), columns=["f0", "f1", "f2"])
    frame["bag_id"], frame["label"] = ["a", "a", "b", "b", "c", "c"], [0, 0, 1, 1, 1, 1]
    frame["isup_grade"] = [0, 0, 3, 3, 5, 5]
    frame.to_parquet(tmp_path / "t.parquet")
    frame[["label", "bag_id", "f0", "f1", "isup_grade", "f2"]].to_csv(tmp_path / "t.csv", header=False, index=False)

    def load(source, column, kind="features"):
        path = tmp_path / f"{Path(source).stem}-{column}.yaml"
        path.write_text(f"name: t\nstore: {Path(source).suffix[1:] or kind}.zarr\noutput_dir: out\n"
                        f"ingest: {{kind: {kind}, source: {source}, original_label_column: {column}}}\n")
        return load_config(path, preflight=lambda config: check_inputs(config, "ingest"))

    for source, column in (("t.parquet", "isup_grade"), ("t.csv", 4)):
        config = load(source, column)
        result = ingest_task.fn(config)
        assert list(result.info["added"]) == ["a", "b", "c"], source
        cohort = open_cohort(config.store)
        assert cohort.original_labels.tolist() == [0, 3, 5] and cohort.bag_labels.tolist() == [0, 1, 1], source
        # The original label column is not a feature.
        np.testing.assert_array_equal(cohort.read_bags(0, 3).features, frame[["f0", "f1", "f2"]].to_numpy(np.float32))

    with pytest.raises(ConfigError, match=r"t-grde\.yaml: ingest.original_label_column: .*t\.parquet has no column 'grde'"):
        load("t.parquet", "grde")
    with pytest.raises(ConfigError, match=r"ingest.original_label_column: .*t\.csv has no column 9 \(its columns: 2, 3, 4, 5\)"):
        load("t.csv", 9)
    with pytest.raises(ConfigError, match=r"ingest: .*original_label_column: the MIL CSV has no header"):
        load("t.csv", "isup_grade")
    with pytest.raises(ConfigError, match=r"ingest: .*original_label_column applies to ingest.kind 'features'"):
        load(".", "isup_grade", kind="h5")
