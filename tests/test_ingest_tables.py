"""Feature-table sources: MUSK CSV, Parquet, NumPy, CLAM/TRIDENT .h5, torchmil per-bag files → store → arrays."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pandas as pd
import pytest

from tasks.ingest.h5 import ingest_h5_features
from tasks.ingest.npy import ingest_bag_files
from tasks.ingest.tables import FeatureTable, ingest_table, read_mil_csv, read_npz_table, read_parquet_table
from tasks.store import open_cohort

MUSK1 = Path(__file__).resolve().parents[2] / "shared" / "data" / "musk1.csv"  # shared/ beside the checkout


def assert_store_holds_table(store: Path, X: np.ndarray, bag_ids: np.ndarray, labels: np.ndarray) -> None:
    cohort = open_cohort(store)
    block = cohort.read_bags(0, cohort.n_bags)
    assert list(cohort.bag_ids) == list(dict.fromkeys(bag_ids))
    for b, bag_id in enumerate(cohort.bag_ids):
        rows = np.flatnonzero(bag_ids == bag_id)
        np.testing.assert_array_equal(block.features[block.offsets[b]:block.offsets[b + 1]], X[rows].astype(np.float32))
        assert cohort.bag_labels[b] == labels[rows[0]]


@pytest.mark.skipif(not MUSK1.exists(), reason="MUSK data not present")
def test_musk_csv_round_trips_and_a_rerun_adds_nothing(tmp_path):
    raw = np.loadtxt(MUSK1, delimiter=",", dtype=str)
    report = ingest_table(tmp_path / "musk.zarr", read_mil_csv(MUSK1))
    assert len(report.added) == 92 and report.n_instances_added == 476 and not report.skipped
    assert_store_holds_table(tmp_path / "musk.zarr", raw[:, 2:].astype(float), raw[:, 1], raw[:, 0].astype(int))
    again = ingest_table(tmp_path / "musk.zarr", read_mil_csv(MUSK1))
    assert again.added == () and len(again.already_done) == 92
    assert open_cohort(tmp_path / "musk.zarr").n_instances == 476


def test_parquet_and_npz_tables_round_trip_with_instance_labels(tmp_path):
    rng = np.random.default_rng(0)
    n = 200
    bag = rng.integers(0, 15, size=n).astype(str).astype(object)
    label = (np.char.count(bag.astype(str), "1") > 0).astype(int)
    X = rng.normal(size=(n, 4))
    inst = rng.integers(0, 2, size=n)
    frame = pd.DataFrame(X, columns=[f"f{i}" for i in range(4)]).assign(bag_id=bag, label=label, inst=inst)
    frame.to_parquet(tmp_path / "t.parquet")
    ingest_table(tmp_path / "p.zarr", read_parquet_table(tmp_path / "t.parquet", instance_label_column="inst"))
    assert_store_holds_table(tmp_path / "p.zarr", X, bag, label)
    np.savez(tmp_path / "t.npz", X=X, bag_ids=bag.astype(str), labels=label, instance_labels=inst)
    ingest_table(tmp_path / "n.zarr", read_npz_table(tmp_path / "t.npz"))
    assert_store_holds_table(tmp_path / "n.zarr", X, bag, label)
    for store in ("p.zarr", "n.zarr"):
        cohort = open_cohort(tmp_path / store)
        block = cohort.read_bags(0, cohort.n_bags)
        order = np.concatenate([np.flatnonzero(bag == b) for b in cohort.bag_ids])
        np.testing.assert_array_equal(block.instance_labels, inst[order])


def test_a_table_bag_with_conflicting_labels_is_skipped_and_the_rest_ingested(tmp_path):
    table = FeatureTable(X=np.arange(12.0).reshape(6, 2), bag_ids=np.array(["a", "a", "b", "b", "c", "c"], dtype=object),
                         labels=np.array([1, 1, 0, 1, 0, 0]), source="table.csv")
    report = ingest_table(tmp_path / "t.zarr", table)
    assert report.added == ("a", "c")
    assert [(s.bag_id, s.error, s.path) for s in report.skipped] == [("b", "MissingLabelError", "table.csv")]
    assert json.loads(Path(report.report_path).read_text())["skipped"][0]["bag_id"] == "b"


def test_a_table_of_another_feature_dimension_is_refused_naming_the_store(tmp_path):
    first = FeatureTable(np.zeros((2, 3)), np.array(["a", "b"], dtype=object), np.array([0, 1]), "one.csv")
    other = FeatureTable(np.zeros((2, 4)), np.array(["c", "d"], dtype=object), np.array([0, 1]), "two.csv")
    ingest_table(tmp_path / "t.zarr", first)
    with pytest.raises(ValueError, match="n_features.*two.csv"):
        ingest_table(tmp_path / "t.zarr", other)


def write_h5(path: Path, features: np.ndarray, coords: np.ndarray, trident: bool = False) -> None:
    with h5py.File(path, "w") as handle:
        handle["features"] = features[None] if trident else features
        handle["coords"] = coords


def test_clam_and_trident_h5_files_round_trip_and_bad_files_are_reported(tmp_path):
    rng = np.random.default_rng(1)
    slides = tmp_path / "h5"
    slides.mkdir()
    truth = {}
    for i in range(4):
        n = int(rng.integers(3, 30))
        truth[f"s{i}"] = (rng.normal(size=(n, 6)).astype(np.float32), rng.integers(0, 5000, size=(n, 2)))
        write_h5(slides / f"s{i}.h5", *truth[f"s{i}"], trident=i % 2 == 1)
    write_h5(slides / "wide.h5", np.zeros((3, 7), np.float32), np.zeros((3, 2)))
    (slides / "broken.h5").write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 40)
    write_h5(slides / "unlabelled.h5", np.zeros((3, 6), np.float32), np.zeros((3, 2)))
    for name, suffix in (("upper", ".H5"), ("long", ".hdf5")):  # the suffix in capitals, HDF5's long one: features too
        truth[name] = (rng.normal(size=(5, 6)).astype(np.float32), rng.integers(0, 5000, size=(5, 2)))
        write_h5(slides / f"{name}{suffix}", *truth[name])
    write_h5(slides / "nancoord.h5", np.zeros((3, 6), np.float32), np.array([[0.0, 0.0], [256.0, np.nan], [512.0, 0.0]]))
    with h5py.File(slides / "group.h5", "w") as handle:
        handle["features/uni"] = np.zeros((3, 6), np.float32)
    pd.DataFrame({"slide_id": ["s0", "s1", "s2", "s3", "wide", "broken", "upper", "long", "nancoord", "group", "gone"],
                  "label": ["tumor", "normal", "normal", "tumor", "tumor", "normal", "tumor", "normal", "tumor", "tumor",
                            "normal"]}).to_csv(tmp_path / "labels.csv", index=False)

    report = ingest_h5_features(tmp_path / "h5.zarr", slides, tmp_path / "labels.csv", positive=["tumor"])

    assert sorted(report.added) == ["long", "s0", "s1", "s2", "s3", "upper"]
    problems = {s.bag_id: (s.error, Path(s.path).name) for s in report.skipped}
    assert problems == {"wide": ("FeatureDimensionError", "wide.h5"), "broken": ("UnreadableFileError", "broken.h5"),
                        "unlabelled": ("MissingLabelError", "unlabelled.h5"),
                        "nancoord": ("FeatureDimensionError", "nancoord.h5"), "group": ("UnreadableFileError", "group.h5"),
                        "gone": ("UnreadableFileError", "gone.h5")}  # a labels row without its file is said, not dropped
    reasons = {s.bag_id: s.reason for s in report.skipped}
    assert reasons["nancoord"].startswith("'coords' row 1 is [256.0, nan]: patch corners are whole level-0 pixels")
    assert reasons["group"].startswith("'features' is an h5 group (holding ['uni']), not a dataset")
    assert reasons["gone"] == f"listed in {tmp_path / 'labels.csv'} but no feature file gone.h5 in {slides}"
    cohort = open_cohort(tmp_path / "h5.zarr")
    assert dict(zip(cohort.bag_ids, cohort.bag_labels)) == {"s0": 1, "s1": 0, "s2": 0, "s3": 1, "upper": 1, "long": 0}
    for b, bag_id in enumerate(cohort.bag_ids):
        block = cohort.read_bags(b, b + 1)
        np.testing.assert_array_equal(block.features, truth[bag_id][0])
        np.testing.assert_array_equal(block.coords, truth[bag_id][1])
    assert not any(Path(tmp_path / "h5.zarr" / "staging").glob("*/zarr.json"))


def test_torchmil_per_bag_files_round_trip_with_instance_labels_and_coords(tmp_path):
    rng = np.random.default_rng(2)
    for folder in ("features", "labels", "inst_labels", "coords"):
        (tmp_path / folder).mkdir()
    truth = {}
    for i in range(3):
        n = int(rng.integers(2, 20))
        inst = rng.integers(0, 2, size=n)
        truth[f"bag{i}"] = (rng.normal(size=(n, 5)).astype(np.float32), inst, rng.integers(0, 99, size=(n, 2)))
        np.save(tmp_path / "features" / f"bag{i}.npy", truth[f"bag{i}"][0])
        np.save(tmp_path / "labels" / f"bag{i}.npy", np.array(int(inst.max())))
        np.save(tmp_path / "inst_labels" / f"bag{i}.npy", inst)
        np.save(tmp_path / "coords" / f"bag{i}.npy", truth[f"bag{i}"][2])
    report = ingest_bag_files(tmp_path / "t.zarr", tmp_path / "features", labels_dir=tmp_path / "labels",
                              inst_labels_dir=tmp_path / "inst_labels", coords_dir=tmp_path / "coords")
    assert report.added == ("bag0", "bag1", "bag2") and not report.skipped
    cohort = open_cohort(tmp_path / "t.zarr")
    for b, bag_id in enumerate(cohort.bag_ids):
        block = cohort.read_bags(b, b + 1)
        features, inst, coords = truth[bag_id]
        np.testing.assert_array_equal(block.features, features)
        np.testing.assert_array_equal(block.instance_labels, inst)
        np.testing.assert_array_equal(block.coords, coords)
        assert cohort.bag_labels[b] == inst.max()

    from flows.config import load_config  # the same folder as a config source (ingest.kind: npy)
    from tasks.prefect_tasks import ingest_table as ingest_task

    config = tmp_path / "c.yaml"
    config.write_text(f"name: t\nstore: {tmp_path / 'c.zarr'}\noutput_dir: {tmp_path / 'out'}\n"
                      f"ingest: {{kind: npy, source: {tmp_path}}}\n")
    result = ingest_task.fn(load_config(config))
    assert list(result.info["added"]) == ["bag0", "bag1", "bag2"]
    from_config = open_cohort(tmp_path / "c.zarr")
    np.testing.assert_array_equal(from_config.read_bags(0, 3).coords, cohort.read_bags(0, 3).coords)

    # a labels file in the config (any label CSV, ids the file stems) is read in place of labels/: it was ignored
    (tmp_path / "clinical.csv").write_text("case,dx\nbag0,tumor\nbag1,normal\nbag2,tumor\n")
    config.write_text(f"name: t\nstore: {tmp_path / 'l.zarr'}\noutput_dir: {tmp_path / 'out'}\n"
                      f"ingest: {{kind: npy, source: {tmp_path}, labels: {{file: {tmp_path / 'clinical.csv'}, "
                      "id_column: case, label_column: dx, positive: [tumor]}}\n")
    ingest_task.fn(load_config(config))
    labelled = open_cohort(tmp_path / "l.zarr")
    assert dict(zip(labelled.bag_ids, labelled.bag_labels.tolist())) == {"bag0": 1, "bag1": 0, "bag2": 1}
    assert labelled.attrs["labels"]["column"] == "dx"


def test_documented_entry_points_import_from_the_package():
    """docs/STORE.md imports the entry points from ``tasks.ingest``; they are the per-format modules' functions."""
    import tasks.ingest as ingest
    from tasks.ingest import ingest_bag_files as from_package
    from tasks.ingest import ingest_ct, ingest_h5_features, ingest_slides, ingest_table  # noqa: F401

    assert from_package is ingest_bag_files and ingest_h5_features.__module__ == "tasks.ingest.h5"
    with pytest.raises(AttributeError, match="no attribute 'ingest_nothing'"):
        ingest.ingest_nothing


def test_table_readers_refuse_what_would_merge_cut_or_drop_rows_naming_the_file(tmp_path):
    """Bag ids stay text ('00123' and '0123' are two bags); a missing id, arrays that disagree on
    the number of rows, features in one list column, a file that is not an archive: each refused
    with the file and what is wrong, never a bag called 'nan', rows cut short or zero features."""
    from tasks.ingest.errors import IngestError

    csv = tmp_path / "ids.csv"
    csv.write_text("0,00123,1.0\n0,0123,2.0\n1,07,3.0\n1,07,4.0\n")
    assert list(read_mil_csv(csv).bag_ids) == ["00123", "0123", "07", "07"]
    csv.write_text("label,bag,f1\n0,a,1.0\n")
    with pytest.raises(IngestError, match=r"line 1 \(label, bag, f1, …\) looks like a header: a MIL CSV has none"):
        read_mil_csv(csv)
    csv.write_text("0,a,1.0\n\n0,,2.0\n")  # the file's line, a blank one counted
    with pytest.raises(IngestError, match=r"no bag id at line\(s\) \[3\].*ids.csv"):
        read_mil_csv(csv)

    X, ids, labels = np.zeros((20, 3)), np.repeat(np.arange(4), 5).astype(str), np.repeat([0, 1, 0, 1], 5)
    for name, arrays, message in [
        ("short_ids", dict(X=X, bag_ids=ids[:15], labels=labels), "bag_ids has 15 rows but the features have 20"),
        ("bag_labels", dict(X=X, bag_ids=ids, labels=labels[::5]), "labels has 4 rows but the features have 20"),
        ("coords", dict(X=X, bag_ids=ids, labels=labels, coords=np.zeros((14, 1))), "coords has 14 rows"),
        ("flat", dict(X=X[:, 0], bag_ids=ids, labels=labels), r"2-D \(rows, features\) array .* got shape \(20,\)"),
    ]:
        np.savez(tmp_path / f"{name}.npz", **arrays)
        with pytest.raises(IngestError, match=rf"{message}.*{name}\.npz"):
            read_npz_table(tmp_path / f"{name}.npz")
    (tmp_path / "junk.npz").write_bytes(bytes(100))
    with pytest.raises(IngestError, match="not a NumPy .npz archive") as refused:
        read_npz_table(tmp_path / "junk.npz")
    assert "allow_pickle" not in str(refused.value)

    frame = pd.DataFrame({"bag_id": ids, "label": labels, "features": list(np.ones((20, 3)))})
    frame.to_parquet(tmp_path / "listcol.parquet")
    with pytest.raises(IngestError, match=r"column 'features' holds lists of numbers \(list<.*one numeric column per feature.*listcol\.parquet"):
        read_parquet_table(tmp_path / "listcol.parquet")
    frame.assign(x=1, y=2).to_parquet(tmp_path / "listcol.parquet")  # beside numeric columns it was left out silently
    with pytest.raises(IngestError, match=r"column 'features' holds lists of numbers"):
        read_parquet_table(tmp_path / "listcol.parquet")
    pd.DataFrame({"bag_id": [None, *ids[1:]], "label": labels, "f0": 1.0}).to_parquet(tmp_path / "nullid.parquet")
    with pytest.raises(IngestError, match=r"no bag id at row\(s\) \[0\]"):
        read_parquet_table(tmp_path / "nullid.parquet")


def test_an_h5_folder_none_of_whose_files_has_a_label_says_which_ids_the_labels_hold(tmp_path):
    """Ids that differ from the file stems by a suffix, spaces or letter case, or not at all alike: the error
    counts the files and names the first one left out with the labels file's near id."""
    from tasks.ingest.errors import IngestError

    (tmp_path / "h5").mkdir()
    for i in range(2):
        with h5py.File(tmp_path / "h5" / f"slide{i}.h5", "w") as handle:
            handle["features"] = np.zeros((3, 4), np.float32)
    for rows, hint, left_out in [("slide0.svs,1\nslide1.svs,0\n", "it has 'slide0.svs': ids must equal the file stem", 2),
                                 (" slide0 ,1\n slide1 ,0\n", "it has ' slide0 '", 2),
                                 ("Slide0,1\nSLIDE1,0\n", "it has 'Slide0': ids must equal the file stem, in its case", 2),
                                 ("other0,1\nother1,0\n", "its ids look like 'other0', 'other1'", 4)]:  # + 2 rows without a file
        (tmp_path / "clin.csv").write_text("slide_id,label\n" + rows)
        with pytest.raises(IngestError, match=rf"no .h5 feature file to ingest: 2 .h5 file\(s\) found, {left_out} left out; first left out: "
                                              rf".*slide0.h5: MissingLabelError: no label in .*clin.csv \({hint}"):
            ingest_h5_features(tmp_path / "s.zarr", tmp_path / "h5", labels_csv=tmp_path / "clin.csv")


def test_a_torchmil_folder_whose_coords_cover_some_bags_skips_the_others_naming_their_missing_file(tmp_path):
    """coords/ held files for b1 and b3 only: the store took its positions from b0 (none: instance
    indices), kept the bags without coordinates and skipped the ones with them ('the store has 1
    coordinate columns')."""
    for folder in ("features", "labels", "coords"):
        (tmp_path / folder).mkdir()
    for i in range(4):
        np.save(tmp_path / "features" / f"b{i}.npy", np.ones((3, 2), np.float32))
        np.save(tmp_path / "labels" / f"b{i}.npy", np.array(i % 2))
        if i % 2:
            np.save(tmp_path / "coords" / f"b{i}.npy", np.arange(6).reshape(3, 2) * 224)
    report = ingest_bag_files(tmp_path / "t.zarr", tmp_path / "features", labels_dir=tmp_path / "labels",
                              coords_dir=tmp_path / "coords")
    assert report.added == ("b1", "b3")
    assert {s.bag_id: s.reason for s in report.skipped} == {
        b: f"no coordinates file {b}.npy in {tmp_path / 'coords'}, where 2 other bag(s) have one: a cohort's positions are "
           "given for every bag or for none" for b in ("b0", "b2")}
    np.testing.assert_array_equal(open_cohort(tmp_path / "t.zarr").read_bags(0, 1).coords, np.arange(6).reshape(3, 2) * 224)
    night = tmp_path / "night2"  # the next night's folder beside the store's: its kind is the store's
    for folder in ("features", "labels", "coords"):
        (night / folder).mkdir(parents=True)
    for i in range(2):
        np.save(night / "features" / f"n{i}.npy", np.ones((3, 2), np.float32))
        np.save(night / "labels" / f"n{i}.npy", np.array(i))
    np.save(night / "coords" / "n1.npy", np.arange(6).reshape(3, 2))
    report = ingest_bag_files(tmp_path / "t.zarr", night / "features", labels_dir=night / "labels", coords_dir=night / "coords")
    assert report.added == ("n1",) and [s.bag_id for s in report.skipped] == ["n0"]
    assert "the store " in report.skipped[0].reason and "holds positions for its bags" in report.skipped[0].reason
    plain = ingest_bag_files(tmp_path / "plain.zarr", tmp_path / "features", labels_dir=tmp_path / "labels")  # no coords/
    assert plain.added == ("b0", "b1", "b2", "b3")
    report = ingest_bag_files(tmp_path / "plain.zarr", night / "features", labels_dir=night / "labels", coords_dir=night / "coords")
    assert report.added == ("n0",) and [s.bag_id for s in report.skipped] == ["n1"]  # was: StoreMismatchError, nothing added
    assert "holds instance indices for its bags" in report.skipped[0].reason
    (tmp_path / "coords" / "b0.npy").write_bytes((tmp_path / "coords" / "b1.npy").read_bytes())  # coords/ for stored bags
    report = ingest_bag_files(tmp_path / "plain.zarr", tmp_path / "features", labels_dir=tmp_path / "labels",
                              coords_dir=tmp_path / "coords")
    assert report.already_done == ("b0", "b1", "b2", "b3") and not report.skipped  # were: 'its input changed since'


def test_a_torchmil_bag_whose_side_file_is_bad_is_skipped_naming_that_file(tmp_path):
    """A pickled inst_labels file is named (not the features file it sits beside); instance labels
    outside 0/1/-1 and an empty features file are refused per bag; the other bags are ingested."""
    for folder in ("features", "labels", "inst_labels"):
        (tmp_path / folder).mkdir()
    for i in range(4):
        np.save(tmp_path / "features" / f"b{i}.npy", np.ones((0 if i == 3 else 3, 2), np.float32))
        np.save(tmp_path / "labels" / f"b{i}.npy", np.array(i % 2))
        np.save(tmp_path / "inst_labels" / f"b{i}.npy", np.array([0, 7, 0]) if i == 2 else np.zeros(3 if i < 3 else 0, int))
    np.save(tmp_path / "inst_labels" / "b1.npy", np.array([{"x": 1}] * 3, dtype=object), allow_pickle=True)
    report = ingest_bag_files(tmp_path / "t.zarr", tmp_path / "features", labels_dir=tmp_path / "labels",
                              inst_labels_dir=tmp_path / "inst_labels")
    reasons = {s.bag_id: (s.path, s.reason) for s in report.skipped}
    assert report.added == ("b0",) and set(reasons) == {"b1", "b2", "b3"}, reasons
    assert reasons["b1"][0].endswith("inst_labels/b1.npy") and "cannot read .npy" in reasons["b1"][1]
    assert reasons["b2"][0].endswith("inst_labels/b2.npy") and "row 1 holds 7" in reasons["b2"][1]
    assert "features of shape (0, 2)" in reasons["b3"][1]
    for i in range(4):  # now no bag has a usable label
        np.save(tmp_path / "labels" / f"b{i}.npy", np.array(2))
    from tasks.ingest.errors import IngestError

    with pytest.raises(IngestError, match=r"4 .npy file\(s\) found, 4 left out; first left out: .*b0.npy: MissingLabelError: unusable label file"):
        ingest_bag_files(tmp_path / "u.zarr", tmp_path / "features", labels_dir=tmp_path / "labels",
                         inst_labels_dir=tmp_path / "inst_labels")


def test_coordinates_the_store_cannot_keep_as_integers_are_refused_not_cut_or_wrapped(tmp_path):
    """torchmil coords [0.5, 1.7] were stored as [0, 1] (normalised coordinates all as 0) and NaN as
    -2147483648; an .h5 corner at 2**31 + 5 as -2147483643."""
    for folder in ("features", "labels", "coords"):
        (tmp_path / folder).mkdir()
    bad = {"frac": [[0.5, 1.7], [2.0, 3.0]], "nan": [[0.0, 1.0], [np.nan, 2.0]], "huge": [[0, 1], [2**31 + 5, 2]]}
    for name, coords in {**bad, "good": [[0, 256], [256, 256]]}.items():
        np.save(tmp_path / "features" / f"{name}.npy", np.ones((2, 3), np.float32))
        np.save(tmp_path / "labels" / f"{name}.npy", np.array(1))
        np.save(tmp_path / "coords" / f"{name}.npy", np.array(coords, dtype=np.int64 if name == "huge" else np.float64))
    report = ingest_bag_files(tmp_path / "t.zarr", tmp_path / "features", labels_dir=tmp_path / "labels",
                              coords_dir=tmp_path / "coords")
    reasons = {s.bag_id: (Path(s.path).name, s.reason) for s in report.skipped}
    assert report.added == ("good",) and set(reasons) == set(bad), reasons
    assert reasons["frac"] == ("frac.npy", reasons["frac"][1]) and reasons["frac"][1].startswith("coords row 0 is [0.5, 1.7]: ")
    assert reasons["nan"][1].startswith("coords row 1 is [nan, 2.0]") and reasons["huge"][1].startswith("coords row 1 is [2147483653, 2]")
    (tmp_path / "slides").mkdir()
    write_h5(tmp_path / "slides" / "far.h5", np.zeros((2, 6), np.float32), np.array([[0, 0], [2**31 + 5, 0]], np.int64))
    pd.DataFrame({"slide_id": ["far"], "label": [1]}).to_csv(tmp_path / "labels.csv", index=False)
    (skipped,) = ingest_h5_features(tmp_path / "h5.zarr", tmp_path / "slides", tmp_path / "labels.csv").skipped
    assert skipped.reason.startswith("'coords' row 1 is [2147483653, 0]: patch corners are whole level-0 pixels within int32")


def test_a_clam_or_trident_job_folder_given_in_place_of_its_feature_folder_is_named(tmp_path):
    """A TRIDENT job folder (features_uni_v1/, patches/) or a CLAM one (h5_files/, pt_files/) as the
    source: 'no .h5 feature file to ingest: 0 .h5 file(s) found', with no word of where they are."""
    from tasks.ingest.errors import IngestError

    job = tmp_path / "trident_job"
    (job / "20x_256px_0px_overlap" / "features_uni_v1").mkdir(parents=True)
    (job / "pt_files").mkdir()
    for i in range(2):
        write_h5(job / "20x_256px_0px_overlap" / "features_uni_v1" / f"s{i}.h5", np.zeros((2, 4), np.float32), np.zeros((2, 2)))
        (job / "pt_files" / f"s{i}.pt").write_bytes(b"")
    with pytest.raises(IngestError, match=r"0 .h5 file\(s\) found.*; .h5 files are in its sub-folder\(s\) "
                                          r"20x_256px_0px_overlap/features_uni_v1 \(2 files\): give that folder .*; .pt feature "
                                          r"files \(CLAM's pt_files\) are not read"):
        ingest_h5_features(tmp_path / "s.zarr", job, None)


def test_h5_files_with_batched_coords_are_read_and_an_empty_one_is_named(tmp_path):
    """TRIDENT writes (1, N, 2) coords beside (1, N, D) features: both lose the batch axis; a file
    with no patch is skipped saying so."""
    (tmp_path / "h5").mkdir()
    xy = np.arange(10).reshape(1, 5, 2) * 256
    for name, n, coords in (("batched", 5, xy), ("empty", 0, np.zeros((0, 2)))):
        with h5py.File(tmp_path / "h5" / f"{name}.h5", "w") as handle:
            handle["features"] = np.ones((1, n, 3), np.float32)
            handle["coords"] = coords
    report = ingest_h5_features(tmp_path / "s.zarr", tmp_path / "h5", labels_csv=None)
    assert report.added == ("batched",) and [s.bag_id for s in report.skipped] == ["empty"]
    assert "'features' has shape (1, 0, 3): no patch" in report.skipped[0].reason
    np.testing.assert_array_equal(open_cohort(tmp_path / "s.zarr").read_bags(0, 1).coords, xy[0])


def test_h5_data_kept_outside_the_file_is_refused_and_the_other_file_not_read(tmp_path):
    """HDF5 reads other files for an external link, external raw storage and a virtual dataset: a
    feature file built so would copy e.g. a key file's bytes (read as finite float32) into the
    shared store; such a file is skipped naming what it does, the good file beside it ingested."""
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.arange(24, dtype=np.float32).tobytes())
    (tmp_path / "h5").mkdir()
    with h5py.File(tmp_path / "other.h5", "w") as other:
        other["features"] = np.ones((4, 3), np.float32)
        other["coords"] = np.zeros((4, 2), np.int64)
    layout = h5py.VirtualLayout(shape=(4, 3), dtype=np.float32)
    layout[:] = h5py.VirtualSource(str(tmp_path / "other.h5"), "features", shape=(4, 3))
    coords = np.arange(8).reshape(4, 2) * 256
    for name in ("good", "external_storage", "external_link", "virtual", "coords_link"):
        with h5py.File(tmp_path / "h5" / f"{name}.h5", "w") as handle:
            if name == "external_storage":
                handle.create_dataset("features", shape=(4, 3), dtype=np.float32, external=[(str(secret), 0, 48)])
            elif name == "external_link":
                handle["features"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "features")
            elif name == "virtual":
                handle.create_virtual_dataset("features", layout)
            else:
                handle["features"] = np.ones((4, 3), np.float32)
            handle["coords"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "coords") if name == "coords_link" else coords
    report = ingest_h5_features(tmp_path / "s.zarr", tmp_path / "h5", labels_csv=None)
    assert report.added == ("good",)
    reasons = {s.bag_id: s.reason for s in report.skipped}
    assert set(reasons) == {"external_storage", "external_link", "virtual", "coords_link"}
    assert "'features' keeps its values in" in reasons["external_storage"] and str(secret) in reasons["external_storage"]
    assert f"'features' links to {tmp_path / 'other.h5'}" in reasons["external_link"]
    assert "'features' is a virtual dataset" in reasons["virtual"]
    assert "'coords' links to" in reasons["coords_link"]
    np.testing.assert_array_equal(open_cohort(tmp_path / "s.zarr").read_bags(0, 1).features, np.ones((4, 3)))


def test_an_h5_cohorts_slides_folder_may_be_given_later_or_moved_and_the_store_keeps_the_latest(tmp_path):
    """``ingest.slides`` (heatmap backgrounds) was part of the store's settings: giving it on a
    later night, or moving the project folder, refused every later ingest into the store."""
    (tmp_path / "h5").mkdir()
    for k in range(2):
        with h5py.File(tmp_path / "h5" / f"s{k}.h5", "w") as handle:
            handle["features"], handle["coords"] = np.ones((3, 2), np.float32), np.arange(6).reshape(3, 2) * 256
    store = tmp_path / "s.zarr"
    assert ingest_h5_features(store, tmp_path / "h5", labels_csv=None).added == ("s0", "s1")
    assert open_cohort(store).attrs.get("tiling") is None
    for slides in (tmp_path / "slides", tmp_path / "moved" / "slides"):
        slides.mkdir(parents=True)
        report = ingest_h5_features(store, tmp_path / "h5", labels_csv=None, slides=slides)
        assert report.already_done == ("s0", "s1") and not report.skipped
        assert open_cohort(store).attrs["tiling"] == {"slides_dir": str(slides.resolve())}
    assert ingest_h5_features(store, tmp_path / "h5", labels_csv=None).already_done == ("s0", "s1")
    assert open_cohort(store).attrs["tiling"] == {"slides_dir": str(slides.resolve())}  # not given: the last one stays


def test_a_skipped_input_names_its_bag_where_the_path_does_not():
    from tasks.ingest.driver import Skipped

    row = Skipped(path="/data/labels.csv", bag_id="slide_7", error="MissingLabelError", reason="unusable label")
    file = Skipped(path="/data/slides/slide_8.svs", bag_id="slide_8", error="UnreadableFileError", reason="truncated")
    assert row.line() == "/data/labels.csv [bag slide_7]: MissingLabelError: unusable label"
    assert file.line() == "/data/slides/slide_8.svs: UnreadableFileError: truncated"


def test_a_long_list_of_inputs_left_out_is_named_up_to_a_bound_and_counted():
    """A labels file of the whole cohort beside one night's folder printed a line per slide not there."""
    from tasks.ingest.driver import LEFT_OUT_SHOWN, Skipped, left_out_lines

    skipped = [Skipped(path=f"/slides/s{i}", bag_id=f"s{i}", error="UnreadableFileError", reason="listed but no slide file")
               for i in range(LEFT_OUT_SHOWN + 5)]
    lines = left_out_lines(skipped, "/stores/c.zarr.ingest_report.json")
    assert lines[:LEFT_OUT_SHOWN] == [f"skipped {s.line()}" for s in skipped[:LEFT_OUT_SHOWN]]
    assert lines[LEFT_OUT_SHOWN:] == ["… and 5 more left out: every one in /stores/c.zarr.ingest_report.json"]
    assert left_out_lines(skipped[:3], None) == [f"skipped {s.line()}" for s in skipped[:3]]


def _slide_table(rng: np.random.Generator) -> pd.DataFrame:
    """A Parquet table as teams export it: a slide id, a label, tile coordinates, metadata, features."""
    from decimal import Decimal

    frame = pd.DataFrame({"slide_id": np.repeat(["s0", "s1", "s2"], 4), "label": np.repeat([0, 1, 1], 4),
                          "x": np.tile([0, 256, 0, 256], 3), "y": np.tile([0, 0, 256, 256], 3),
                          "path": [f"/tiles/{k}.png" for k in range(12)]})
    for j in range(3):
        frame[f"feat_{j}"] = rng.normal(size=12).astype(np.float32)
    frame["stain"] = [Decimal(f"{v:.3f}") for v in rng.uniform(size=12)]  # a decimal column is numeric too
    return frame


def test_parquet_columns_name_the_bag_coordinates_and_features_and_the_store_keeps_the_names(tmp_path):
    import zarr

    from tasks.ingest.errors import StoreMismatchError

    frame = _slide_table(np.random.default_rng(5))
    frame.to_parquet(tmp_path / "t.parquet")
    table = read_parquet_table(tmp_path / "t.parquet", bag_column="slide_id", feature_columns="feat_*", coords_columns=["x", "y"])
    assert table.feature_names == ("feat_0", "feat_1", "feat_2") and table.coords_names == ("x", "y")
    ingest_table(tmp_path / "a.zarr", table)
    cohort = open_cohort(tmp_path / "a.zarr")
    np.testing.assert_array_equal(cohort.read_bags(0, 3).features, frame[["feat_0", "feat_1", "feat_2"]].to_numpy(np.float32))
    np.testing.assert_array_equal(zarr.open_group(str(tmp_path / "a.zarr"), mode="r")["instances/coords"][:], frame[["x", "y"]])
    assert cohort.attrs["feature_columns"] == ["feat_0", "feat_1", "feat_2"]
    assert cohort.attrs["coords_meaning"] == "x,y (table columns x, y)"  # the report's heatmaps and GeoJSON read x, y
    # By default every numeric column that is not the bag, label or coordinates: the decimal one too, not the text one.
    default = read_parquet_table(tmp_path / "t.parquet", bag_column="slide_id", coords_columns=["x", "y"])
    assert default.feature_names == ("feat_0", "feat_1", "feat_2", "stain")
    np.testing.assert_allclose(default.X[:, 3], frame["stain"].astype(float), rtol=1e-6)
    # A table of the same width whose features are other columns would mix features that do not compare.
    other = frame.rename(columns={"feat_2": "feat_9"})
    other["slide_id"] = other["slide_id"] + "b"
    other.to_parquet(tmp_path / "other.parquet")
    with pytest.raises(StoreMismatchError, match=r"table columns \[feat_0, feat_1, feat_2\], this ingest's \[feat_0, "
                                                 r"feat_1, feat_9\] \(first difference at feature 2: store 'feat_2', this ingest 'feat_9'\)"):
        ingest_table(tmp_path / "a.zarr", read_parquet_table(tmp_path / "other.parquet", bag_column="slide_id",
                                                             feature_columns="feat_*", coords_columns=["x", "y"]))
    assert open_cohort(tmp_path / "a.zarr").n_bags == 3


@pytest.mark.parametrize("arguments, change, message", [
    ({"bag_column": "slide"}, None, r"lacks the bag column 'slide' \(columns: slide_id, label, x, y, path, feat_0"),
    ({"bag_column": "slide_id", "feature_columns": "emb_*"}, None, r"no column matches feature_columns 'emb_\*'"),
    ({"bag_column": "slide_id", "feature_columns": ["feat_0", "path"]}, None, r"feature columns must be numeric; path \((large_)?string\) are not"),
    ({"bag_column": "slide_id", "feature_columns": ["feat_0", "x"], "coords_columns": ["x", "y"]}, None,
     r"feature columns 'x' \(named as the coords column\) cannot be features too"),
    ({"bag_column": "slide_id", "coords_columns": ["x", "path"]}, None, r"coordinate column 'path' is (large_)?string, not numeric"),
    ({"bag_column": "slide_id", "coords_columns": ["x", "y"]}, lambda f: f.assign(y=f["y"] + 0.5),
     r"coordinate column 'y' holds 0.5 at row 0: coordinates must be integers"),
    ({"bag_column": "slide_id", "coords_columns": ["x", "x"]}, None, r"column 'x' is named twice as a coords column"),
    ({"bag_column": "slide_id", "original_label_column": "label"}, None,
     r"column 'label' is named as the label and the original_label column: each column has one role"),
    ({"bag_column": "slide_id", "feature_columns": ["feat_0", "feat_1", "feat_0"]}, None, r"feature columns named twice: \['feat_0'\]"),
])
def test_parquet_columns_that_do_not_fit_the_table_are_refused_naming_the_file_and_column(tmp_path, arguments, change, message):
    from tasks.ingest.errors import IngestError

    frame = _slide_table(np.random.default_rng(6))
    (change(frame) if change else frame).to_parquet(tmp_path / "t.parquet")
    with pytest.raises(IngestError, match=message) as error:
        read_parquet_table(tmp_path / "t.parquet", **arguments)
    assert error.value.path == str(tmp_path / "t.parquet")


def test_a_config_names_the_columns_of_a_parquet_table(tmp_path):
    """``ingest.columns`` goes from the YAML through the ingest task; a column the table lacks is
    refused before anything runs, and the section applies to Parquet tables only."""
    from flows.checks import check_inputs
    from flows.config import ConfigError, load_config
    from tasks.prefect_tasks import ingest_table as ingest_task

    frame = _slide_table(np.random.default_rng(7))
    frame.to_parquet(tmp_path / "t.parquet")

    def load(columns: str, source: str = "t.parquet"):
        path = tmp_path / "c.yaml"
        path.write_text(f"name: t\nstore: {source}.zarr\noutput_dir: out\ningest:\n  kind: features\n  source: {source}\n"
                        f"  columns: {columns}\n")
        return load_config(path, preflight=lambda config: check_inputs(config, "ingest"))

    shutil.copy(tmp_path / "t.parquet", tmp_path / "T.PARQUET")  # the suffix in capitals reads the same
    for source in ("t.parquet", "T.PARQUET"):
        config = load("{bag: slide_id, features: 'feat_*', coords: [x, y]}", source)
        assert list(ingest_task.fn(config).info["added"]) == ["s0", "s1", "s2"]
        assert open_cohort(config.store).attrs["feature_columns"] == ["feat_0", "feat_1", "feat_2"]
    with pytest.raises(ConfigError, match=r"ingest.columns: .*t\.parquet has no column 'slide', 'u' \(its columns: slide_id, label"):
        load("{bag: slide, coords: [x, u]}")
    with pytest.raises(ConfigError, match=r"columns applies to a Parquet feature table"):
        load("{bag: slide_id}", source="t.csv")


def test_table_instance_labels_text_labels_and_missing_features_are_read_or_refused_by_name(tmp_path):
    """Instance labels must be 0, 1 or -1 (a Parquet null is -1, unknown; 2 or text is refused, not
    stored as a wrong int8); a label column of text digits reads as numbers; a missing feature
    cell is named by its column; a schema with two columns of one name is refused."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.ingest.errors import IngestError, MissingLabelError

    frame = pd.DataFrame({"bag_id": ["a", "a", "b", "b"], "label": ["0", "0", "1", "1"], "f0": [1.0, 2, 3, 4],
                          "zz": [1.0, 2, None, 4], "inst": pd.array([0, None, 1, 0], dtype="Int64")})
    frame.to_parquet(tmp_path / "t.parquet")
    table = read_parquet_table(tmp_path / "t.parquet", instance_label_column="inst")
    assert table.labels.tolist() == [0, 0, 1, 1] and table.instance_labels.tolist() == [0, -1, 1, 0]
    report = ingest_table(tmp_path / "t.zarr", table)
    assert report.added == ("a",) and [(s.bag_id, s.error) for s in report.skipped] == [("b", "NonFiniteFeaturesError")]
    assert "rows [2] of the file, columns ['zz']" in report.skipped[0].reason
    frame.assign(inst=["0", "1", "1", "-1"]).to_parquet(tmp_path / "text.parquet")  # text digits read as numbers
    assert read_parquet_table(tmp_path / "text.parquet", instance_label_column="inst").instance_labels.tolist() == [0, 1, 1, -1]
    for values, shown in (([0, 2, 1, 0], "row 1 holds 2"), (["neg", "neg", "pos", "neg"], "row 0 holds 'neg'")):
        frame.assign(inst=values).to_parquet(tmp_path / "bad.parquet")
        with pytest.raises(MissingLabelError, match=rf"instance labels \(column 'inst'\) must be 0, 1 or -1 \(unknown\); {shown}") as refused:
            read_parquet_table(tmp_path / "bad.parquet", instance_label_column="inst")
        assert refused.value.path == str(tmp_path / "bad.parquet")
    np.savez(tmp_path / "t.npz", X=np.ones((4, 2)), bag_ids=np.array(["a", "a", "b", "b"]), labels=np.array([0, 0, 1, 1]),
             instance_labels=np.array([0, 0, 7, 1]))
    with pytest.raises(MissingLabelError, match=r"instance labels must be 0, 1 or -1 \(unknown\); row 2 holds 7"):
        read_npz_table(tmp_path / "t.npz")
    pq.write_table(pa.table([pa.array(["a", "b"]), pa.array([0, 1]), pa.array([1.0, 2.0]), pa.array([3.0, 4.0])],
                            names=["bag_id", "label", "f", "f"]), tmp_path / "twice.parquet")
    with pytest.raises(IngestError, match=r"columns named twice: \['f'\]"):
        read_parquet_table(tmp_path / "twice.parquet")


def test_the_row_index_pandas_writes_is_no_feature_and_a_plus_minus_one_table_is_told_why_it_cannot_train(tmp_path):
    from mil_core import VGPMIL
    from tasks.training import fit_cohort

    frame = pd.DataFrame({"bag_id": list("aabbccdd"), "label": [-1, -1, 1, 1, -1, -1, 1, 1], "f": np.arange(8.0)})
    frame.sample(frac=1, random_state=0).to_parquet(tmp_path / "t.parquet")  # index=True: '__index_level_0__'
    table = read_parquet_table(tmp_path / "t.parquet")
    assert table.feature_names == ("f",)
    ingest_table(tmp_path / "t.zarr", table)
    with pytest.raises(ValueError, match=r"bag labels found: \[-1, 1\] \(-1 marks an unlabelled bag in a store: a table "
                                         r"labelled -1/\+1 needs 0 for its negative bags\)"):
        fit_cohort(VGPMIL(), str(tmp_path / "t.zarr"), None)


@pytest.mark.parametrize("kind", ["h5", "npy"])
def test_nonfinite_drop_applies_to_h5_and_torchmil_folders(tmp_path, kind):
    """ingest.nonfinite: drop was read for tables only: an .h5 or .npy bag with one NaN tile was
    skipped whole, its message advising the setting that was already set."""
    from flows.config import load_config
    from tasks.prefect_tasks import ingest_table as ingest_task

    rng = np.random.default_rng(3)
    features = {f"s{i}": rng.normal(size=(4, 3)).astype(np.float32) for i in range(3)}
    features["s1"][2, 1] = np.nan
    source = tmp_path / "data"
    if kind == "h5":
        source.mkdir()
        for name, X in features.items():
            write_h5(source / f"{name}.h5", X, np.arange(8).reshape(4, 2) * 256)
        (tmp_path / "labels.csv").write_text("slide_id,label\ns0,0\ns1,1\ns2,1\n")
        labels = f", labels: {tmp_path / 'labels.csv'}"
    else:
        for folder in ("features", "labels"):
            (source / folder).mkdir(parents=True)
        for i, (name, X) in enumerate(features.items()):
            np.save(source / "features" / f"{name}.npy", X)
            np.save(source / "labels" / f"{name}.npy", np.array(int(i > 0)))
        labels = ""
    for policy, added in (("reject", ["s0", "s2"]), ("drop", ["s0", "s1", "s2"])):
        config = tmp_path / f"{policy}.yaml"
        config.write_text(f"name: t\nstore: {tmp_path / policy}.zarr\noutput_dir: {tmp_path / 'out'}\n"
                          f"ingest: {{kind: {kind}, source: {source}, nonfinite: {policy}{labels}}}\n")
        info = ingest_task.fn(load_config(config)).info
        assert sorted(info["added"]) == added and info["dropped_nonfinite"] == ({"s1": 1} if policy == "drop" else {})
    assert open_cohort(tmp_path / "drop.zarr").n_instances == 11


def test_h5_files_without_coords_make_a_cohort_without_positions_and_one_cohort_does_not_mix_the_two(tmp_path):
    """An .h5 file without ``coords`` was stored with every patch at (0, 0) and reported as level-0
    pixels: its GeoJSON stacked all tiles on one square and its heatmap showed one tile."""
    rng = np.random.default_rng(3)
    plain, mixed = tmp_path / "plain", tmp_path / "mixed"
    plain.mkdir()
    mixed.mkdir()
    for i in range(2):
        with h5py.File(plain / f"p{i}.h5", "w") as handle:
            handle["features"] = rng.normal(size=(4, 3)).astype(np.float32)
    write_h5(mixed / "m0.h5", np.zeros((3, 3), np.float32), np.arange(6).reshape(3, 2) * 256)
    (tmp_path / "labels.csv").write_text("slide_id,label\np0,1\np1,0\nm0,1\n")

    report = ingest_h5_features(tmp_path / "plain.zarr", plain, tmp_path / "labels.csv")
    cohort = open_cohort(tmp_path / "plain.zarr")
    assert sorted(report.added) == ["p0", "p1"] and cohort.attrs["coords_meaning"] == "instance_index"
    np.testing.assert_array_equal(cohort.read_bags(0, 1).coords[:, 0], np.arange(4))  # the patch's index in its bag

    again = ingest_h5_features(tmp_path / "plain.zarr", mixed, tmp_path / "labels.csv")
    (refused,) = [s for s in again.skipped if s.bag_id == "m0"]  # (p0, p1: listed, their files in the other folder)
    assert again.added == () and refused.error == "FeatureDimensionError"
    assert "a 'coords' dataset, but this cohort was made from files without patch positions" in refused.reason
    with h5py.File(mixed / "m1.h5", "w") as handle:
        handle["features"] = np.zeros((2, 3), np.float32)
    (tmp_path / "labels.csv").write_text("slide_id,label\nm0,1\nm1,0\n")
    positioned = ingest_h5_features(tmp_path / "mixed.zarr", mixed, tmp_path / "labels.csv")
    assert positioned.added == ("m0",) and positioned.skipped[0].bag_id == "m1"
    assert "no 'coords' dataset, but this cohort's files have patch positions" in positioned.skipped[0].reason


def test_an_h5_files_patch_size_is_read_from_trident_and_clam_attributes(tmp_path):
    """An attribute that is no number (TRIDENT writes a missing one as the text 'None') failed the
    report of the whole run, after training and prediction: it says no side."""
    from tasks.ingest.h5 import h5_patch_side

    cases = {"trident": {"patch_size": 256, "patch_size_level0": 512}, "clam": {"patch_size": 256, "patch_level": 1, "downsample": [4.0, 4.0]},
             "level0": {"patch_size": 224, "patch_level": 0}, "unknown_level": {"patch_size": 256}, "none": {},
             "text": {"patch_size": 256, "patch_size_level0": "None"}, "text_level": {"patch_size": b"256", "patch_level": "zero"}}
    for name, attrs in cases.items():
        write_h5(tmp_path / f"{name}.h5", np.zeros((2, 3), np.float32), np.zeros((2, 2)))
        with h5py.File(tmp_path / f"{name}.h5", "a") as handle:
            handle["coords"].attrs.update(attrs)
    assert {name: h5_patch_side(tmp_path / f"{name}.h5") for name in cases} == {
        "trident": 512.0, "clam": 1024.0, "level0": 224.0, "unknown_level": None, "none": None, "text": None, "text_level": None}
    assert h5_patch_side(tmp_path / "gone.h5") is None


@pytest.mark.parametrize("kind", ["h5", "npy"])
def test_a_feature_folder_is_staged_by_the_clusters_workers_one_task_per_file(tmp_path, kind):
    """The pipeline's .h5/.npy ingest ran every file in the flow's process while the cluster's
    workers sat idle (a probe's 200 slides × 768 features: 48 CPU-s in the flow's process, the workers idle)."""
    from distributed import Client, LocalCluster, get_task_stream

    from flows.config import PipelineConfig
    from tasks.prefect_tasks import ingest_table as ingest_task

    source = tmp_path / kind
    rng = np.random.default_rng(3)
    if kind == "h5":
        source.mkdir()
        for i in range(4):
            write_h5(source / f"s{i}.h5", rng.normal(size=(5, 3)).astype(np.float32), np.arange(10).reshape(5, 2) * 256)
        (tmp_path / "labels.csv").write_text("slide_id,label\ns0,0\ns1,1\ns2,0\ns3,1\n")
    else:
        for folder in ("features", "labels"):
            (source / folder).mkdir(parents=True)
        for i in range(4):
            np.save(source / "features" / f"s{i}.npy", rng.normal(size=(5, 3)).astype(np.float32))
            np.save(source / "labels" / f"s{i}.npy", np.array(i % 2))
    config = PipelineConfig.model_validate({"name": "f", "store": str(tmp_path / "f.zarr"), "output_dir": str(tmp_path / "out"),
                                            "ingest": {"kind": kind, "source": str(source)} | (
                                                {"labels": str(tmp_path / "labels.csv")} if kind == "h5" else {})})
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=":0") as cluster, \
            Client(cluster) as client, get_task_stream(client) as stream:
        result = ingest_task.fn(config, cluster.scheduler_address)
    assert sorted(result.info["added"]) == ["s0", "s1", "s2", "s3"]
    staged = [task for task in stream.data if str(task["key"]).startswith("_stage_one")]
    assert len(staged) == 4
    assert open_cohort(config.store).n_bags == 4


def test_a_mil_csv_as_a_spreadsheet_exports_it_reads_or_is_named(tmp_path):
    """Rows and columns of empty cells at the end (a spreadsheet's export) refused the whole table
    ("no bag id at row(s) [3, 4]") or made every bag "NaN in feature columns [3, 4]"; a semicolon
    file with decimal commas was read into bag ids such as '1;a;0'."""
    from tasks.ingest.errors import IngestError

    (tmp_path / "tail.csv").write_text("1,a,0.1,0.2,,\n1,a,0.3,0.4,,\n0,b,0.5,0.6,,\n,,,,,\n,,,,,\n")
    table = read_mil_csv(tmp_path / "tail.csv")
    assert table.X.shape == (3, 2) and list(table.bag_ids) == ["a", "a", "b"] and not table.row_problems
    (tmp_path / "ids.csv").write_text("1,case;A,0.5,0.1\n0,case;B,0.2,0.3\n")  # a ';' in a bag id is no separator
    assert list(read_mil_csv(tmp_path / "ids.csv").bag_ids) == ["case;A", "case;B"]
    (tmp_path / "semi.csv").write_text("1;a;0,1;0,2\n0;b;0,5;0,6\n")
    with pytest.raises(IngestError, match="looks semicolon-separated"):
        read_mil_csv(tmp_path / "semi.csv")


def test_a_blank_or_bad_label_cell_fails_its_own_bag_not_the_table(tmp_path):
    """A nullable ``boolean`` or text label column with one blank (pandas and R write them) made the
    ingest fail with ``TypeError: '<' not supported between 'NoneType' and 'bool'`` naming nothing;
    one ``?`` in a MIL CSV's label column kept the whole column text and skipped every bag as "got ['0']"."""
    for name, labels in (("boolean", pd.array([True, True, False, None, False, False], dtype="boolean")),
                         ("text", ["1", "1", "0", None, "0", "0"]), ("Int64", pd.array([1, 1, 0, None, 0, 0], dtype="Int64"))):
        pd.DataFrame({"bag_id": ["a", "a", "b", "b", "c", "c"], "label": labels,
                      "f1": np.arange(6.0), "f2": np.ones(6)}).to_parquet(tmp_path / f"{name}.parquet")
        report = ingest_table(tmp_path / f"{name}.zarr", read_parquet_table(tmp_path / f"{name}.parquet"))
        assert report.added == ("a", "c"), name
        beside = "[False]" if name == "boolean" else "[0]"
        assert [(s.bag_id, s.reason) for s in report.skipped] == [("b", f"empty bag label (a blank cell) beside {beside}")], name
        cohort = open_cohort(tmp_path / f"{name}.zarr")
        assert list(cohort.bag_labels) == [1, 0], name
        # the originals a store ingested before keeps (True/False are 'true'/'false'): a rerun finds them unchanged
        assert list(cohort.original_labels) == ({"boolean": [True, False]}.get(name, [1, 0])), name
    rows = [f"{b % 2},bag{b},{b}.5,1.0" for b in range(6) for _ in range(2)]
    rows[-1] = "?,bag5,5.5,1.0"
    (tmp_path / "mil.csv").write_text("\n".join(rows) + "\n")
    report = ingest_table(tmp_path / "mil.zarr", read_mil_csv(tmp_path / "mil.csv"))
    assert report.added == ("bag0", "bag1", "bag2", "bag3", "bag4")
    assert [(s.bag_id, s.reason) for s in report.skipped] == [
        ("bag5", "bag label must be one of 0, 1, -1 and equal on all rows; got [1, '?']")]


def test_a_mil_csv_saved_with_pandas_column_numbers_as_its_header_is_refused(tmp_path):
    """``pd.DataFrame(array).to_csv(index=False)`` writes ``0,1,2,…`` first: read as an instance of a
    bag ``'1'`` (label 0, features 2, 3, 4) beside the real ones."""
    from tasks.ingest.errors import IngestError

    rows = np.array([[b % 2, b, *np.random.default_rng(b).normal(size=3)] for b in range(6) for _ in range(3)])
    pd.DataFrame(rows).to_csv(tmp_path / "numbered.csv", index=False)
    with pytest.raises(IngestError, match=r"line 1 \(0, 1, 2, 3, …, 4\) looks like the header pandas writes.*numbered.csv"):
        read_mil_csv(tmp_path / "numbered.csv")
    pd.DataFrame(rows).to_csv(tmp_path / "plain.csv", index=False, header=False)
    assert read_mil_csv(tmp_path / "plain.csv").X.shape == (18, 3)


def test_torchmil_label_files_of_more_than_one_value_and_labelled_bags_without_features_are_named(tmp_path):
    """A one-hot ``labels/<bag>.npy`` (``[0, 1]``) was read as its first entry: every label
    inverted, without a word; a bag the labels list whose ``.npy`` features are missing was dropped
    unsaid (the ``.h5`` folders name it)."""
    from tasks.ingest.labels import LabelSpec

    for folder in ("features", "labels"):
        (tmp_path / folder).mkdir()
    for bag, label in (("pos1", 1), ("neg1", 0), ("onehot", [0, 1])):
        np.save(tmp_path / "features" / f"{bag}.npy", np.ones((3, 2), dtype=np.float32))
        np.save(tmp_path / "labels" / f"{bag}.npy", np.array(label))
    np.save(tmp_path / "labels" / "nofeatures.npy", np.array(1))
    report = ingest_bag_files(tmp_path / "dir.zarr", tmp_path / "features", labels_dir=tmp_path / "labels")
    assert report.added == ("neg1", "pos1")
    reasons = {s.bag_id: s.reason for s in report.skipped}
    assert reasons["onehot"] == "unusable label file: it holds 2 values of shape (2,), a bag label file holds one (0 or 1)"
    assert reasons["nofeatures"] == f"listed in {tmp_path / 'labels'} but no feature file nofeatures.npy in {tmp_path / 'features'}"
    (tmp_path / "labels.csv").write_text("slide_id,label\npos1,1\nneg1,0\nonehot,1\ns3,1\n")
    report = ingest_bag_files(tmp_path / "file.zarr", tmp_path / "features", labels_file=LabelSpec(str(tmp_path / "labels.csv")))
    assert report.added == ("neg1", "onehot", "pos1")
    assert [(s.bag_id, s.reason) for s in report.skipped] == [
        ("s3", f"listed in {tmp_path / 'labels.csv'} but no feature file s3.npy in {tmp_path / 'features'}")]


def test_a_new_cohorts_bag_whose_id_the_labels_give_with_a_suffix_is_named_not_kept_unlabelled(tmp_path):
    """``gpmil predict --source … --labels`` ingests with unlabelled bags kept: a labels file of
    ``s1.svs`` beside ``s1.h5`` lost every label without a word (no metrics, no reason)."""
    (tmp_path / "h5").mkdir()
    for stem in ("s1", "s2", "s3"):
        with h5py.File(tmp_path / "h5" / f"{stem}.h5", "w") as handle:
            handle["features"] = np.ones((3, 4), dtype=np.float32)
            handle["coords"] = np.arange(6).reshape(3, 2) * 256
    (tmp_path / "labels.csv").write_text("slide_id,label\ns1.svs,1\ns2,0\n")
    report = ingest_h5_features(tmp_path / "k.zarr", tmp_path / "h5", tmp_path / "labels.csv", keep_unlabelled=True)
    assert report.added == ("s2", "s3")  # s3: not in the labels, predicted unlabelled
    assert [(s.bag_id, s.reason) for s in report.skipped] == [
        ("s1", f"no label in {tmp_path / 'labels.csv'} (it has 's1.svs': ids must equal the file stem, in its case, without spaces or suffixes)")]
    assert list(open_cohort(tmp_path / "k.zarr").bag_labels) == [0, -1]


def test_a_file_whose_id_differs_from_another_present_file_only_by_case_is_its_own_bag(tmp_path):
    """Case7.h5 and case7.h5 side by side, the labels naming Case7: case7 was skipped as a near miss
    of 'Case7' (and with the labels' case8 row, a labels row of a missing file went unreported)."""
    from tasks.ingest.labels import ids_without_input

    (tmp_path / "h5").mkdir()
    for stem in ("Case7", "case7", "case8"):
        write_h5(tmp_path / "h5" / f"{stem}.h5", np.zeros((2, 3), np.float32), np.zeros((2, 2)))
    (tmp_path / "labels.csv").write_text("slide_id,label\nCase7,1\ncase8,0\n")
    report = ingest_h5_features(tmp_path / "s.zarr", tmp_path / "h5", tmp_path / "labels.csv", keep_unlabelled=True)
    assert report.added == ("Case7", "case7", "case8") and not report.skipped
    assert ids_without_input({"A1": 1, "a1": 0}, ["a1"]) == ["A1"]  # a1.h5 is a1's: A1's file is missing
    for rows in ("CASE7,1\nCase7,0\n", "Case7,0\nCASE7,1\n"):  # whichever row comes first: case7 is told of CASE7
        (tmp_path / "labels.csv").write_text("slide_id,label\n" + rows)
        report = ingest_h5_features(tmp_path / "t.zarr", tmp_path / "h5", tmp_path / "labels.csv", keep_unlabelled=True)
        assert [(s.bag_id, "it has 'CASE7'" in s.reason) for s in report.skipped] == [("case7", True)]
    assert ids_without_input({"A1": 1}, ["a1"]) == []  # said by a1's near-id hint instead
